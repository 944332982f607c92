"""The workload the rank-worker executors are checked with (tests/test_tensor_parallel.py,
tests/test_pipeline_parallel.py, tests/test_ray_executor.py): memory binds, so residents are
preempted and swapped, and a greedy run must give what one process gives."""
from __future__ import annotations

import random

from tokenslice import SamplingParams
from tokenslice.engine.engine import Engine
from tokenslice.plan import SeqSlice, StepPlan

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
# Memory binds: 14 blocks of 16 tokens for 4 running requests of up to 67 tokens; short requests
# arriving later outrank the long ones under fixed-priority, so residents are evicted.
# The stall guard off: it reads wall-clock time, and runs compared step for step (one rank
# against several) must take the same scheduling decisions.
PRESSURE = dict(dtype="float32", policy="fixed-priority", kv_cache_blocks=14, max_batch_size=4, host_kv_blocks=64,
                eviction_amortization=0.0, enable_prefix_caching=False, stall_guard="off")
_RNG = random.Random(3)
LONG = [[1] + [_RNG.randrange(3, 500) for _ in range(50)] for _ in range(6)]
SHORT = [[1] + [_RNG.randrange(3, 500) for _ in range(3)] for _ in range(6)]


def run_waves(engine: Engine, long: list[list[int]] = LONG, short: list[list[int]] = SHORT,
              params: SamplingParams = GREEDY) -> list[list[int]]:
    """The long prompts, five steps, then the short ones; every request's output ids."""
    reqs = [engine.add_request(p, params) for p in long]
    for _ in range(5):
        engine.step()
    reqs += [engine.add_request(p, params) for p in short]
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in reqs]


def check_plans_in_flight_come_back_in_order(executor) -> None:
    """Two plans submitted before either is polled return in submission order."""
    plans = [StepPlan(prefill=[SeqSlice(f"raw-{i}", p, 0, [i], True, GREEDY, 0)])
             for i, p in enumerate([[1, 5, 9], [1, 7]])]
    for plan in plans:
        executor.submit(plan)
    results = [executor.poll(), executor.poll()]
    assert [list(r.sampled) for r in results] == [["raw-0"], ["raw-1"]]
    executor.execute(StepPlan(finished=["raw-0", "raw-1"]))


def count_in_flight(engine: Engine) -> list[int]:
    """Record how many plans are in flight at each submit."""
    seen: list[int] = []
    submit = engine.executor.submit

    def counted(plan):
        submit(plan)
        seen.append(len(engine._pipe) + 1)
    engine.executor.submit = counted  # type: ignore[method-assign]
    return seen
