"""`tokenslice twin`: one trace on the real engine over HTTP (a real `tokenslice serve` child) and
in the simulator, end to end on stories260k, and the serving path the simulator adds."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tokenslice.bench.metrics import RequestRecord
from tokenslice.sim.serving_path import ServingPath
from tokenslice.sim.simulate import simulate_run
from tokenslice.sim.twin import TWIN_METRICS
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
    # HTTP costs something both ways; the fit may put the way out in its per-token slope alone.
    assert path["ingress_s"] > 0 and path["egress_s"] + path["egress_per_token_s"] > 0
    # Both sides' steps were traced; every real run computed all 6 prompts and 6 x 6 tokens.
    real_steps = load_step_trace(traces / "fcfs.steps.jsonl")
    sim_steps = load_step_trace(traces / "fcfs.point0.sim-steps.jsonl")
    assert sum(len(s.prefill) for s in sim_steps) == 6
    assert sum(s.sampled for s in sim_steps) == 36
    assert sum(s.sampled for s in real_steps) >= 2 * 36
    for run in fcfs["steps"]["real"]:
        assert run["prefill_steps"] >= 1 and run["steps"] >= 6
    assert (traces / "profile.json").is_file()
    # The first run followed request by request on both sides: all 6 reached a prompt step.
    adm = fcfs["admission"]
    assert adm["real"]["requests"] == adm["sim"]["requests"] == 6
    under_load = adm["path_under_load"]
    assert under_load["ingress_s"] > 0 and under_load["egress_s"] + under_load["egress_per_token_s"] > 0


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
    from tokenslice.bench.client_record import ClientRecord
    from tokenslice.sim.trace_compare import measure_path, trace_summary
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


def test_admissions_follow_each_simulated_request_to_its_prompt_step(tmp_path: Path) -> None:
    from tokenslice.sim.trace_compare import admissions

    cost = load_cost_model("opt-13b@a100-40gb")
    wl = make_workload("synthetic-fixed", num_requests=30, rate=20.0, seed=1, input_len=24, output_len=6)
    path = ServingPath(0.004, 0.002)
    records, _ = simulate_run(cost, wl, SchedulerConfig(policy="fcfs", max_batch_size=4), kv_cache_blocks=2048,
                              path=path, step_trace=str(tmp_path / "s.jsonl"), enable_prefix_caching=False)
    steps = load_step_trace(tmp_path / "s.jsonl")
    adm = {a.request_id: a for a in admissions(records, 0.0, steps)}
    assert set(adm) == {r.request_id for r in records}
    by_id = {s: i for i, step in enumerate(steps) for s in step.prefill_ids}
    for r in records:
        a, step = adm[r.request_id], steps[by_id[r.request_id]]
        # The engine had it ingress_s after the send; the first token reached the client egress_s
        # after the step that computed it (a whole prompt in one step here) ended.
        assert a.wait_s >= path.ingress_s - 1e-12
        assert a.wait_s == pytest.approx(step.start - r.arrival)
        assert r.first_token_time == pytest.approx(step.start + a.first_s)
        assert a.first_s >= step.step_seconds + path.egress_s - 1e-12
        assert a.steps_before == sum(1 for s in steps if r.arrival <= s.start < step.start)


def test_serving_path_under_load_read_off_a_busy_trace() -> None:
    from tokenslice.bench.client_record import ClientRecord
    from tokenslice.sim.trace_compare import admissions, path_under_load
    from tokenslice.engine.step_trace import StepRecord

    # Steps of 1 ms back to back from t = 10 s. Request "a" is sent 0.5 ms into step 1 and its
    # prompt runs in step 3: the engine got it during step 2 (it missed the read before step 2),
    # 0.5 to 1.5 ms after the send. Request "b" is sent while the engine idles after step 4 and
    # runs at once in step 5, 2 ms later: exactly its ingress. Each first token reaches the
    # client 3 ms after its step ended.
    starts = [10.000, 10.001, 10.002, 10.003, 10.0105]
    steps = [StepRecord(k + 1, t, decode=[20], sampled=1, running=1, execute_s=0.001) for k, t in enumerate(starts)]
    steps[2] = StepRecord(3, starts[2], prefill=[[8, 0]], prefill_ids=["cmpl-a"], decode=[20], sampled=2, running=2,
                          execute_s=0.001)
    steps[3].finished = 2
    steps[4] = StepRecord(5, starts[4], prefill=[[8, 0]], prefill_ids=["cmpl-b"], sampled=1, running=1,
                          execute_s=0.001)
    zero = 10.0
    records = [ClientRecord(request_id="a", arrival=0.0005, first_token_time=0.003 + 0.003),
               ClientRecord(request_id="b", arrival=0.0085, first_token_time=0.0115 + 0.003)]
    adm = admissions(records, zero, steps, {"a": "cmpl-a", "b": "cmpl-b"})
    assert [a.request_id for a in adm] == ["a", "b"]
    assert adm[0].ingress_s == pytest.approx((0.0005, 0.0015)) and adm[0].steps_before == 1
    assert adm[1].ingress_s == pytest.approx((0.002, 0.002)) and adm[1].steps_before == 0
    assert adm[0].out_s == pytest.approx(0.003) and adm[1].first_s == pytest.approx(0.004)
    path = path_under_load(adm)
    assert path.ingress_s == pytest.approx((0.001 + 0.002) / 2) and path.egress_s == pytest.approx(0.003)
    assert [a.emitted for a in adm] == [2, 1] and path.egress_per_token_s == pytest.approx(0.0, abs=1e-9)


def test_a_burst_reaches_the_engine_one_ingress_gap_apart() -> None:
    from tokenslice.sim.trace_compare import ingress_gap
    from tokenslice.bench.workloads import WorkloadRequest
    from tokenslice.engine.step_trace import StepRecord

    # Simulated: 5 requests sent at once, one 1 s later; 2 ms in, then 3 ms each behind the one before.
    reqs = [WorkloadRequest(f"r{i}", 0.0 if i < 5 else 1.0, None, 8, 4) for i in range(6)]
    path = ServingPath(ingress_s=0.002, egress_s=0.001, ingress_gap_s=0.003)
    delays = path.ingress_delays(reqs)
    assert [delays[f"r{i}"] for i in range(6)] == pytest.approx([0.002, 0.005, 0.008, 0.011, 0.014, 0.002])
    assert [r.arrival_time for r in path.to_engine(reqs)] == pytest.approx([0.002, 0.005, 0.008, 0.011, 0.014, 1.002])
    cost = load_cost_model("opt-13b@a100-40gb")
    seen, _ = simulate_run(cost, reqs, SchedulerConfig(policy="fcfs", max_batch_size=8), kv_cache_blocks=256, path=path)
    assert [r.arrival for r in seen] == pytest.approx([r.arrival_time for r in reqs])  # the client's send times
    assert all(r.queue_s >= delays[r.request_id] + path.egress_s - 1e-12 for r in seen)

    # Read back off a real-like trace: a burst of 7 reaches an idle engine, 2 before its first
    # step, then one more every 4 ms (steps of 2 ms, each reading what came in during the last).
    steps, held = [], [2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]
    for k, n in enumerate(held):
        steps.append(StepRecord(k + 1, 50.0 + 0.002 * k, decode=[9] * n, sampled=n, running=n))
    steps[-1].finished = 7
    assert ingress_gap(steps) == pytest.approx((0.002 * 10) / 5)


def test_egress_grows_with_the_tokens_each_step_streams() -> None:
    cost = load_cost_model("opt-13b@a100-40gb")
    wl = make_workload("synthetic-zipf", num_requests=40, rate=30.0, seed=3, max_len=200)
    cfg = SchedulerConfig(policy="fcfs", max_batch_size=4)
    engine, _ = simulate_run(cost, wl, cfg, kv_cache_blocks=4096)
    base, per = 0.002, 0.0005
    seen, _ = simulate_run(cost, wl, cfg, kv_cache_blocks=4096, path=ServingPath(egress_s=base, egress_per_token_s=per))
    emitted = Counter(t for r in engine for t in r.token_times)  # the simulator's tokens of one step share a time
    assert max(emitted.values()) > 1
    by_id = {r.request_id: r for r in engine}
    for r in seen:
        e = by_id[r.request_id]
        assert r.token_times == pytest.approx([t + base + per * emitted[t] for t in e.token_times])
        assert r.ttft == pytest.approx(e.ttft + base + per * emitted[e.first_token_time])
        assert r.finish_time == pytest.approx(r.token_times[-1])


def test_egress_fit_recovers_a_known_line() -> None:
    from tokenslice.sim.trace_compare import fit_egress

    rng = np.random.default_rng(0)
    emitted = rng.integers(1, 17, size=400)
    out = 0.0015 + 0.0002 * emitted + rng.normal(0.0, 2e-5, size=400)
    base, per = fit_egress(list(zip(emitted.tolist(), out.tolist(), strict=True)))
    assert base == pytest.approx(0.0015, rel=0.05) and per == pytest.approx(0.0002, rel=0.05)
    # A stalled delivery now and then leaves the slope alone and raises the line by its share of
    # the mean: the clients' mean waited for it too.
    out[::25] += 0.02
    stalled, stalled_per = fit_egress(list(zip(emitted.tolist(), out.tolist(), strict=True)))
    assert stalled_per == pytest.approx(per, rel=0.05) and stalled == pytest.approx(base + 0.02 / 25, rel=0.05)
    assert fit_egress([(4, 0.003), (4, 0.001), (4, 0.002)]) == pytest.approx((0.002, 0.0))  # no spread in load


def test_simulated_requests_can_carry_max_tokens_as_the_http_client_sends_it() -> None:
    """srpt-predicted caps a prediction at max_tokens; over HTTP the load client sends max_tokens =
    the output length, so the twin's simulator must too, or its policy ranks other jobs."""
    from tokenslice.sim.engine import simulated_engine
    from tokenslice.sim.replay import replay

    cost = load_cost_model("opt-13b@a100-40gb")
    wl = make_workload("synthetic-zipf", num_requests=20, rate=30.0, seed=3, max_len=200)
    cfg = SchedulerConfig(policy="srpt-predicted", max_batch_size=4)
    demotions, finishes = [], []
    for as_client in (False, True):
        engine = simulated_engine(cfg, cost, kv_cache_blocks=4096)
        reqs = replay(engine, wl, max_tokens_is_output=as_client)
        for w, r in zip(wl, reqs, strict=True):
            assert r.num_output_tokens == w.output_len
            assert (r.params.max_tokens == w.output_len) == as_client
        demotions.append(engine.scheduler.policy.num_demotions)
        finishes.append([r.metrics.finish_time for r in reqs])
    # Capped at the true length, a prediction is doubled less often and the jobs run in another order.
    assert demotions[1] < demotions[0] and finishes[1] != finishes[0]


def test_a_chunked_prompt_streams_out_from_its_last_chunk() -> None:
    from tokenslice.bench.client_record import ClientRecord
    from tokenslice.sim.trace_compare import admissions
    from tokenslice.engine.step_trace import StepRecord

    # "c" is prefilled in two chunks (steps 1 and 2); step 2 samples its first token with 3 others.
    steps = [StepRecord(1, 5.000, prefill=[[16, 0]], prefill_ids=["c"], decode=[9, 9], sampled=2, running=3,
                        execute_s=0.001),
             StepRecord(2, 5.002, prefill=[[8, 16]], prefill_ids=["c"], decode=[10, 10, 10], sampled=4, running=4,
                        execute_s=0.001),
             StepRecord(3, 5.004, decode=[25, 11, 11, 11], sampled=4, running=4, execute_s=0.001)]
    rec = ClientRecord(request_id="c", arrival=0.0, first_token_time=0.0075)
    (a,) = admissions([rec], 5.0, steps)
    assert a.wait_s == pytest.approx(0.0) and a.first_s == pytest.approx(0.0075)  # from the first chunk's step
    assert a.out_s == pytest.approx(0.0075 - 0.003) and a.emitted == 4  # from the step that computed the token
