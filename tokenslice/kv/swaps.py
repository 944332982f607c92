"""Block tables whose requests move between tiers: swaps and transfers in flight (docs/DESIGN.md, KVManager).

A swap only moves bookkeeping and returns (source, destination) block pairs for the executor to
copy (StepPlan.swap_out / swap_in); KVManager (kv/manager.py) makes the swaps, reusing copies the
destination tier has cached.

Transfer contract
-----------------
* Synchronous move (no window open): `swap_out` / `swap_in` free the source blocks at once, so
  later allocations of the same plan may reuse them. Safe because the executor performs the
  plan's copies in plan order (swap_out, then swap_in) before the step's compute: a reused
  block is read before it is written. The one unsafe reuse, a host block freed by a swap-in
  becoming a swap-out destination of the same plan (that copy runs first), is prevented by
  holding swap-in sources until `end_plan()`, which the scheduler calls once a plan is built.
* Asynchronous move (FastServe §4.2 proactive offload, FastSwitch async swap-in):
  `begin_transfer(r)`, then at most one `swap_out(r)` or `swap_in(r)`, then `end_transfer(r)`
  once the executor reports the copy done. Inside the window the source blocks stay reserved
  (used, never reallocated) and `r` is not ready; `end_transfer` releases the sources.
* Abort or drop mid-transfer: `free(r)` / `drop(r)` release nothing while `r`'s window is
  open: all its blocks on both tiers stay reserved and are released by `end_transfer(r)`.
  The executor calls for `end_transfer` when the copy completed *or* it confirmed the copy was
  cancelled: either way the hardware no longer touches those blocks. Until then `r` stays in
  flight (not ready; `ensure` and swaps refuse it), so no block is ever double-owned or leaked.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenslice.kv.blocks import BlockPool, OutOfBlocksError
from tokenslice.kv.tables import BlockTables


@dataclass
class _Transfer:
    """An open transfer window of one request (begin_transfer .. end_transfer)."""

    moved: bool = False  # one swap per window: a second would copy data still in flight
    held_device: list[int] = field(default_factory=list)  # reserved for the copy, in no table
    held_host: list[int] = field(default_factory=list)
    host_copies: list[tuple[int, int]] = field(default_factory=list)  # (hash, host block) KVManager caches once landed


class SwapTables(BlockTables):
    """BlockTables with moves between the tiers under the transfer contract (see module doc)."""

    def __init__(self, block_size: int, num_device_blocks: int, num_host_blocks: int = 0, *,
                 contiguous: bool = False) -> None:
        super().__init__(block_size, num_device_blocks, num_host_blocks, contiguous=contiguous)
        self._transfers: dict[str, _Transfer] = {}
        self._plan_held_host: list[int] = []  # sources of this plan's sync swap-ins (end_plan frees)

    def ensure(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's table to hold `num_tokens` tokens; returns the new blocks."""
        need = self.blocks_needed(request_id, num_tokens)
        if need == 0:
            return []
        if request_id in self._transfers:
            raise ValueError(f"ensure({request_id!r}): its KV is in flight; wait for end_transfer")
        if request_id in self._host_tables:
            raise ValueError(f"ensure({request_id!r}): its KV is on host; swap_in first")
        return self._grow_table(request_id, need)

    def free(self, request_id: str) -> int:
        """Release every block of the request on both tiers; returns how many were released
        now (0 while a transfer window is open: end_transfer releases them). Cached blocks stay
        in the prefix cache."""
        return self._release(request_id)

    def drop(self, request_id: str) -> int:
        """Discard the request's KV on both tiers; it stays live and recomputes (free's
        bookkeeping; its block hashes are kept: its tokens do not change)."""
        return self._release(request_id)

    def _release(self, request_id: str) -> int:
        device = self._tables.pop(request_id, None)
        host = self._host_tables.pop(request_id, None)
        t = self._transfers.get(request_id)
        if t is not None:  # the copy may still touch them: hand them to the window
            t.held_device.extend(device or ())
            t.held_host.extend(host or ())
            return 0
        if device:
            self.device.free(device)
        if host:
            self.host.free(host)
        return len(device or ()) + len(host or ())

    # ---- swapping ---------------------------------------------------------------------------
    def can_swap_out(self, request_id: str) -> bool:
        table = self._tables.get(request_id)
        return bool(table) and not self._moved(request_id) and len(table) <= self.host.num_free

    def can_swap_in(self, request_id: str) -> bool:
        table = self._host_tables.get(request_id)
        return bool(table) and not self._moved(request_id) and len(table) <= self.device.num_free

    def _move(self, op: str, request_id: str, src_tables: dict[str, list[int]], src: BlockPool,
              dst_tables: dict[str, list[int]], dst: BlockPool, kept: list[int] | None = None
              ) -> list[tuple[int, int]]:
        """One swap, either way: allocate on the destination tier, retarget the table, release
        the source (now or at end_transfer); returns (source block, destination block) pairs.
        `kept`: destination blocks (held) that already hold the leading source blocks' KV."""
        kept = kept or []
        table = src_tables.get(request_id)
        where = "device" if src is self.device else "host"
        if not table:
            raise ValueError(f"{op}({request_id!r}): no KV on {where} (residency {self.residency(request_id)})")
        if self._moved(request_id):
            raise ValueError(f"{op}({request_id!r}): already moved in this transfer window")
        if len(table) - len(kept) > dst.num_free:
            if kept:
                dst.free(kept)
            other = "host" if where == "device" else "device"
            raise OutOfBlocksError(f"{op}({request_id!r}) needs {len(table)} {other} blocks, "
                                   f"{dst.num_free} free; check can_{op} first")
        new = dst.allocate(len(table) - len(kept))
        del src_tables[request_id]
        dst_tables[request_id] = kept + new
        self._release_source(request_id, src, table)
        return list(zip(table[len(kept):], new))

    def _moved(self, request_id: str) -> bool:
        t = self._transfers.get(request_id)
        return t is not None and t.moved

    def _release_source(self, request_id: str, pool: BlockPool, blocks: list[int]) -> None:
        t = self._transfers.get(request_id)
        if t is None:  # synchronous move: copied before anything of this plan writes them
            if pool is self.host:
                self._plan_held_host.extend(blocks)
            else:
                pool.free(blocks)
            return
        t.moved = True
        (t.held_device if pool is self.device else t.held_host).extend(blocks)

    # ---- in-flight transfers ----------------------------------------------------------------
    def begin_transfer(self, request_id: str) -> None:
        """Open the request's transfer window: a swap inside it keeps its sources reserved and
        the request is not ready until end_transfer."""
        if request_id in self._transfers:
            raise ValueError(f"begin_transfer({request_id!r}): a transfer is already in flight")
        self._transfers[request_id] = _Transfer()

    def end_transfer(self, request_id: str) -> int:
        """The executor finished (or confirmed cancelled) the request's copy: release the blocks
        the window reserved; returns how many."""
        t = self._transfers.pop(request_id, None)
        if t is None:
            raise ValueError(f"end_transfer({request_id!r}): no transfer in flight")
        if t.held_device:
            self.device.free(t.held_device)
        if t.held_host:
            self.host.free(t.held_host)
        return len(t.held_device) + len(t.held_host)

    def end_plan(self) -> None:
        """The plan is built: release host blocks its sync swap-ins read (see the contract)."""
        if self._plan_held_host:
            self.host.free(self._plan_held_host)
            self._plan_held_host = []

    def in_flight(self, request_id: str) -> bool:
        return request_id in self._transfers

    @property
    def num_in_flight(self) -> int:
        return len(self._transfers)

    def device_blocks_releasing(self) -> int:
        """Device blocks that open windows will free at end_transfer (offloads in flight)."""
        return sum(len(t.held_device) for t in self._transfers.values())

    def is_ready(self, request_id: str) -> bool:
        """May run now: no transfer in flight and no KV left on host (device-resident, or
        nothing to recompute from)."""
        return request_id not in self._transfers and request_id not in self._host_tables

    def held(self) -> dict[str, tuple[list[int], list[int]]]:
        """Blocks reserved by open transfer windows beyond the tables: request -> (device, host)."""
        return {rid: (list(t.held_device), list(t.held_host)) for rid, t in self._transfers.items()}
