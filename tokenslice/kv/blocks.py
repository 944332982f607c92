"""A fixed pool of KV blocks for one memory tier, with reference counts."""
from __future__ import annotations

from tokenslice.kv.groups import BlockGroupAllocator, OutOfBlocksError

__all__ = ["BlockPool", "OutOfBlocksError"]


class BlockPool:
    """Hands out block ids 0..num_blocks-1; a block is free when its reference count is zero.

    `contiguous=True` places blocks with the block-group (buddy) allocator so a request's KV
    sits in few contiguous runs (FastSwitch); the default keeps the plain free list.
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
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return self._groups.num_free if self._groups is not None else len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """n blocks with reference count 1. `after` (the caller's last block) lets the contiguous
        pool extend that run in place; the plain pool ignores it."""
        if self._groups is not None:
            out = self._groups.allocate(n, after)
        else:
            if n > len(self._free):
                raise OutOfBlocksError(f"asked for {n} blocks, {len(self._free)} free of {self.num_blocks}")
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
                if self._groups is not None:
                    self._groups.free((b,))
                else:
                    self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]
