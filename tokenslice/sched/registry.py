"""Policies and preemption strategies by name (docs/DESIGN.md, "Names shared by CLI, config and
results"). Its own module so that policy and strategy modules import only their base classes,
and nothing imports in a cycle."""
from __future__ import annotations

from collections.abc import Callable

from tokenslice.config import SchedulerConfig
from tokenslice.sched.fair import PriorityPolicy, VTCPolicy
from tokenslice.sched.fcfs import FCFSPolicy, RequestLevelPolicy
from tokenslice.sched.fixed_priority import FixedPriorityPolicy
from tokenslice.sched.mlfq import SkipJoinMLFQPolicy
from tokenslice.sched.policy import Policy, PolicyContext
from tokenslice.sched.preemption import Defer, ReactiveSwap, Recompute
from tokenslice.sched.proactive import ProactiveSwap
from tokenslice.sched.speculative import SpeculativeSRPTPolicy
from tokenslice.sched.srpt import SRPTOraclePolicy

_BUILDERS: dict[str, Callable[[PolicyContext], Policy]] = {
    "fcfs": lambda ctx: FCFSPolicy(),
    "request-level": RequestLevelPolicy,
    "mlfq": lambda ctx: SkipJoinMLFQPolicy(ctx, skip_join=False),
    "skip-join-mlfq": lambda ctx: SkipJoinMLFQPolicy(ctx, skip_join=True),
    "fixed-priority": lambda ctx: FixedPriorityPolicy(),
    "srpt-oracle": SRPTOraclePolicy,
    "srpt-predicted": SpeculativeSRPTPolicy,
    "priority": lambda ctx: PriorityPolicy(),
    "vtc": VTCPolicy,
}
POLICY_NAMES = tuple(_BUILDERS)


def make_policy(name: str, ctx: PolicyContext | None = None) -> Policy:
    builder = _BUILDERS.get(name)
    if builder is None:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(POLICY_NAMES)}")
    return builder(ctx or PolicyContext(SchedulerConfig(policy=name)))


# The memory modes (config.PREEMPTION_MODES), each with its strategy.
PREEMPTION_STRATEGIES: dict[str, type[Recompute]] = {c.mode: c for c in (Defer, Recompute, ReactiveSwap, ProactiveSwap)}
