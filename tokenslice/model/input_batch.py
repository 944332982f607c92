"""DecodeBatch: the decode rows' block tables kept between steps (vLLM v1's persistent input
batch), so a step updates what changed instead of rebuilding every table from the plan.

A request keeps its row while it decodes in consecutive steps; its table then only grows, one
block at a time (KVManager appends; a running request's blocks never move). A request that
skips a step may have been preempted, swapped or dropped, so its row is freed, and when it
decodes again its whole table is written anew: token-level preemption stays exact without the
runner knowing why a request left. A request can also be evicted and loaded back into other
blocks while one plan is built (reactive swap): a plan that swaps KV in rewrites every row. Per step: one dict lookup and one length read per request,
a table write only for the rows that grew, and one vectorised gather of the rows in plan order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenslice.plan import SeqSlice


@dataclass
class DecodeInputs:
    """One step's decode rows in plan order, as host arrays (int64)."""

    token_ids: np.ndarray  # [D] the token each row computes
    positions: np.ndarray  # [D] its position (= tokens already cached)
    tables: np.ndarray  # [D, W] block tables, W = the longest; padded with block 0


class DecodeBatch:
    def __init__(self, rows: int = 8, width: int = 8) -> None:
        self._tables = np.zeros((rows, width), dtype=np.int64)
        self._lens = np.zeros(rows, dtype=np.int64)  # blocks written per row
        self._row: dict[str, int] = {}  # request id -> row, for the requests of the last step
        self._free: list[int] = list(range(rows - 1, -1, -1))
        # What the updates did (tests check the incremental path is the one taken).
        self.rows_written = 0  # whole tables written (a request joining the decode batch)
        self.rows_grown = 0  # tables extended by new blocks

    def __len__(self) -> int:
        return len(self._row)

    def update(self, decode: list[SeqSlice], kv_moved: bool = False) -> DecodeInputs:
        """`kv_moved`: the step loads KV onto the device (the plan's swap_in), so a request may
        have been evicted and loaded back into other blocks while building this very plan,
        without skipping a step: every row is written anew."""
        ids = [s.request_id for s in decode]
        if len(set(ids)) != len(ids):
            raise ValueError("a request appears twice among the decode slices")
        row_of = self._row
        # The usual step: the same requests as the last one (plain Python: numpy's per-call cost
        # exceeds the work at these sizes).
        if kv_moved or len(row_of) != len(ids) or not all(r in row_of for r in ids):
            gone = row_of.keys() if kv_moved else row_of.keys() - set(ids)
            for rid in list(gone):  # left the batch (or KV moved): its blocks may have changed
                self._free.append(row_of.pop(rid))
            for s in decode:
                if s.request_id not in row_of:
                    self._write(s)
        rows = [row_of[r] for r in ids]
        width = 0
        for row, s in zip(rows, decode):
            n = len(s.block_table)
            width = max(width, n)
            if n > self._lens[row]:  # a new block, every block_size steps
                self._extend(row, s.block_table)
                self.rows_grown += 1
        return DecodeInputs(
            token_ids=np.fromiter((s.token_ids[0] for s in decode), dtype=np.int64, count=len(ids)),
            positions=np.fromiter((s.start_pos for s in decode), dtype=np.int64, count=len(ids)),
            tables=self._tables[rows, :width])

    def _write(self, s: SeqSlice) -> None:
        if not self._free:
            self._grow_rows()
        row = self._free.pop()
        self._row[s.request_id] = row
        self._tables[row] = 0  # padding reads block 0, as tables built from the plan do
        self._lens[row] = 0
        self._extend(row, s.block_table)
        self.rows_written += 1

    def _extend(self, row: int, table: list[int]) -> None:
        start, n = int(self._lens[row]), len(table)
        if n > self._tables.shape[1]:
            grown = np.zeros((self._tables.shape[0], max(n, 2 * self._tables.shape[1])), dtype=np.int64)
            grown[:, :self._tables.shape[1]] = self._tables
            self._tables = grown
        self._tables[row, start:n] = table[start:n]
        self._lens[row] = n

    def _grow_rows(self) -> None:
        old = self._tables.shape[0]
        self._tables = np.concatenate([self._tables, np.zeros_like(self._tables)])
        self._lens = np.concatenate([self._lens, np.zeros_like(self._lens)])
        self._free.extend(range(2 * old - 1, old - 1, -1))


def decode_inputs(decode: list[SeqSlice]) -> DecodeInputs:
    """The same arrays built from the plan alone (no state): the reference the tests compare
    with, and the path of one-off forward passes."""
    width = max((len(s.block_table) for s in decode), default=0)
    tables = np.zeros((len(decode), width), dtype=np.int64)
    for i, s in enumerate(decode):
        tables[i, :len(s.block_table)] = s.block_table
    return DecodeInputs(np.array([s.token_ids[0] for s in decode], dtype=np.int64).reshape(-1),
                        np.array([s.start_pos for s in decode], dtype=np.int64).reshape(-1), tables)
