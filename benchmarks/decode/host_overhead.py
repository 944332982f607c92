"""Host work per decode step, with the device's share taken away: the real Engine and Scheduler
(`builtin:tiny`'s engine, its tokenizer, detokenization and stop-string checks) over an executor
whose forward pass costs nothing (`NullExecutor`: every sampling slice gets a fixed token at once).
What remains is what a GPU would wait for between steps unless the loop overlaps it.

Per batch size B (B requests decoding together, 8-token prompts, ignore_eos), after a warm-up,
the mean over --steps decode steps of Engine.step(), in microseconds, split as
  plan     Scheduler.schedule (StepTimings.schedule_s)
  forward  executor.execute (here: the null forward; the plan is still walked)
  update   Scheduler.update and the requests' bookkeeping (StepTimings.update_s)
  output   the RequestOutputs, detokenization and stop strings (the rest of Engine.step)
and per row (the step divided by B). The real model's breakdown is benchmarks/decode/step_breakdown.py.

With --overlap on (async scheduling) the engine plans step n+1 before step n's tokens are back,
so the same host work runs while the device computes: a device step longer than the host's
work per step sees no gap between steps. The columns then measure the work, not a gap.

    PYTHONPATH=. .venv/bin/python benchmarks/decode/host_overhead.py [--batches 1,16,64,256]
        [--policies fcfs,skip-join-mlfq,srpt-oracle,vtc] [--overlap off,on] [--steps 200]
        [--out benchmarks/decode/results/host_overhead.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

from tokenslice.config import EngineConfig
from tokenslice.engine.engine import Engine, StepTimings
from tokenslice.exec.base import ImmediateExecutor
from tokenslice.plan import StepPlan, StepResult
from tokenslice.request import EngineRequest, SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT_TOKENS = 8
WARMUP_STEPS = 20
COLUMNS = ("plan", "forward", "update", "output")


class NullExecutor(ImmediateExecutor):
    """Runs no model: each sampling slice gets `token`, every transfer completes at once."""

    def __init__(self, token: int) -> None:
        super().__init__()
        self.token = token

    def run(self, plan: StepPlan) -> StepResult:
        return StepResult(sampled={s.request_id: self.token for s in plan.slices if s.sample},
                          transfers_done=[t.request_id for t in plan.async_transfers])

    def close(self) -> None:
        pass


def engine_for(policy: str, batch: int, steps: int, overlap: bool) -> Engine:
    max_len = PROMPT_TOKENS + WARMUP_STEPS + steps + 8
    blocks = batch * (max_len // 16 + 2)
    config = EngineConfig.from_options(model="builtin:tiny", policy=policy, max_batch_size=batch,
                                       kv_cache_blocks=blocks, max_model_len=max_len, stall_guard="off",
                                       async_scheduling=overlap)
    engine = Engine.from_config(config)
    engine.executor.close()
    engine.executor = NullExecutor(token=engine.tokenizer.encode(" the", add_special_tokens=False)[-1])
    return engine


def measure(policy: str, batch: int, steps: int, overlap: bool) -> dict[str, float]:
    engine = engine_for(policy, batch, steps, overlap)
    params = SamplingParams(max_tokens=WARMUP_STEPS + steps + 4, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        engine.add(EngineRequest(f"r{i}", [1 + (i + j) % 200 for j in range(PROMPT_TOKENS)], params))
    for _ in range(WARMUP_STEPS):  # every request past its prompt
        engine.step()
    gc.collect()
    gc.freeze()  # as the engine core does after start-up: full collections skip the model's objects
    engine.timings = StepTimings()
    exec_s = 0.0
    inner = engine.executor.run

    def timed(plan: StepPlan) -> StepResult:
        nonlocal exec_s
        t = time.perf_counter()
        try:
            return inner(plan)
        finally:
            exec_s += time.perf_counter() - t

    engine.executor.run = timed  # type: ignore[method-assign]
    rows = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        rows += len(engine.step())
    total = time.perf_counter() - t0
    assert rows == steps * batch, (rows, steps * batch)  # every step decoded the whole batch
    engine.close()
    gc.unfreeze()
    t = engine.timings
    us = 1e6 / steps
    # StepTimings.execute_s also holds the engine's own work around executor.execute: counted as update.
    plan, forward, update = t.schedule_s * us, exec_s * us, (t.execute_s + t.update_s - exec_s) * us
    step = total * us
    return {"step_us": step, "row_us": step / batch, "plan": plan, "forward": forward, "update": update,
            "output": step - plan - forward - update}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--policies", default="fcfs,skip-join-mlfq,srpt-oracle,vtc")
    p.add_argument("--overlap", default="off,on", help="async scheduling off, on, or both")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default=str(RESULTS / "host_overhead.json"))
    a = p.parse_args()
    out: dict[str, object] = {"machine": platform.node(), "cpu": platform.processor() or platform.machine(),
                              "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                              "load": os.getloadavg()[0], "steps": a.steps, "rows": []}
    print(f"{'policy':<16}{'overlap':>8}{'batch':>6}{'step us':>10}{'row us':>9}" + "".join(f"{c:>9}" for c in COLUMNS))
    for policy in a.policies.split(","):
        for overlap in a.overlap.split(","):
            for batch in (int(b) for b in a.batches.split(",")):
                r = measure(policy, batch, a.steps, overlap == "on")
                out["rows"].append({"policy": policy, "overlap": overlap, "batch": batch, **r})  # type: ignore[union-attr]
                print(f"{policy:<16}{overlap:>8}{batch:>6}{r['step_us']:>10.0f}{r['row_us']:>9.1f}"
                      + "".join(f"{r[c]:>9.0f}" for c in COLUMNS), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
