"""A fixed pool of KV blocks for one memory tier, with reference counts."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from tokenslice.kv.groups import BlockGroupAllocator, OutOfBlocksError

__all__ = ["BlockPool", "OutOfBlocksError"]


class BlockPool:
    """Hands out block ids 0..num_blocks-1; a block is free when its reference count is zero.

    `contiguous=True` places blocks with the block-group (buddy) allocator so a request's KV
    sits in few contiguous runs (FastSwitch); the default keeps the plain free list.

    Prefix caching (kv/prefix.py): a cached block carries one reference for the cache. When that
    is its only reference it is *evictable*: counted as free, kept in an LRU, and evicted (its
    cache entry forgotten through `on_evict`) only when an allocation finds no truly free block.
    """

    def __init__(self, num_blocks: int, *, contiguous: bool = False, group_size: int = 16) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.contiguous = contiguous
        self._ref_counts = [0] * num_blocks
        self._groups = BlockGroupAllocator(num_blocks, group_size) if contiguous else None
        # Pop from the end: low ids go first, which keeps early allocations contiguous.
        self._free = [] if contiguous else list(range(num_blocks - 1, -1, -1))
        self._cached: set[int] = set()  # blocks holding a cache reference
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, no other reference; LRU first
        self.on_evict: Callable[[int], None] | None = None  # the cache forgets an evicted block
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: free ones plus evictable cached ones."""
        g = self._groups
        return (g.num_free if g is not None else len(self._free)) + len(self._evictable)

    @property
    def num_unreferenced(self) -> int:
        """Blocks with reference count zero (not even cached)."""
        return self._groups.num_free if self._groups is not None else len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """n blocks with reference count 1. `after` (the caller's last block) lets the contiguous
        pool extend that run in place; the plain pool ignores it. Evictable cached blocks are
        evicted, least recently used first, only when the free ones do not suffice."""
        unreferenced = self.num_unreferenced
        if n > unreferenced:
            if n > unreferenced + len(self._evictable):
                raise OutOfBlocksError(f"asked for {n} blocks, {self.num_free} free of {self.num_blocks}")
            self._evict(n - unreferenced)
        if self._groups is not None:
            out = self._groups.allocate(n, after)
        else:
            out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._ref_counts[b] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            rc = self._ref_counts[b]
            if rc <= 0:
                raise ValueError(f"block {b} freed while not allocated")
            self._ref_counts[b] = rc - 1
            if rc == 1:
                self._release(b)
            elif rc == 2 and b in self._cached:  # only the cache refers to it now
                self._evictable[b] = None

    def share(self, block: int) -> None:
        """One more reference to an allocated block (a second table, or a reserved copy source)."""
        rc = self._ref_counts[block]
        if rc <= 0:
            raise ValueError(f"block {block} shared while not allocated")
        self._ref_counts[block] = rc + 1
        self._evictable.pop(block, None)

    def cache(self, block: int) -> None:
        """The prefix cache takes a reference to an allocated block."""
        if block in self._cached:
            raise ValueError(f"block {block} is already cached")
        self.share(block)
        self._cached.add(block)

    def is_cached(self, block: int) -> bool:
        return block in self._cached

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def _evict(self, n: int) -> None:
        for _ in range(n):
            b, _ = self._evictable.popitem(last=False)
            self._cached.discard(b)
            self._ref_counts[b] = 0
            self._release(b)
            if self.on_evict is not None:
                self.on_evict(b)

    def _release(self, b: int) -> None:
        if self._groups is not None:
            self._groups.free((b,))
        else:
            self._free.append(b)
