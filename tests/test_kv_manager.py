"""KVManager two-tier bookkeeping and the block-group allocator (kv/manager.py, kv/groups.py).

Property tests drive random arrive / grow / preempt / swap / transfer / finish / abort / drop
sequences and check after every step that no block is double-owned or leaked on either tier,
that only requests whose KV is usable are ready, and that everything is free at the end.
"""
from __future__ import annotations


import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tokenslice.kv.blocks import BlockPool, OutOfBlocksError
from tokenslice.kv.groups import BlockGroupAllocator, runs
from tokenslice.kv.manager import KVManager
from tokenslice.plan import copy_runs

IDS = [f"r{i}" for i in range(4)]  # a small id universe: ids get reused after finishing


# ---- block-group allocator ------------------------------------------------------------------
def test_runs_and_copy_runs() -> None:
    assert runs([]) == []
    assert runs([3, 4, 5, 9, 10, 2]) == [(3, 3), (9, 2), (2, 1)]
    assert copy_runs([(0, 8), (1, 9), (2, 3), (3, 4), (7, 5)]) == [(0, 8, 2), (2, 3, 2), (7, 5, 1)]


def test_request_of_64_blocks_in_empty_pool_is_one_run() -> None:
    a = BlockGroupAllocator(256)
    assert runs(a.allocate(64)) == [(0, 64)]
    assert runs(a.allocate(64)) == [(64, 64)]


def test_non_power_of_two_pool_and_merge_back() -> None:
    a = BlockGroupAllocator(56)  # 32 + 16 + 8
    assert a.free_chunks() == [(0, 32), (32, 16), (48, 8)]
    got = a.allocate(36)  # larger than any chunk: the 32-chunk, then extended in place
    assert runs(got) == [(0, 36)]
    a.free(got[::-1])
    assert a.free_chunks() == [(0, 32), (32, 16), (48, 8)]


def test_new_runs_start_in_their_own_group_and_growth_extends_in_place() -> None:
    a = BlockGroupAllocator(64)
    x = a.allocate(3)  # 0..2; block 3 is x's growth slot
    y = a.allocate(1)  # a new run opens its own group rather than filling x's room to grow
    assert y == [16] and a.is_free(3)
    x += a.allocate(1, after=x[-1])
    assert runs(x) == [(0, 4)]


def test_buddies_merge_and_errors() -> None:
    a = BlockGroupAllocator(16)
    blocks = [a.allocate(1)[0] for _ in range(16)]
    assert sorted(blocks) == list(range(16)) and a.num_free == 0
    with pytest.raises(OutOfBlocksError):
        a.allocate(1)
    for b in [5, 4, 7, 6]:
        a.free([b])
    assert a.free_chunks() == [(4, 4)]
    with pytest.raises(ValueError, match="not allocated"):
        a.free([4])
    a.free([b for b in blocks if not 4 <= b < 8])
    assert a.free_chunks() == [(0, 16)]


def _check_allocator(a: BlockGroupAllocator, allocated: set[int]) -> None:
    chunks = a.free_chunks()
    free = [b for s, n in chunks for b in range(s, s + n)]
    assert len(free) == len(set(free)) == a.num_free
    assert set(free).isdisjoint(allocated) and len(free) + len(allocated) == a.num_blocks
    starts = {s: n for s, n in chunks}
    for s, n in chunks:
        assert n & (n - 1) == 0 and s % n == 0  # aligned power-of-two chunks
        assert starts.get(s ^ n) != n  # fully merged: no free buddy of the same size left apart


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 80), st.lists(st.tuples(st.booleans(), st.integers(0, 20), st.integers(0, 10**6)), max_size=40))
def test_allocator_property(num_blocks: int, ops: list[tuple[bool, int, int]]) -> None:
    a = BlockGroupAllocator(num_blocks)
    held: list[list[int]] = []
    allocated: set[int] = set()
    for is_alloc, n, pick in ops:
        if is_alloc or not held:
            after = held[pick % len(held)][-1] if held and pick % 3 == 0 and held[pick % len(held)] else None
            if n > a.num_free:
                with pytest.raises(OutOfBlocksError):
                    a.allocate(n, after)
                continue
            got = a.allocate(n, after)
            assert len(got) == n and allocated.isdisjoint(got) and len(set(got)) == n
            allocated.update(got)
            held.append(got)
        else:
            got = held.pop(pick % len(held))
            a.free(got)
            allocated.difference_update(got)
        _check_allocator(a, allocated)
    for got in held:
        a.free(got)
    assert a.num_free == num_blocks
    assert a.free_chunks() == BlockGroupAllocator(num_blocks).free_chunks()


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 300), st.data())
def test_empty_pool_allocation_is_one_run(num_blocks: int, data: st.DataObject) -> None:
    n = data.draw(st.integers(1, num_blocks))
    assert len(runs(BlockGroupAllocator(num_blocks).allocate(n))) == 1


