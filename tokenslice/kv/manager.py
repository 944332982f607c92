"""KVManager: where each request's KV lives and how many blocks it holds (docs/DESIGN.md, KVManager).

It plans; the model runner owns the tensors. Two tiers: a device pool and a host pool. Each
request's KV is either all on device, all on host (swapped out), or nowhere (dropped: it
recomputes). Swaps only move bookkeeping and return (source, destination) block pairs for the
executor to copy (StepPlan.swap_out / swap_in).

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

Prefix caching (kv/prefix.py; vLLM automatic prefix caching, FastSwitch §3.3)
------------------------------------------------------------------------------
With `prefix_caching=True`, full device blocks whose KV is computed are cached under their
chained token hash as they fill (`cache_computed`); a block freed by its request stays cached
and evictable (BlockPool). A new request starts with its longest cached prefix
(`attach_prefix`): those blocks are shared (one reference per table, one for the cache), never
written (only full blocks are cached; the request writes from the next block on), and
`detach_prefix` gives them back when the request cannot start. Sharing and block groups
coexist: shared blocks keep their place and only a request's own new blocks are placed by the
group allocator, so a request that reuses a prefix swaps as a few more runs (its shared head
plus its own group); evictable cached blocks stay out of the allocator until evicted.

The host tier caches too (FastSwitch §3.3, SGLang HiCache), when there is one: a swapped-out
request's full computed blocks are cached on host under the same hashes, and the host copy
outlives the swap-in (the source is only evictable afterwards). So a request swapped out again
copies only the blocks without a valid host copy, and a new request whose prefix continues on
host gets those blocks copied in (`load_host_prefix`, a swap-in of this plan, sync or inside
the request's transfer window like any async swap-in) instead of prefilled. Likewise a swap-in shares the leading blocks still cached on device and copies only
the rest. A host block reused for anything else is evicted from the cache first: a copy is
never found after its block was overwritten ("contamination"). Host copies of an async
swap-out are cached only at end_transfer, once the copy landed (never for an aborted one).
A device block evicted while a plan is built (between `begin_plan` and `end_plan`) is offloaded
to host instead of lost, when host has room and no copy yet (SGLang HiCache): the copy joins
the plan's sync swap-outs (`take_offloads`), which run before anything of the plan overwrites
the block, and its host destination is held until end_plan like a swap-in source.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from tokenslice.kv.blocks import BlockPool, OutOfBlocksError
from tokenslice.kv.prefix import PrefixCache, TokenSource, extend_hashes

Residency = Literal["device", "host", "none"]


@dataclass
class _Transfer:
    """An open transfer window of one request (begin_transfer .. end_transfer)."""

    moved: bool = False  # one swap per window: a second would copy data still in flight
    held_device: list[int] = field(default_factory=list)  # reserved for the copy, in no table
    held_host: list[int] = field(default_factory=list)
    host_copies: list[tuple[int, int]] = field(default_factory=list)  # (hash, host block) to cache once landed


@dataclass
class PrefixHit:
    """A new request's cached prefix: full blocks found on device, then on host."""

    device_blocks: int = 0
    host_blocks: int = 0
    num_tokens: int = 0


