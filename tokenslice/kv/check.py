"""The KV bookkeeping's invariants, checked per tier (KVManager.check; the tests call it after every step)."""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from tokenslice.kv.blocks import BlockPool
from tokenslice.kv.prefix import PrefixCache


def check_tier(name: str, pool: BlockPool, tables: dict[str, list[int]], held: Iterable[int],
               cache: PrefixCache | None) -> None:
    """Raise AssertionError unless every block's reference count in `pool` is the number of its
    holders (the `tables`, the `held` blocks, the prefix `cache`), a block in more than one place
    is a cached one (shared prefix), and no table is empty."""
    refs = Counter(b for t in tables.values() for b in t)
    refs.update(held)
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


def check_disjoint(device_tables: dict[str, list[int]], host_tables: dict[str, list[int]]) -> None:
    """Raise AssertionError when a request has a table on both tiers."""
    both = device_tables.keys() & host_tables.keys()
    if both:
        raise AssertionError(f"requests resident on both tiers: {sorted(both)}")
