"""KVManager: where each request's KV lives and how many blocks it holds (docs/DESIGN.md, KVManager).

It plans; the model runner owns the tensors. Built in layers, one concern each: kv/tables.py
(the device and host pools, each request's block tables), kv/swaps.py (moves between the tiers
and transfers in flight: the transfer contract), this module (prefix caching on both tiers and
the offloads of evicted blocks), kv/check.py (the invariants `check` holds it to).

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
the request's transfer window like any async swap-in) instead of prefilled. Likewise a swap-in
shares the leading blocks still cached on device and copies only the rest. A host block reused for anything else is evicted from the cache first: a copy is
never found after its block was overwritten ("contamination"). Host copies of an async
swap-out are cached only at end_transfer, once the copy landed (never for an aborted one).
A device block evicted while a plan is built (between `begin_plan` and `end_plan`) is offloaded
to host instead of lost, when host has room and no copy yet (SGLang HiCache): the copy joins
the plan's sync swap-outs (`take_offloads`), which run before anything of the plan overwrites
the block, and its host destination is held until end_plan like a swap-in source.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import chain

from tokenslice.kv.check import check_disjoint, check_tier
from tokenslice.kv.prefix import PrefixCache, TokenSource, extend_hashes
from tokenslice.kv.swaps import SwapTables


@dataclass
class PrefixHit:
    """A new request's cached prefix: full blocks found on device, then on host."""

    device_blocks: int = 0
    host_blocks: int = 0
    num_tokens: int = 0


class KVManager(SwapTables):
    """The block tables of both tiers, their swaps and transfers (SwapTables), plus prefix
    caching and offloads (see module doc): what the scheduler plans KV with."""

    def __init__(self, block_size: int, num_device_blocks: int, num_host_blocks: int = 0, *,
                 contiguous: bool = False, prefix_caching: bool = False) -> None:
        super().__init__(block_size, num_device_blocks, num_host_blocks, contiguous=contiguous)
        self.host_prefix = PrefixCache(self.host) if prefix_caching and num_host_blocks else None
        offload = self._offload if self.host_prefix is not None else None
        self.prefix = PrefixCache(self.device, offload) if prefix_caching else None
        self._offloads: list[tuple[int, int]] | None = None  # evicted device blocks copied to host this plan
        self._hashes: dict[str, list[int]] = {}  # chained hashes of each request's full blocks
        self._num_cached: dict[str, int] = {}  # leading table blocks already offered to the cache
        self._num_full: dict[str, int] = {}  # leading blocks whose KV is computed (any tier)
        self._pending_host: dict[str, list[int]] = {}  # host prefix hits held until loaded or detached

    def free(self, request_id: str) -> int:
        """SwapTables.free; the request's block hashes are forgotten too (drop keeps them)."""
        self._hashes.pop(request_id, None)
        return super().free(request_id)

    def _release(self, request_id: str) -> int:
        """Forget the request's cache progress and release its held host prefix hits, then its tables."""
        self._num_cached.pop(request_id, None)
        self._num_full.pop(request_id, None)
        pending = self._pending_host.pop(request_id, None)
        if pending:
            self.host.free(pending)
        return super()._release(request_id)

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

    # ---- swaps that reuse cached copies -----------------------------------------------------
    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        """Move the request's KV to host; returns (device block, host block) pairs in table order,
        only for blocks without a valid host copy (those are reused: FastSwitch §3.3)."""
        kept = self._valid_copies(request_id, self._tables, self.host_prefix)
        pairs = self._move("swap_out", request_id, self._tables, self.device, self._host_tables, self.host, kept)
        self._num_cached.pop(request_id, None)  # a new table: its blocks are offered again
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

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        """Move the request's KV back to device; returns (host block, device block) pairs in table
        order, only for blocks not still cached on device (those are shared again)."""
        kept = self._valid_copies(request_id, self._host_tables, self.prefix)
        pairs = self._move("swap_in", request_id, self._host_tables, self.host, self._tables, self.device, kept)
        self._num_cached.pop(request_id, None)  # a new table: its blocks are offered again
        if kept:
            self._num_cached[request_id] = len(kept)  # already cached
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

    def end_transfer(self, request_id: str) -> int:
        """Cache the host copies of an async swap-out that landed, then SwapTables.end_transfer."""
        t = self._transfers.get(request_id)
        if t is not None and self.host_prefix is not None:
            table = self._host_tables.get(request_id, ())
            for block_hash, h in t.host_copies:  # still its KV (not aborted): the copy landed
                if h in table:
                    self.host_prefix.insert(block_hash, h)
        return super().end_transfer(request_id)

    # ---- offloads of evicted blocks while a plan is built -----------------------------------
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
        """Evictions no longer offload; then SwapTables.end_plan releases the plan's held host blocks."""
        self._offloads = None
        super().end_plan()

    def check(self) -> None:
        """Raise AssertionError unless, per tier, every block's reference count is the number of
        its holders (tables, open windows, this plan's held sources, the prefix cache), and a
        block in more than one place is a cached one (shared prefix); no table is empty."""
        held = self.held().values()
        check_tier("device", self.device, self._tables, (b for device, _ in held for b in device), self.prefix)
        check_tier("host", self.host, self._host_tables,
                   chain((b for _, host in held for b in host), self._plan_held_host,
                         (b for pending in self._pending_host.values() for b in pending)), self.host_prefix)
        check_disjoint(self._tables, self._host_tables)
