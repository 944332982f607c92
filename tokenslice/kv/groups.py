"""Block-group (buddy) allocator: hands out KV blocks as few contiguous runs as possible.

FastSwitch (block groups): a request's KV should sit in a few large contiguous runs so that a
swap moves it in a few large copies instead of one small copy per block; per-copy overhead, not
bandwidth, dominates fine-grained swapping. FastServe §4.2 swaps whole jobs proactively, which
is only cheap when those copies are large.

Free space is kept as aligned power-of-two chunks (a buddy system over ids 0..num_blocks-1,
any num_blocks): a new run is carved from a chunk of at least a group (room to grow in place),
else from the smallest chunk that fits; a growing run first extends in place; freeing merges
buddies back, so contiguous space is rebuilt as requests finish. Plain Python: no torch
(docs/DESIGN.md).
"""
from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence


class OutOfBlocksError(RuntimeError):
    pass


def runs(blocks: Sequence[int]) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of consecutive ids, in table order.

    The number of runs is the number of copy operations a transfer of these blocks needs.
    """
    out: list[tuple[int, int]] = []
    for b in blocks:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


class BlockGroupAllocator:
    """Buddy allocator over block ids 0..num_blocks-1 (no reference counts: see BlockPool).

    A new run starts in a free chunk of at least `group_size` blocks when there is one: the rest
    of that group is the run's room to grow in place (FastSwitch block groups), so a decoding
    request stays in few runs. Nothing is reserved: when only smaller chunks are left anyone
    may take them, so capacity is that of a plain pool. group_size=1 is plain best-fit buddy.
    """

    def __init__(self, num_blocks: int, group_size: int = 16) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.num_blocks = num_blocks
        self.group_size = group_size
        self._group_order = (group_size - 1).bit_length()  # a group is rounded up to a power of two
        self.max_order = max(num_blocks.bit_length() - 1, 0)
        self._order_of: dict[int, int] = {}  # start of each free chunk -> its order (the truth)
        # Per order a min-heap of chunk starts, lazily cleaned: low addresses first keeps
        # allocations packed and deterministic.
        self._heaps: list[list[int]] = [[] for _ in range(self.max_order + 1)]
        self._counts = [0] * (self.max_order + 1)
        self.num_free = num_blocks
        start = 0
        while start < num_blocks:  # aligned power-of-two decomposition of [0, num_blocks)
            order = self.max_order
            while start % (1 << order) or start + (1 << order) > num_blocks:
                order -= 1
            self._add(start, order)
            start += 1 << order

    # ---- queries ----------------------------------------------------------------------------
    def is_free(self, block: int) -> bool:
        return self._chunk_of(block) is not None

    def free_chunks(self) -> list[tuple[int, int]]:
        """(start, length) of every free chunk, by address."""
        return sorted((s, 1 << o) for s, o in self._order_of.items())

    # ---- allocation -------------------------------------------------------------------------
    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """n blocks, as few runs as possible; `after` is the caller's last block: the new ones
        extend it in place while the following ids are free, so a growing request stays one run."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > self.num_free:
            raise OutOfBlocksError(f"asked for {n} blocks, {self.num_free} free of {self.num_blocks}")
        out: list[int] = []
        last = after
        while len(out) < n:
            if last is not None:  # extend the current run in place while the next ids are free
                b = last + 1
                while len(out) < n and b < self.num_blocks and self.is_free(b):
                    self._take(b)
                    out.append(b)
                    b += 1
                if len(out) == n:
                    break
            m = n - len(out)
            chunk = self._pick(max(m - 1, 0).bit_length())
            if chunk is not None:
                out.extend(self._carve(chunk[0], chunk[1], m))
                break
            # Nothing fits whole: take the largest chunk, then extend it (greedy keeps runs few).
            order = max(o for o in range(self.max_order + 1) if self._counts[o])
            start = self._pop_min(order)
            out.extend(range(start, start + (1 << order)))
            last = out[-1]
        self.num_free -= n
        return out

    def free(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block {b} out of range 0..{self.num_blocks - 1}")
            if self.is_free(b):
                raise ValueError(f"block {b} freed while not allocated")
            start, order = b, 0
            while order < self.max_order:  # merge with the buddy while it is a free chunk of our order
                buddy = start ^ (1 << order)
                if self._order_of.get(buddy) != order:
                    break
                self._remove(buddy)
                start = min(start, buddy)
                order += 1
            self._add(start, order)
            self.num_free += 1

    # ---- internals --------------------------------------------------------------------------
    def _add(self, start: int, order: int) -> None:
        self._order_of[start] = order
        self._counts[order] += 1
        heap = self._heaps[order]
        heapq.heappush(heap, start)
        if len(heap) > 2 * self._counts[order] + 32:  # drop stale entries now and then
            self._heaps[order] = [s for s in set(heap) if self._order_of.get(s) == order]
            heapq.heapify(self._heaps[order])

    def _remove(self, start: int) -> None:
        order = self._order_of.pop(start)
        self._counts[order] -= 1  # its heap entry goes stale and is skipped later

    def _pop_min(self, order: int) -> int:
        heap = self._heaps[order]
        while True:
            s = heapq.heappop(heap)
            if self._order_of.get(s) == order:
                self._remove(s)
                return s

    def _pick(self, min_order: int) -> tuple[int, int] | None:
        """Remove and return a free chunk of order >= min_order: preferably one of at least a
        group, so the new run has room to grow in place, else the smallest that fits."""
        for lo in (max(min_order, self._group_order), min_order):
            for order in range(lo, self.max_order + 1):
                if self._counts[order]:
                    return self._pop_min(order), order
        return None

    def _carve(self, start: int, order: int, m: int) -> list[int]:
        """The first m blocks of a removed chunk; the rest goes back as free buddies."""
        out: list[int] = []
        while m < (1 << order):
            order -= 1
            half = 1 << order
            if m <= half:
                self._add(start + half, order)
            else:
                out.extend(range(start, start + half))
                start += half
                m -= half
        out.extend(range(start, start + (1 << order)))
        return out

    def _chunk_of(self, block: int) -> tuple[int, int] | None:
        for order in range(self.max_order + 1):
            start = block & ~((1 << order) - 1)
            if self._order_of.get(start) == order:
                return start, order
        return None

    def _take(self, block: int) -> None:
        """Allocate one given free block, splitting its chunk around it (num_free untouched)."""
        chunk = self._chunk_of(block)
        assert chunk is not None
        start, order = chunk
        self._remove(start)
        while order:
            order -= 1
            half = 1 << order
            if block < start + half:
                self._add(start + half, order)
            else:
                self._add(start, order)
                start += half
