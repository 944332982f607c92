"""The two tiers of KV blocks and each request's block table on each (docs/DESIGN.md, KVManager).

Tables only plan; the model runner owns the tensors. Two tiers: a device pool and a host pool.
Each request's KV is either all on device, all on host (swapped out), or nowhere (dropped: it
recomputes).
"""
from __future__ import annotations

from typing import Literal

from tokenslice.kv.blocks import BlockPool

Residency = Literal["device", "host", "none"]


class BlockTables:
    """A device pool, a host pool, and the blocks each request holds on each (never an empty table)."""

    def __init__(self, block_size: int, num_device_blocks: int, num_host_blocks: int = 0, *,
                 contiguous: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        # contiguous: block-group placement (FastSwitch) so swaps need few copies.
        self.device = BlockPool(num_device_blocks, contiguous=contiguous)
        self.host = BlockPool(num_host_blocks, contiguous=contiguous)
        self._tables: dict[str, list[int]] = {}  # device blocks per request (never empty)
        self._host_tables: dict[str, list[int]] = {}  # host blocks per request (never empty)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_device_blocks(self) -> int:
        return self.device.num_free

    @property
    def num_free_host_blocks(self) -> int:
        return self.host.num_free

    @property
    def peak_host_blocks(self) -> int:
        return self.host.peak_used

    @property
    def capacity_tokens(self) -> int:
        return self.device.num_blocks * self.block_size

    def holds(self, request_id: str) -> bool:
        """The request has KV on device."""
        return bool(self._tables.get(request_id))

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_device_blocks(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ()))

    def host_blocks(self, request_id: str) -> list[int]:
        return self._host_tables.get(request_id, [])

    def residency(self, request_id: str) -> Residency:
        if request_id in self._tables:
            return "device"
        if request_id in self._host_tables:
            return "host"
        return "none"

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra device blocks a request needs so that `num_tokens` tokens fit."""
        return max(0, self.blocks_for_tokens(num_tokens) - self.num_device_blocks(request_id))

    def steps_that_fit(self, seqs: list[tuple[str, int]], max_steps: int, free_blocks: int) -> int:
        """The most steps k <= max_steps for which growing every (request, tokens) by k tokens
        needs at most `free_blocks` new device blocks (growth is monotone in k: bisect)."""
        def growth(steps: int) -> int:
            return sum(self.blocks_needed(rid, tokens + steps) for rid, tokens in seqs)

        if growth(max_steps) <= free_blocks:
            return max_steps
        lo, hi = 0, max_steps
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if growth(mid) <= free_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _grow_table(self, request_id: str, n: int) -> list[int]:
        """Append `n` new device blocks to the request's table; returns them."""
        table = self._tables.get(request_id)
        # Extending the last block's run keeps a growing request in one copy (FastSwitch).
        new = self.device.allocate(n, table[-1] if table and self.device.contiguous else None)
        if table is None:
            self._tables[request_id] = list(new)  # the caller may keep `new`; the table is ours
        else:
            table.extend(new)
        return new

    def owners(self) -> dict[str, list[int]]:
        return {rid: list(t) for rid, t in self._tables.items()}

    def host_owners(self) -> dict[str, list[int]]:
        return {rid: list(t) for rid, t in self._host_tables.items()}
