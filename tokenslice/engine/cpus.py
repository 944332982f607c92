"""The CPU split between the API-server process and the engine core, so that their threads do not
fight: on CPU, torch's compute threads wait for each other at every parallel region, and one of
them sharing a core with the event loop or the detokenizer stalls the whole step.

The API server keeps `api_server_cpus` of the CPUs this process may use, the engine core gets the
rest and as many torch threads; with `pin`, each process is bound to its CPUs
(os.sched_setaffinity, Linux), so the OS cannot move a compute thread onto the API server's CPU.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from tokenslice.config import CpuConfig

# Where the split is not pinned, a model this large (ArchConfig.matmul_params) gets a compute thread
# on every CPU, the API server's too: its matmuls pay for the waits at each barrier. On 2 cores,
# SmolLM2-135M served 16 streams 1.4x faster with 2 threads than with 1 (and one stream no slower);
# stories260k and a 24M Llama were faster with one (docs/benchmarks/decode-speed-and-llamacpp.md).
ALL_CPUS_MIN_MATMUL_PARAMS = 100_000_000


@dataclass(frozen=True)
class CpuPlan:
    api_cpus: tuple[int, ...]  # the API server's: event loop, HTTP, detokenization
    engine_cpus: tuple[int, ...]  # the engine core's compute threads
    engine_threads: int  # torch intra-op threads in the engine core
    pin: bool  # bind each process to its CPUs
    all_cpus_threads: int = 0  # threads for a large model where nothing is pinned (0: engine_threads)

    def threads_for(self, matmul_params: int) -> int:
        """The engine's torch threads for a model that multiplies `matmul_params` weights per token."""
        if self.all_cpus_threads and matmul_params >= ALL_CPUS_MIN_MATMUL_PARAMS:
            return self.all_cpus_threads
        return self.engine_threads

    @property
    def disjoint(self) -> bool:
        return not set(self.api_cpus) & set(self.engine_cpus)


def available_cpus() -> list[int]:
    """The CPUs this process may run on (a container's or taskset's limit included)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def plan_cpus(config: CpuConfig, available: Sequence[int] | None = None) -> CpuPlan:
    """Split the `available` CPUs (default: this process's): the first `api_server_cpus` for the
    API server (never all of them: the engine keeps at least one), the rest for the engine.
    `engine_threads`, else $OMP_NUM_THREADS, else one per engine CPU (one per CPU for a large model
    where nothing is pinned: `CpuPlan.threads_for`), sets the engine's thread count. With one CPU,
    or `api_server_cpus` 0, both share every CPU and nothing is pinned."""
    config.validate()
    cpus = tuple(available_cpus() if available is None else available)
    reserve = min(config.api_server_cpus, len(cpus) - 1)
    engine = cpus[reserve:] if reserve > 0 else cpus
    omp = os.environ.get("OMP_NUM_THREADS", "")
    chosen = config.engine_threads or (int(omp) if omp.isdigit() and int(omp) > 0 else 0)
    threads = chosen or len(engine)
    if reserve <= 0:
        return CpuPlan(cpus, cpus, threads, False)
    pin = (config.pin_cpus if config.pin_cpus is not None else len(cpus) > 2) and hasattr(os, "sched_setaffinity")
    return CpuPlan(cpus[:reserve], engine, threads, pin, 0 if chosen or pin else len(cpus))


def pin_process(cpus: Sequence[int]) -> None:
    """Bind every thread of the calling process to `cpus` (affinity is per thread on Linux;
    threads started later inherit their creator's)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
