"""A fixed pool of KV blocks for one memory tier, with reference counts."""
from __future__ import annotations


class OutOfBlocksError(RuntimeError):
    pass


class BlockPool:
    """Hands out block ids 0..num_blocks-1; a block is free when its reference count is zero."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # Pop from the end: low ids go first, which keeps early allocations contiguous.
        self._free = list(range(num_blocks - 1, -1, -1))
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
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
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]
