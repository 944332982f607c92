"""Anti-thrashing for evictions (the collapse FastServe §4.2 guards against with ENST-ordered
swaps): when many jobs of similar priority want more KV than the device holds, MLFQ's short top
quanta would rotate them through memory every few iterations, each rotation paying a swap or a
recompute. A job whose KV was just loaded (prefill, recompute or swap-in) is protected from
eviction by other loads until it has run for `amortization` x its load time, so loading costs at
most that fraction of useful work."""
from __future__ import annotations


class EvictionGuard:
    def __init__(self, amortization: float) -> None:
        self.amortization = amortization  # 0: off
        self._protected_until: dict[str, float] = {}  # request id -> own-share seconds
        self._share: dict[str, float] = {}  # per request: its token share of the steps it ran in

    def protect(self, request_id: str, load_s: float) -> None:
        if self.amortization > 0:
            self._protected_until[request_id] = self._share.get(request_id, 0.0) + self.amortization * load_s

    def is_protected(self, request_id: str) -> bool:
        until = self._protected_until.get(request_id)
        return until is not None and self._share.get(request_id, 0.0) < until

    def charge_service(self, request_id: str, seconds: float) -> None:
        """The job's own share of a step it ran in (by tokens): what its residency bought."""
        self._share[request_id] = self._share.get(request_id, 0.0) + seconds

    def forget(self, request_id: str) -> None:
        self._protected_until.pop(request_id, None)
        self._share.pop(request_id, None)