def test_block_pool_default_unchanged_and_contiguous_option() -> None:
    p = BlockPool(8)
    assert p.allocate(3) == [0, 1, 2] and p.allocate(1, after=0) == [3]  # plain pool ignores `after`
    p.free([1])
    assert p.allocate(1) == [1]  # last freed goes first, as before
    c = BlockPool(8, contiguous=True)
    got = c.allocate(5)
    assert runs(got) == [(0, 5)] and c.num_free == 3 and c.peak_used == 5
    c.free(got)
    assert c.num_free == 8 and all(c.ref_count(b) == 0 for b in range(8))


# ---- KVManager unit tests -------------------------------------------------------------------
def test_device_only_behaviour_unchanged() -> None:
    kv = KVManager(4, 8)
    assert kv.ensure("a", 9) == [0, 1, 2] and kv.ensure("a", 12) == [] and kv.holds("a")
    assert kv.residency("a") == "device" and kv.is_ready("a") and kv.num_free_host_blocks == 0
    assert not kv.can_swap_out("a")  # no host tier
    assert kv.free("a") == 3 and kv.free("a") == 0 and kv.num_free_device_blocks == 8


def test_swap_round_trip() -> None:
    kv = KVManager(2, 8, 6)
    kv.ensure("a", 7)  # 4 blocks
    table = list(kv.block_table("a"))
    pairs = kv.swap_out("a")
    assert [d for d, _ in pairs] == table and [h for _, h in pairs] == kv.host_blocks("a")
    assert kv.residency("a") == "host" and not kv.holds("a") and not kv.is_ready("a")
    assert kv.num_free_device_blocks == 8 and kv.num_free_host_blocks == 2 and kv.peak_host_blocks == 4
    with pytest.raises(ValueError, match="swap_in first"):
        kv.ensure("a", 9)
    back = kv.swap_in("a")
    assert [h for h, _ in back] == [h for _, h in pairs] and [d for _, d in back] == kv.block_table("a")
    # The sources stay held until the plan is built (a same-plan swap-out must not reuse them).
    assert kv.residency("a") == "device" and kv.is_ready("a") and kv.num_free_host_blocks == 2
    kv.check()
    kv.end_plan()
    assert kv.num_free_host_blocks == 6
    kv.swap_out("a")
    assert kv.free("a") == 4 and kv.num_free_host_blocks == 6 and kv.residency("a") == "none"
    kv.check()


def test_swap_out_short_of_host_space() -> None:
    kv = KVManager(1, 8, 2)
    kv.ensure("a", 3)
    assert not kv.can_swap_out("a")
    with pytest.raises(OutOfBlocksError, match="can_swap_out"):
        kv.swap_out("a")
    assert kv.residency("a") == "device" and kv.num_free_host_blocks == 2
    with pytest.raises(ValueError, match="no KV on host"):
        kv.swap_in("a")


def test_async_window_reserves_sources() -> None:
    kv = KVManager(1, 4, 4)
    kv.ensure("a", 3)
    kv.begin_transfer("a")
    assert not kv.is_ready("a") and kv.in_flight("a")
    kv.swap_out("a")
    assert kv.num_free_device_blocks == 1  # sources still being read: not reallocatable
    with pytest.raises(ValueError, match="already moved"):
        kv.swap_in("a")
    with pytest.raises(OutOfBlocksError):
        kv.ensure("b", 2)
    assert kv.end_transfer("a") == 3
    assert kv.num_free_device_blocks == 4 and kv.residency("a") == "host" and not kv.is_ready("a")
    kv.begin_transfer("a")
    kv.swap_in("a")
    assert kv.num_free_host_blocks == 1 and not kv.is_ready("a")
    kv.end_transfer("a")
    assert kv.is_ready("a") and kv.num_free_host_blocks == 4
    with pytest.raises(ValueError, match="no transfer"):
        kv.end_transfer("a")
    kv.check()


