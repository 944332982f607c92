"""The Policy protocol (DESIGN.md, Core types) and the registry of policies by name."""
from __future__ import annotations

from typing import Protocol

from tokenslice.request import Request


class Policy(Protocol):
    """Orders live requests; knows nothing about memory."""

    name: str

    def on_arrival(self, req: Request, now: float) -> None: ...

    def on_step(self, ran: list[Request], step_seconds: float, now: float) -> None: ...

    def on_finish(self, req: Request) -> None: ...

    def ranked(self, now: float) -> list[Request]:
        """Live requests, best first."""
        ...

    def next_run_estimate(self, req: Request, now: float) -> float:
        """Seconds until `req` is expected to run again (FastServe ENST, ALISE EWT)."""
        ...


POLICY_NAMES = ("fcfs", "request-level", "mlfq", "fixed-priority", "skip-join-mlfq",
                "srpt-oracle", "srpt-predicted", "priority", "vtc")


def make_policy(name: str) -> Policy:
    # Imported here: policy modules import this one for the protocol.
    from tokenslice.sched.fcfs import FCFSPolicy

    builders = {"fcfs": FCFSPolicy}
    if name not in builders:
        known = ", ".join(sorted(builders))
        if name in POLICY_NAMES:
            raise ValueError(f"policy {name!r} is not available in this build; available: {known}")
        raise ValueError(f"unknown policy {name!r}; available: {known}")
    return builders[name]()
