"""`tokenslice twin`: one trace on the real engine over HTTP (a real `tokenslice serve` child) and
in the simulator, end to end on stories260k, and the serving path the simulator adds."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tokenslice.bench.metrics import RequestRecord
from tokenslice.bench.serving_path import ServingPath
from tokenslice.bench.simulate import simulate_run
from tokenslice.bench.twin import TWIN_METRICS
from tokenslice.bench.workloads import make_workload
from tokenslice.config import SchedulerConfig
from tokenslice.engine.step_trace import load_step_trace
from tokenslice.predict.cost import load_cost_model

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT.parent / "shared" / "models" / "stories260k"


def test_twin_end_to_end_on_stories260k(tmp_path: Path) -> None:
    out, traces = tmp_path / "twin.json", tmp_path / "traces"
    cmd = [sys.executable, "-m", "tokenslice.cli", "--log-level", "WARNING", "twin", "--model", str(STORIES),
           "--dtype", "float32", "--policy", "fcfs", "--workload", "synthetic-fixed", "--input-len", "24",
           "--output-len", "6", "--num-requests", "6", "--rate", "20", "--repeats", "2", "--warmup-requests", "2",
           "--step-trace-dir", str(traces), "--out", str(out), "--quiet"]
    # No --profile: the command profiles the model first, in a child process.
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    text = done.stdout
    assert "fcfs" in text and "real" in text and "simulated" in text
    for _, label in TWIN_METRICS:
        assert label in text

    result = json.loads(out.read_text())
    assert len(result["points"]) == 1 and result["points"][0]["rate"] == 20
    fcfs = result["points"][0]["policies"]["fcfs"]
    for key, _ in TWIN_METRICS:
        m = fcfs["metrics"][key]
        assert len(m["real_runs"]) == 2 and all(v is not None and v > 0 for v in m["real_runs"])
        assert m["sim"] is not None and m["sim"] > 0
        assert m["error"] == pytest.approx(m["sim"] / m["real"] - 1)
    path = fcfs["serving_path"]
    assert path["ingress_s"] > 0 and path["egress_s"] > 0  # HTTP costs something both ways
    # Both sides' steps were traced; every real run computed all 6 prompts and 6 x 6 tokens.
    real_steps = load_step_trace(traces / "fcfs.steps.jsonl")
    sim_steps = load_step_trace(traces / "fcfs.point0.sim-steps.jsonl")
    assert sum(len(s.prefill) for s in sim_steps) == 6
    assert sum(s.sampled for s in sim_steps) == 36
    assert sum(s.sampled for s in real_steps) >= 2 * 36
    for run in fcfs["steps"]["real"]:
        assert run["prefill_steps"] >= 1 and run["steps"] >= 6
    assert (traces / "profile.json").is_file()


def test_serving_path_shifts_what_the_client_sees_and_nothing_else() -> None:
    cost = load_cost_model("opt-13b@a100-40gb")
    wl = make_workload("synthetic-zipf", num_requests=40, rate=30.0, seed=3, max_len=200)
    cfg = SchedulerConfig(policy="skip-join-mlfq", max_batch_size=4)
    bare, _ = simulate_run(cost, wl, cfg, kv_cache_blocks=4096)
    zero, _ = simulate_run(cost, wl, cfg, kv_cache_blocks=4096, path=ServingPath())
    assert [r.token_times for r in zero] == [r.token_times for r in bare]
    ingress, egress = 0.004, 0.002
    seen, _ = simulate_run(cost, wl, cfg, kv_cache_blocks=4096, path=ServingPath(ingress, egress))
    shifted, _ = simulate_run(cost, [type(r)(**{**r.__dict__, "arrival_time": r.arrival_time + ingress})
                                     for r in wl], cfg, kv_cache_blocks=4096)
    by_id = {r.request_id: r for r in shifted}
    for r in seen:
        engine: RequestRecord = by_id[r.request_id]
        assert r.arrival == pytest.approx(engine.arrival - ingress)
        assert r.token_times == pytest.approx([t + egress for t in engine.token_times])
        assert r.ttft == pytest.approx(engine.ttft + ingress + egress)
        assert r.exec_s == engine.exec_s


def test_simulated_step_trace_matches_the_run(tmp_path: Path) -> None:
    cost = load_cost_model("opt-13b@a100-40gb")
    wl = make_workload("synthetic-zipf", num_requests=30, rate=20.0, seed=1, max_len=100)
    cfg = SchedulerConfig(policy="fcfs", max_batch_size=4)
    plain, counters = simulate_run(cost, wl, cfg, kv_cache_blocks=2048)
    traced, traced_counters = simulate_run(cost, wl, cfg, kv_cache_blocks=2048, step_trace=str(tmp_path / "s.jsonl"))
    for a, b in zip(traced, plain, strict=True):  # fast-forward sums step times in another order
        assert a.token_times == pytest.approx(b.token_times)
    steps = load_step_trace(tmp_path / "s.jsonl")
    assert len(steps) == traced_counters["num_steps"]
    assert sum(s.sampled for s in steps) == sum(r.output_tokens for r in traced)
    # Virtual starts: each step begins where the one before ended, or later (an idle gap).
    for a, b in zip(steps, steps[1:]):
        assert b.start >= a.start + a.step_seconds - 1e-12


def test_policies_can_see_another_cost_model_than_the_clock() -> None:
    clock, other = load_cost_model("opt-13b@a100-40gb"), load_cost_model("llama-8b@a10-24gb")
    wl = make_workload("synthetic-zipf", num_requests=60, rate=40.0, seed=5, max_len=400)

    def run(policy: str, policy_cost: object) -> list[list[float]]:
        records, _ = simulate_run(clock, wl, SchedulerConfig(policy=policy, max_batch_size=4), kv_cache_blocks=8192,
                                  policy_cost=policy_cost)  # type: ignore[arg-type]
        return [r.token_times for r in records]

    # fcfs never asks the cost model: the clock alone sets every time.
    assert run("fcfs", other) == run("fcfs", None) == run("fcfs", clock)
    # skip-join-mlfq places newcomers by the first iteration's cost: another model, other decisions.
    assert run("skip-join-mlfq", clock) == run("skip-join-mlfq", None)
    assert run("skip-join-mlfq", other) != run("skip-join-mlfq", None)


def test_serving_path_read_off_lone_requests_and_their_steps() -> None:
    from tokenslice.bench.client import ClientRecord
    from tokenslice.bench.trace_compare import measure_path, trace_summary
    from tokenslice.engine.step_trace import StepRecord

    # Two lone requests, sent at 100.000 and 200.000 (wall clock): each prompt ran in a step that
    # began 3 ms after the send and took 1 + 2 + 1 ms; the first token reached the client 5 ms later.
    steps, lone = [], []
    for k, zero in enumerate((100.0, 200.0)):
        start = zero + 0.003
        steps.append(StepRecord(2 * k + 1, start, prefill=[[16, 0]], sampled=1, running=1, schedule_s=0.001,
                                execute_s=0.002, update_s=0.001))
        steps.append(StepRecord(2 * k + 2, start + 0.006, decode=[17], sampled=1, running=1))
        lone.append((zero, ClientRecord(request_id=f"r{k}", arrival=0.0, first_token_time=0.003 + 0.004 + 0.005)))
    path = measure_path(lone, steps)
    assert path.ingress_s == pytest.approx(0.003) and path.egress_s == pytest.approx(0.005)
    summary = trace_summary(steps)
    assert summary["steps"] == 4 and summary["prefill_steps"] == 2 and summary["mean_prefill_chunk"] == 16
    assert summary["median_period_s"] == pytest.approx(0.006)  # the idle gap between the requests is no step's