def test_abort_mid_transfer_releases_at_end_transfer() -> None:
    kv = KVManager(1, 4, 4)
    kv.ensure("a", 3)
    kv.begin_transfer("a")
    kv.swap_out("a")
    assert kv.free("a") == 0  # the copy may still touch both sides
    assert kv.residency("a") == "none" and kv.num_free_device_blocks == 1 and kv.num_free_host_blocks == 1
    assert kv.held() == {"a": ([0, 1, 2], [0, 1, 2])}
    with pytest.raises(ValueError, match="in flight"):
        kv.ensure("a", 1)  # a reused id waits for the old copy
    assert kv.end_transfer("a") == 6
    assert kv.num_free_device_blocks == 4 and kv.num_free_host_blocks == 4 and kv.is_ready("a")
    kv.check()


def test_contiguous_manager_swaps_in_one_copy() -> None:
    kv = KVManager(16, 256, 128, contiguous=True)
    kv.ensure("x", 5)
    kv.ensure("a", 64 * 16)
    assert len(runs(kv.block_table("a"))) == 1
    assert len(copy_runs(kv.swap_out("a"))) == 1
    assert len(copy_runs(kv.swap_in("a"))) == 1
    for t in range(1, 50):  # decode growth of two requests stays in a few runs
        kv.ensure("a", 64 * 16 + t * 16)
        kv.ensure("x", 5 + t * 16)
    assert len(runs(kv.block_table("a"))) <= 3 and len(runs(kv.block_table("x"))) <= 3
    kv.check()