class KVManager:
    def __init__(self, block_size: int, num_device_blocks: int, num_host_blocks: int = 0, *,
                 contiguous: bool = False, prefix_caching: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        # contiguous: block-group placement (FastSwitch) so swaps need few copies.
        self.device = BlockPool(num_device_blocks, contiguous=contiguous)
        self.host = BlockPool(num_host_blocks, contiguous=contiguous)
        self._tables: dict[str, list[int]] = {}  # device blocks per request (never empty)
        self._host_tables: dict[str, list[int]] = {}  # host blocks per request (never empty)
        self._transfers: dict[str, _Transfer] = {}
        self._plan_held_host: list[int] = []  # sources of this plan's sync swap-ins (end_plan frees)
        self.host_prefix = PrefixCache(self.host) if prefix_caching and num_host_blocks else None
        self.prefix = PrefixCache(self.device, self._offload if self.host_prefix is not None else None) if prefix_caching else None
        self._offloads: list[tuple[int, int]] | None = None  # evicted device blocks copied to host this plan
        self._hashes: dict[str, list[int]] = {}  # chained hashes of each request's full blocks
        self._num_cached: dict[str, int] = {}  # leading table blocks already offered to the cache
        self._num_full: dict[str, int] = {}  # leading blocks whose KV is computed (any tier)
        self._pending_host: dict[str, list[int]] = {}  # host prefix hits held until loaded or detached

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

    def free(self, request_id: str) -> int:
        """Release every block of the request on both tiers; returns how many were released
        now (0 while a transfer window is open: end_transfer releases them). Cached blocks stay
        in the prefix cache."""
        self._hashes.pop(request_id, None)
        return self._release(request_id)

    def _release(self, request_id: str) -> int:
        self._num_cached.pop(request_id, None)
        self._num_full.pop(request_id, None)
        pending = self._pending_host.pop(request_id, None)
        if pending:
            self.host.free(pending)
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

    def drop(self, request_id: str) -> int:
        """Discard the request's KV on both tiers; it stays live and recomputes (free's
        bookkeeping; its block hashes are kept: its tokens do not change)."""
        return self._release(request_id)

    # ---- prefix caching ---------------------------------------------------------------------
    def attach_prefix(self, request_id: str, num_tokens: int, tokens: TokenSource) -> PrefixHit:
        """Start a request that holds no KV with its longest cached prefix of full blocks, at
        least one of its `num_tokens` tokens left to compute (it must produce logits, as vLLM)."""
        if self.prefix is None:
            return PrefixHit()
        if request_id in self._tables or request_id in self._host_tables or request_id in self._transfers:
            raise ValueError(f"attach_prefix({request_id!r}): it already has KV")
        hashes = extend_hashes(self._hashes.setdefault(request_id, []), tokens, num_tokens, self.block_size)
        limit = (num_tokens - 1) // self.block_size
        device = self.prefix.match(hashes[:limit])
        for b in device:
            self.device.share(b)
        if device:
            self._tables[request_id] = list(device)
            self._num_cached[request_id] = len(device)
        host = self.host_prefix.match(hashes[:limit], len(device)) if self.host_prefix is not None else []
        for b in host:  # held: nothing may overwrite them before the copy
            self.host.share(b)
        if host:
            self._pending_host[request_id] = host
        return PrefixHit(len(device), len(host), (len(device) + len(host)) * self.block_size)

    def load_host_prefix(self, request_id: str) -> list[tuple[int, int]]:
        """Device blocks for the request's host prefix hits, after its attached device blocks;
        returns the (host block, device block) pairs to copy in. The host sources stay held
        until end_plan (a sync swap-in) or, inside the request's transfer window (an async
        one), until end_transfer: the transfer contract either way."""
        host = self._pending_host.pop(request_id, None)
        if not host:
            return []
        new = self._grow_table(request_id, len(host))
        self._release_source(request_id, self.host, host)
        return list(zip(host, new))

    def detach_prefix(self, request_id: str) -> None:
        """The request could not start after attach_prefix: give its shared blocks back."""
        self._release(request_id)

    def cache_computed(self, request_id: str, num_computed: int, tokens: TokenSource) -> None:
        """Cache the request's full device blocks among its first `num_computed` tokens (their
        KV is written); a hash already cached under another block keeps that block."""
        if self.prefix is None:
            return
        table = self._tables.get(request_id)
        if not table:
            return
        full = min(num_computed // self.block_size, len(table))
        if full > self._num_full.get(request_id, 0):
            self._num_full[request_id] = full
        done = self._num_cached.get(request_id, 0)
        if full <= done:
            return
        hashes = extend_hashes(self._hashes.setdefault(request_id, []), tokens, full * self.block_size,
                               self.block_size)
        for i in range(done, full):
            self.prefix.insert(hashes[i], table[i])
        self._num_cached[request_id] = full

    def reclaimable(self, request_ids: list[str]) -> int:
        """Device blocks that become allocatable once these requests' KV leaves the device
        (blocks shared with other tables stay)."""
        if self.prefix is None or not len(self.prefix):  # nothing cached: nothing shared
            return sum(len(self._tables.get(rid, ())) for rid in request_ids)
        refs = Counter(b for rid in request_ids for b in self._tables.get(rid, ()))
        cached = self.device.is_cached
        return sum(1 for b, n in refs.items() if self.device.ref_count(b) - n - cached(b) == 0)

    # ---- swapping ---------------------------------------------------------------------------
    def can_swap_out(self, request_id: str) -> bool:
        table = self._tables.get(request_id)
        return bool(table) and not self._moved(request_id) and len(table) <= self.host.num_free

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        """Move the request's KV to host; returns (device block, host block) pairs in table order,
        only for blocks without a valid host copy (those are reused: FastSwitch §3.3)."""
        kept = self._valid_copies(request_id, self._tables, self.host_prefix)
        pairs = self._move("swap_out", request_id, self._tables, self.device, self._host_tables, self.host, kept)
        if self.host_prefix is not None:
            hashes, start = self._hashes.get(request_id, []), len(kept)
            num_new = max(0, min(self._num_full.get(request_id, 0), len(hashes)) - start)
            copies = [(hashes[start + i], h) for i, (_, h) in enumerate(pairs[:num_new])]
            t = self._transfers.get(request_id)
            if t is not None:  # in flight: cached once it landed
                t.host_copies = copies
            else:  # a sync copy runs before any later swap-in reads it
                for block_hash, h in copies:
                    self.host_prefix.insert(block_hash, h)
        return pairs

    def _valid_copies(self, request_id: str, src_tables: dict[str, list[int]], cache: PrefixCache | None
                      ) -> list[int]:
        """Blocks of the destination tier's cache already holding the request's leading computed
        blocks, held: a swap copies only the rest."""
        table = src_tables.get(request_id)
        if cache is None or not table or self._moved(request_id):
            return []
        hashes = self._hashes.get(request_id, [])
        kept = cache.match(hashes[:min(self._num_full.get(request_id, 0), len(hashes), len(table))])
        for b in kept:
            cache.pool.share(b)  # before allocating: never evicted for the other blocks
        return kept

    def can_swap_in(self, request_id: str) -> bool:
        table = self._host_tables.get(request_id)
        return bool(table) and not self._moved(request_id) and len(table) <= self.device.num_free

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        """Move the request's KV back to device; returns (host block, device block) pairs in table
        order, only for blocks not still cached on device (those are shared again)."""
        kept = self._valid_copies(request_id, self._host_tables, self.prefix)
        pairs = self._move("swap_in", request_id, self._host_tables, self.host, self._tables, self.device, kept)
        if kept:
            self._num_cached[request_id] = len(kept)  # already cached
        return pairs

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
        self._num_cached.pop(request_id, None)  # a new table: its blocks are offered again
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
        table = self._host_tables.get(request_id, ())
        for block_hash, h in t.host_copies:  # still its KV (not aborted): the copy landed
            if self.host_prefix is not None and h in table:
                self.host_prefix.insert(block_hash, h)
        if t.held_device:
            self.device.free(t.held_device)
        if t.held_host:
            self.host.free(t.held_host)
        return len(t.held_device) + len(t.held_host)

    def begin_plan(self) -> None:
        """A plan is being built: device blocks evicted from now on are offloaded to host."""
        self._offloads = []

    def take_offloads(self) -> list[tuple[int, int]]:
        """(device block, host block) copies of the evicted blocks offloaded so far this plan:
        for the plan's sync swap-outs."""
        out = self._offloads or []
        if self._offloads is not None:
            self._offloads = []
        return out

    def _offload(self, block_hash: int, block: int) -> None:
        """The device cache evicted `block`; keep its KV as a host copy if host has room."""
        host = self.host_prefix
        if self._offloads is None or host is None or host.get(block_hash) is not None or not self.host.num_free:
            return
        h = self.host.allocate(1)[0]
        host.insert(block_hash, h)
        self._plan_held_host.append(h)  # no other copy of this plan may target it
        self._offloads.append((block, h))

    def end_plan(self) -> None:
        """The plan is built: release host blocks its sync swap-ins read (see the contract)."""
        self._offloads = None
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

    # ---- introspection ----------------------------------------------------------------------
    def owners(self) -> dict[str, list[int]]:
        return {rid: list(t) for rid, t in self._tables.items()}

    def host_owners(self) -> dict[str, list[int]]:
        return {rid: list(t) for rid, t in self._host_tables.items()}

    def held(self) -> dict[str, tuple[list[int], list[int]]]:
        """Blocks reserved by open transfer windows beyond the tables: request -> (device, host)."""
        return {rid: (list(t.held_device), list(t.held_host)) for rid, t in self._transfers.items()}

    def check(self) -> None:
        """Raise AssertionError unless, per tier, every block's reference count is the number of
        its holders (tables, open windows, this plan's held sources, the prefix cache), and a
        block in more than one place is a cached one (shared prefix); no table is empty."""
        caches = (self.prefix, self.host_prefix)
        for name, pool, tables, idx, cache in (("device", self.device, self._tables, 0, caches[0]),
                                               ("host", self.host, self._host_tables, 1, caches[1])):
            refs = Counter(b for t in tables.values() for b in t)
            refs.update(b for held in self.held().values() for b in held[idx])
            if idx == 1:
                refs.update(self._plan_held_host)
                refs.update(b for held in self._pending_host.values() for b in held)
            cached = cache.blocks() if cache is not None else set()
            for b, n in refs.items():
                if n > 1 and b not in cached:
                    raise AssertionError(f"{name}: block {b} is owned twice")
            refs.update(cached)
            if any(pool.ref_count(b) != refs.get(b, 0) for b in range(pool.num_blocks)):
                raise AssertionError(f"{name}: a reference count differs from the block's holders (leak)")
            evictable = sum(1 for b in cached if refs[b] == 1)
            if pool.num_evictable != evictable or pool.num_used != len(refs) - evictable:
                raise AssertionError(f"{name}: {len(refs)} held, {evictable} evictable, "
                                     f"but {pool.num_used} used (leak)")
            if any(not t for t in tables.values()):
                raise AssertionError(f"{name}: an empty table")
        both = self._tables.keys() & self._host_tables.keys()
        if both:
            raise AssertionError(f"requests resident on both tiers: {sorted(both)}")
