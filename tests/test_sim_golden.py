"""Refactors of the scheduler must not change what it decides: a fixed multi-policy,
memory-bound simulation in every preemption mode gives the same metrics, bit for bit, as the
results committed in tests/data/sim_golden.json (regenerate only for an intended behaviour
change: `python tests/test_sim_golden.py`, and say why in the commit)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tokenslice.sim.simulate import SweepSpec, run_sweep, strip_per_request
from tokenslice.config import PREEMPTION_MODES
from tokenslice.predict.cost import load_cost_model

GOLDEN = Path(__file__).resolve().parent / "data" / "sim_golden.json"
PROFILE = "opt-13b@a100-40gb"
# Keys dropped since the golden file was written, each a copy of a key that stays:
# engine_preemptions = preemptions, engine_recomputed_tokens = recomputed_tokens (summed per request).
DROPPED_KEYS = {"engine_preemptions", "engine_recomputed_tokens"}
POLICIES = ["fcfs", "request-level", "mlfq", "skip-join-mlfq", "fixed-priority", "srpt-oracle", "srpt-predicted"]


def golden_results() -> dict[str, Any]:
    """Per preemption mode: every run's metrics and the sweep summary. The pool binds (96 device
    blocks for up to 8 running requests of up to 1,024 tokens, a 64-block host tier), and Gamma
    CV 2 arrivals at 0.7 and 1.1 of fcfs saturation make every mode preempt."""
    cost = load_cost_model(PROFILE)
    out: dict[str, Any] = {}
    for mode in PREEMPTION_MODES:
        spec = SweepSpec(workload="synthetic-lognormal", policies=POLICIES, preemption=mode, loads=[0.7, 1.1],
                         cv=2.0, seeds=[0], num_requests=200, max_batch_size=8, max_tokens_per_step=2048,
                         kv_cache_blocks=96, host_kv_blocks=64, max_tokens_cap=512, max_prompt_len=512)
        res = strip_per_request(run_sweep(cost, spec))
        out[mode] = {"runs": [{"policy": r["policy"], "rate": r["rate"], "metrics": r["metrics"]} for r in res["runs"]],
                     "summary": res["summary"]}
    return json.loads(json.dumps(out))  # as stored: tuples become lists, keys strings


def test_simulation_matches_golden_results() -> None:
    want = json.loads(GOLDEN.read_text())
    got = golden_results()
    assert set(got) == set(want)
    for mode in want:
        assert got[mode]["summary"] == want[mode]["summary"], mode
        assert len(got[mode]["runs"]) == len(want[mode]["runs"])
        for g, w in zip(got[mode]["runs"], want[mode]["runs"], strict=True):
            assert (g["policy"], g["rate"]) == (w["policy"], w["rate"])
            diff = {k: (g["metrics"].get(k), v) for k, v in w["metrics"].items()
                    if k not in DROPPED_KEYS and g["metrics"].get(k) != v}
            assert not diff, (mode, w["policy"], diff)


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(golden_results(), indent=1) + "\n")
    print(f"wrote {GOLDEN}", file=sys.stderr)