# ---- property test: random lifecycles never double-own or leak --------------------------------
class KVLifecycle(RuleBasedStateMachine):
    """Shadow model: tokens per request, expected residency, open windows and whether they moved."""

    @initialize(block_size=st.integers(1, 4), device=st.integers(2, 24), host=st.integers(0, 16),
                contiguous=st.booleans())
    def setup(self, block_size: int, device: int, host: int, contiguous: bool) -> None:
        self.kv = KVManager(block_size, device, host, contiguous=contiguous)
        self.tokens: dict[str, int] = {}  # tokens whose KV is kept (device or host)
        self.where: dict[str, str] = {}
        self.window: dict[str, bool] = {}  # open transfer window -> moved already
        self.busy: dict[str, tuple[list[int], list[int]]] = {}  # blocks an async copy touches

    def res(self, rid: str) -> str:
        return self.where.get(rid, "none")

    def _discard(self, rid: str) -> None:
        self.tokens.pop(rid, None)
        self.where.pop(rid, None)

    # ---- rules ----
    @rule(rid=st.sampled_from(IDS), extra=st.integers(1, 12))
    def grow(self, rid: str, extra: int) -> None:  # arrival (first ensure) or prefill/decode growth
        kv = self.kv
        target = self.tokens.get(rid, 0) + extra if self.res(rid) != "host" else extra
        need = kv.blocks_needed(rid, target)
        if need and (rid in self.window or self.res(rid) == "host"):
            with pytest.raises(ValueError):
                kv.ensure(rid, target)
            return
        if need > kv.num_free_device_blocks:
            with pytest.raises(OutOfBlocksError):
                kv.ensure(rid, target)
            return
        assert len(kv.ensure(rid, target)) == need
        if need or self.res(rid) == "device":
            self.tokens[rid] = target
            self.where[rid] = "device"
        assert kv.num_device_blocks(rid) == kv.blocks_for_tokens(self.tokens.get(rid, 0))

    @rule(rid=st.sampled_from(IDS))
    def swap_out(self, rid: str) -> None:
        kv = self.kv
        n = kv.num_device_blocks(rid)
        can = self.res(rid) == "device" and not self.window.get(rid, False) and n <= kv.num_free_host_blocks
        assert kv.can_swap_out(rid) == can
        if not can:
            with pytest.raises((ValueError, OutOfBlocksError)):
                kv.swap_out(rid)
            return
        table, free_dev = list(kv.block_table(rid)), kv.num_free_device_blocks
        pairs = kv.swap_out(rid)
        assert [d for d, _ in pairs] == table and [h for _, h in pairs] == kv.host_blocks(rid)
        assert kv.num_free_device_blocks == free_dev + (0 if rid in self.window else n)
        self.where[rid] = "host"
        if rid in self.window:
            self.window[rid] = True
            self.busy[rid] = ([d for d, _ in pairs], [h for _, h in pairs])
        event("swap_out in a window" if rid in self.window else "swap_out")

    @rule(rid=st.sampled_from(IDS))
    def swap_in(self, rid: str) -> None:
        kv = self.kv
        n = len(kv.host_blocks(rid))
        can = self.res(rid) == "host" and not self.window.get(rid, False) and n <= kv.num_free_device_blocks
        assert kv.can_swap_in(rid) == can
        if not can:
            with pytest.raises((ValueError, OutOfBlocksError)):
                kv.swap_in(rid)
            return
        table, free_host = list(kv.host_blocks(rid)), kv.num_free_host_blocks
        pairs = kv.swap_in(rid)
        assert [h for h, _ in pairs] == table and [d for _, d in pairs] == kv.block_table(rid)
        assert kv.num_free_host_blocks == free_host  # held by the window, or until the plan is built
        if rid not in self.window:
            kv.check()
            kv.end_plan()
            assert kv.num_free_host_blocks == free_host + n
        self.where[rid] = "device"
        if rid in self.window:
            self.window[rid] = True
            self.busy[rid] = ([d for _, d in pairs], [h for h, _ in pairs])
        event("swap_in in a window" if rid in self.window else "swap_in")

    @rule(rid=st.sampled_from(IDS))
    def preempt(self, rid: str) -> None:  # what a scheduler does to a victim: swap if it can, else drop
        if self.kv.can_swap_out(rid):
            self.swap_out(rid)
        elif self.res(rid) == "device" and rid not in self.window:
            self.drop(rid)

    @rule(rid=st.sampled_from(IDS), out=st.booleans())
    def async_swap(self, rid: str, out: bool) -> None:  # the usual pairing: open a window, move
        if rid not in self.window:
            self.begin(rid)
        (self.swap_out if out else self.swap_in)(rid)

    @rule(rid=st.sampled_from(IDS))
    def begin(self, rid: str) -> None:
        if rid in self.window:
            with pytest.raises(ValueError):
                self.kv.begin_transfer(rid)
            return
        self.kv.begin_transfer(rid)
        self.window[rid] = False

    @rule(rid=st.sampled_from(IDS))
    def end(self, rid: str) -> None:
        if rid not in self.window:
            with pytest.raises(ValueError):
                self.kv.end_transfer(rid)
            return
        self.kv.end_transfer(rid)
        del self.window[rid]
        self.busy.pop(rid, None)

    @rule(rid=st.sampled_from(IDS))
    def finish(self, rid: str) -> None:  # normal completion: only a ready, device-resident request
        if self.kv.is_ready(rid) and self.res(rid) == "device":
            assert self.kv.free(rid) == self.kv.blocks_for_tokens(self.tokens[rid])
            self._discard(rid)

    @rule(rid=st.sampled_from(IDS))
    def abort(self, rid: str) -> None:  # any time, transfers in flight included
        if rid in self.busy:
            event("abort during a copy")
        self.kv.free(rid)
        self._discard(rid)

    @rule(rid=st.sampled_from(IDS))
    def drop(self, rid: str) -> None:  # recompute: KV discarded, request stays
        self.kv.drop(rid)
        self._discard(rid)

    # ---- invariants ----
    @invariant()
    def blocks_owned_once_never_leaked(self) -> None:
        kv = self.kv
        kv.check()
        held = kv.held()
        for pool, tables, idx in ((kv.device, kv.owners(), 0), (kv.host, kv.host_owners(), 1)):
            owned = [b for t in tables.values() for b in t] + [b for h in held.values() for b in h[idx]]
            assert len(owned) == len(set(owned))  # at most one owner
            assert pool.num_free + len(owned) == pool.num_blocks  # free + owned = total
            assert all(pool.ref_count(b) == (1 if b in owned else 0) for b in range(pool.num_blocks))
            owner = {b: rid for rid, t in tables.items() for b in t}
            owner.update({b: rid for rid, h in held.items() for b in h[idx]})
            for rid, blocks in self.busy.items():  # blocks under an async copy: never reallocated
                assert all(owner.get(b) == rid for b in blocks[idx])

    @invariant()
    def residency_and_readiness(self) -> None:
        kv = self.kv
        for rid in IDS:
            assert kv.residency(rid) == self.res(rid)
            assert kv.in_flight(rid) == (rid in self.window)
            ready = kv.is_ready(rid)
            assert ready == (rid not in self.window and self.res(rid) != "host")
            if ready:  # never ready with KV on host or in flight
                assert not kv.in_flight(rid) and not kv.host_blocks(rid)
            if self.res(rid) != "none":
                n = kv.blocks_for_tokens(self.tokens[rid])
                assert len(kv.block_table(rid) or kv.host_blocks(rid)) == n

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        kv = self.kv
        for rid in list(self.window):
            kv.end_transfer(rid)
        for rid in IDS:
            kv.free(rid)
        kv.check()
        for pool in (kv.device, kv.host):
            assert pool.num_free == pool.num_blocks
            assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))


