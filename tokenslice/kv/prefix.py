"""Prefix cache of one memory tier: full KV blocks found by the tokens they hold.

vLLM automatic prefix caching, SGLang HiCache, FastSwitch §3.3 (KV reuse across turns): a
full block is named by a hash chained over token ids, hash(parent block's hash, this block's
tokens), so equal hashes mean equal tokens at equal positions and therefore equal KV. A block
stays cached after its request frees it (evictable, LRU; see BlockPool) and a later request
with the same leading tokens reuses it instead of computing it again. Only full blocks are
named: a partially filled block is still being written and is never shared.

Hashes are Python's hash of (parent, token tuple): deterministic for ints, 64 bits wide, as
vLLM's default; a collision would need two different prefixes with equal 64-bit chains.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from tokenslice.kv.blocks import BlockPool

TokenSource = Callable[[int, int], Sequence[int]]  # token ids of positions [start, end)


def extend_hashes(hashes: list[int], tokens: TokenSource, num_tokens: int, block_size: int) -> list[int]:
    """Extend `hashes` (of the leading full blocks) to every full block of the first
    `num_tokens` tokens; returns `hashes`."""
    for i in range(len(hashes), num_tokens // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash((parent, tuple(tokens(i * block_size, (i + 1) * block_size)))))
    return hashes


class PrefixCache:
    """Block hash <-> block of one pool. The cache holds one reference to each of its blocks;
    the pool evicts them when they are evictable and space is needed, and tells the cache."""

    def __init__(self, pool: BlockPool, on_evict: Callable[[int, int], None] | None = None) -> None:
        """`on_evict(hash, block)`: told after the pool evicted a cached block, before its reuse."""
        self.pool = pool
        self.on_evict = on_evict
        self._block_of: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        pool.on_evict = self._forget

    def __len__(self) -> int:
        return len(self._block_of)

    def get(self, block_hash: int) -> int | None:
        return self._block_of.get(block_hash)

    def match(self, hashes: Sequence[int], start: int = 0) -> list[int]:
        """Blocks of the longest run of cached hashes from hashes[start]."""
        out: list[int] = []
        for h in hashes[start:]:
            b = self._block_of.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def insert(self, block_hash: int, block: int) -> bool:
        """Cache `block` (allocated, fully written) under `block_hash`; False when that hash is
        already cached (the first copy stays) or the block already names another hash."""
        if block_hash in self._block_of or block in self._hash_of:
            return False
        self.pool.cache(block)
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def blocks(self) -> set[int]:
        return set(self._hash_of)

    def _forget(self, block: int) -> None:
        """The pool evicted `block` (it will be reused): its contents no longer count."""
        h = self._hash_of.pop(block)
        del self._block_of[h]
        if self.on_evict is not None:
            self.on_evict(h, block)
