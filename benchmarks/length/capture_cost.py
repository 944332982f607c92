"""What capturing hidden states costs a decode step (issue 33: "measure the copy's cost").

The real chat model (smollm2-135m-instruct, quantization auto, eager, one torch thread) decodes
a batch of `--batch` requests; steps alternate between no capture and every row capturing its
state after `--layer` (the worst case: with refinement every k tokens about 1/k of the rows
capture in a step), and the median step time of each is compared. Also the self head's
prediction for a whole batch of captured states (apply: features and one matrix-vector product).
`--compile`: decode steps compiled before the first (SmolLM2's one-row steps; its multi-row steps
stay eager, model/compiled_decode.py), capturing between the layer graphs.

    .venv/bin/python benchmarks/length/capture_cost.py [--batch 8] [--layer 15] [--steps 60] [--compile]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from tokenslice.llm import LLM
from tokenslice.predict.self_head import SelfHeadConfig, SelfLengthHead
from tokenslice.predict.self_refine import SelfRefiner
from tokenslice.request import SamplingParams

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layer", type=int, default=15)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    llm = LLM("smollm2-135m-instruct", max_model_len=2048, max_batch_size=a.batch, compile=a.compile,
              compile_in_background=False)
    eng = llm.engine
    for i in range(a.batch):
        params = SamplingParams(temperature=0.0, max_tokens=10 * a.steps, ignore_eos=True)
        eng.add_request([1] + [200 + i] * 100, params)
    eng.step()  # the prefills
    sched, ex = eng.scheduler, eng.executor
    times: dict[bool, list[float]] = {False: [], True: []}
    hidden = {}
    for i in range(2 * a.steps):
        capture = i % 2 == 1
        plan = sched.schedule(eng.clock.now())
        if capture:
            for s in plan.decode:
                s.capture_hidden = True
            plan.hidden_layer = a.layer
        start = time.perf_counter()
        result = ex.execute(plan)
        times[capture].append(time.perf_counter() - start)
        sched.update(plan, result, eng.clock.now())
        hidden = result.hidden or hidden
    dim = len(next(iter(hidden.values())))
    head = SelfLengthHead(SelfHeadConfig(layer=a.layer, hidden_size=dim))
    rng = np.random.default_rng(0)
    head.add(rng.normal(size=(64, dim)), np.full(64, 50), np.zeros(64), np.full(64, 100.0))
    head.fit()
    refiner = SelfRefiner(head)
    apply_s = []
    for r in range(50):
        for rid in hidden:
            refiner.add(rid, 100)
        start = time.perf_counter()
        refiner.apply(hidden, {rid: 0 for rid in hidden})
        apply_s.append(time.perf_counter() - start)
    plain, captured = (1000 * float(np.median(times[c])) for c in (False, True))
    out = {"batch": a.batch, "layer": a.layer, "compiled": a.compile, "steps_each": a.steps, "median_step_ms": plain,
           "median_step_capture_all_ms": captured, "capture_all_extra_ms": captured - plain,
           "predict_batch_ms": 1000 * float(np.median(apply_s)), "hidden_size": dim}
    print(json.dumps(out, indent=1))
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / f"capture_cost_b{a.batch}{'_compiled' if a.compile else ''}.json").write_text(json.dumps(out, indent=1) + "\n")
    llm.close()


if __name__ == "__main__":
    main()