KVLifecycle.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestKVLifecycle = KVLifecycle.TestCase


# Hypothesis' stateful runs are mostly short; long explicit op sequences reach the deep states
# (an abort while a copy is in flight after a swap into a nearly full tier) far more often.
_OPS = ["grow", "grow", "grow", "swap_out", "swap_in", "preempt", "async_swap", "async_swap",
        "begin", "end", "end", "finish", "abort", "drop"]


@settings(max_examples=150, deadline=None)
@given(block_size=st.integers(1, 4), device=st.integers(2, 24), host=st.integers(0, 16),
       contiguous=st.booleans(),
       ops=st.lists(st.tuples(st.sampled_from(_OPS), st.sampled_from(IDS), st.integers(1, 12)),
                    min_size=20, max_size=100))
def test_long_lifecycles(block_size: int, device: int, host: int, contiguous: bool,
                         ops: list[tuple[str, str, int]]) -> None:
    m = KVLifecycle()
    m.setup(block_size, device, host, contiguous)
    for name, rid, k in ops:
        if name == "grow":
            m.grow(rid, k)
        elif name == "async_swap":
            m.async_swap(rid, k % 2 == 0)
        else:
            getattr(m, name)(rid)
        m.blocks_owned_once_never_leaked()
        m.residency_and_readiness()
    m.teardown()


# ---- prefix caching: shared blocks never leak, double-own or get handed out while held ----------
_BASES = [[(7 * b + 3 * i) % 5 for i in range(64)] for b in range(2)]  # few tokens: prefixes repeat
_SHARE_OPS = ["arrive", "arrive", "grow", "compute", "compute", "swap_out", "swap_in", "async_out",
              "async_in", "end", "drop", "free", "flush"]


def _fresh(kv: KVManager, pool: BlockPool, blocks: list[int], others: dict[str, list[int]]) -> None:
    """Blocks just allocated: held once (and maybe cached as copies), in no other table."""
    held = {b for t in others.values() for b in t}
    assert all(pool.ref_count(b) == 1 + pool.is_cached(b) and b not in held for b in blocks)


def _checked_swap(kv: KVManager, rid: str, direction: str, window: bool) -> None:
    """A swap copies only the blocks the destination's cache lacks: the leading ones it has are
    reused (cached copies), the rest go to fresh blocks."""
    if window and not kv.in_flight(rid):
        kv.begin_transfer(rid)
    out = direction == "out"
    pool, tables = (kv.host, kv.host_owners) if out else (kv.device, kv.owners)
    others = {r: t for r, t in tables().items() if r != rid}
    n = len(kv.block_table(rid) if out else kv.host_blocks(rid))
    pairs = kv.swap_out(rid) if out else kv.swap_in(rid)
    table = kv.host_blocks(rid) if out else kv.block_table(rid)
    kept = n - len(pairs)
    assert [d for _, d in pairs] == table[kept:] and all(pool.is_cached(b) for b in table[:kept])
    _fresh(kv, pool, table[kept:], others)
    if kept:
        event(f"swap-{direction} copies only what the destination lacks")


@settings(max_examples=500, deadline=None)
@given(block_size=st.integers(1, 4), device=st.integers(4, 24), host=st.integers(0, 16),
       contiguous=st.booleans(),
       ops=st.lists(st.tuples(st.sampled_from(_SHARE_OPS), st.sampled_from(IDS), st.integers(0, 1),
                              st.integers(1, 20)), min_size=10, max_size=80))
