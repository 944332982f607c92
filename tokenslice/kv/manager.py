"""KVManager: where each request's KV lives and how many blocks it holds (DESIGN.md, KVManager).

It plans; the model runner owns the tensors. Device tier only for now; the block table
per request is the unit a host tier will mirror.
"""
from __future__ import annotations

from tokenslice.kv.blocks import BlockPool


class KVManager:
    def __init__(self, block_size: int, num_device_blocks: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.device = BlockPool(num_device_blocks)
        self._tables: dict[str, list[int]] = {}

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_device_blocks(self) -> int:
        return self.device.num_free

    @property
    def capacity_tokens(self) -> int:
        return self.device.num_blocks * self.block_size

    def holds(self, request_id: str) -> bool:
        return bool(self._tables.get(request_id))

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_device_blocks(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ()))

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra device blocks a request needs so that `num_tokens` tokens fit."""
        return max(0, self.blocks_for_tokens(num_tokens) - self.num_device_blocks(request_id))

    def ensure(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's table to hold `num_tokens` tokens; returns the new blocks."""
        need = self.blocks_needed(request_id, num_tokens)
        if need == 0:
            return []
        new = self.device.allocate(need)
        self._tables.setdefault(request_id, []).extend(new)
        return new

    def free(self, request_id: str) -> int:
        """Release every block of the request; returns how many were released."""
        table = self._tables.pop(request_id, None)
        if not table:
            return 0
        self.device.free(table)
        return len(table)

    def owners(self) -> dict[str, list[int]]:
        return {rid: list(t) for rid, t in self._tables.items()}
