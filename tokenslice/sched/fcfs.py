"""Iteration-level first-come-first-served (Orca / vLLM): oldest request first, run to completion."""
from __future__ import annotations

from tokenslice.request import Request


class FCFSPolicy:
    name = "fcfs"

    def __init__(self) -> None:
        # Insertion order is arrival order; a dict keeps it and removes in O(1).
        self._live: dict[str, Request] = {}

    def on_arrival(self, req: Request, now: float) -> None:
        self._live[req.request_id] = req

    def on_step(self, ran: list[Request], step_seconds: float, now: float) -> None:
        pass

    def on_finish(self, req: Request) -> None:
        self._live.pop(req.request_id, None)

    def ranked(self, now: float) -> list[Request]:
        return list(self._live.values())

    def next_run_estimate(self, req: Request, now: float) -> float:
        # FCFS never pauses a request it has started, so the estimate only orders waiting ones.
        return req.arrival_time