def test_random_operations_with_sharing(block_size: int, device: int, host: int, contiguous: bool,
                                        ops: list[tuple[str, str, int, int]]) -> None:
    kv = KVManager(block_size, device, host, contiguous=contiguous, prefix_caching=True)
    base: dict[str, list[int]] = {}
    tokens: dict[str, int] = {}  # tokens of KV kept (device or host)

    def src(rid: str):
        return lambda s, e: base[rid][s:e]

    for op, rid, b, n in ops:
        ready = kv.is_ready(rid)
        kv.begin_plan()  # each op is one plan: evicted device copies are offloaded to host
        if op == "arrive" and kv.residency(rid) == "none" and not kv.in_flight(rid):
            base[rid] = _BASES[b]
            hit = kv.attach_prefix(rid, min(n + hit_room(block_size), 64), src(rid))
            target = min(n + hit_room(block_size), 64)
            assert hit.num_tokens < target and hit.num_tokens % block_size == 0
            shared = list(kv.block_table(rid))
            assert all(kv.device.is_cached(x) for x in shared)
            event(f"arrival reusing {min(len(shared), 2)}{'+' if len(shared) >= 2 else ''} cached blocks")
            if hit.host_blocks:
                event("arrival reusing host blocks")
            if kv.blocks_needed(rid, target) > kv.num_free_device_blocks:
                kv.detach_prefix(rid)
                assert kv.residency(rid) == "none"
            else:
                others = {r: t for r, t in kv.owners().items() if r != rid}
                pairs = kv.load_host_prefix(rid)  # its prefix found on host: copied in this plan
                assert len(pairs) == hit.host_blocks
                assert all(kv.host.is_cached(h) and kv.host.ref_count(h) >= 2 for h, _ in pairs)
                _fresh(kv, kv.device, [d for _, d in pairs] + kv.ensure(rid, target), others)
                kv.check()
                kv.end_plan()
                tokens[rid] = target
                if n % 2:  # its prefill ran: the full blocks are cached
                    kv.cache_computed(rid, target, src(rid))
        elif op == "grow" and ready and kv.residency(rid) == "device":
            target = min(tokens[rid] + n, 64)
            if kv.blocks_needed(rid, target) <= kv.num_free_device_blocks:
                others = {r: t for r, t in kv.owners().items() if r != rid}
                _fresh(kv, kv.device, kv.ensure(rid, target), others)
                tokens[rid] = target
        elif op == "compute" and ready and kv.residency(rid) == "device":
            kv.cache_computed(rid, tokens[rid], src(rid))
        elif op in ("swap_out", "async_out") and kv.can_swap_out(rid):
            _checked_swap(kv, rid, "out", op.startswith("async"))
        elif op in ("swap_in", "async_in") and kv.can_swap_in(rid):
            _checked_swap(kv, rid, "in", op.startswith("async"))
        elif op == "flush" and kv.num_free_device_blocks:  # other work takes every free block
            others = kv.owners()
            _fresh(kv, kv.device, kv.ensure("filler", kv.num_free_device_blocks * block_size), others)
            assert kv.device.num_evictable == 0 and all(kv.device.ref_count(b) > 1 for b in kv.prefix.blocks())
            kv.free("filler")
        elif op == "end" and kv.in_flight(rid):
            kv.end_transfer(rid)
        elif op == "drop" and not kv.in_flight(rid):
            kv.drop(rid)
            tokens.pop(rid, None)
        elif op == "free":
            kv.free(rid)
            tokens.pop(rid, None)
        kv.check()
        for d, h in kv.take_offloads():
            assert kv.host.is_cached(h) and kv.host.ref_count(h) == 2  # cached, held until end_plan
            assert not kv.device.is_cached(d)  # evicted on device
            event("evicted block offloaded to host")
        kv.end_plan()
        kv.check()
    for rid in IDS:
        if kv.in_flight(rid):
            kv.end_transfer(rid)
        kv.free(rid)
    kv.end_plan()
    kv.check()
    for pool in (kv.device, kv.host):
        assert pool.num_free == pool.num_blocks and pool.num_used == 0


def hit_room(block_size: int) -> int:
    """Requests are at least two blocks long, so that cached prefixes are found."""
    return 2 * block_size
