"""`tokenslice simulate` and `tokenslice report` end to end, and the sweep library behind them.

Behaviour only (no wall-clock thresholds): the simulator's virtual clock makes every number here
deterministic for a given seed.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenslice.bench.metrics import METRIC_KEYS
from tokenslice.sim.simulate import (SweepSpec, ample_kv_blocks, fcfs_saturation_rps, records_from_requests,
                                       run_sweep, simulate_run)
from tokenslice.bench.datasets import DatasetCache
from tokenslice.bench.priority_patterns import PriorityPattern, PriorityUpdates
from tokenslice.bench.workloads import make_workload
from tokenslice.cli import main
from tokenslice.config import SchedulerConfig
from tokenslice.predict.cost import load_cost_model
from tokenslice.sim.engine import simulated_engine
from tokenslice.sim.replay import replay

SHARED = Path(__file__).resolve().parents[2] / "shared"
SHAREGPT = SHARED / "data" / "sharegpt_multiturn_800.json"
GPT2 = SHARED / "tokenizers" / "gpt2"
PROFILE = "opt-13b@a100-40gb"
RUN_KEYS = ("policy", "preemption", "rate", "load", "cv", "num_requests", "seed", "metrics")


@pytest.fixture(scope="module")
def cost():
    return load_cost_model(PROFILE)


@pytest.fixture(scope="module")
def cache() -> DatasetCache:
    return DatasetCache()


def check_results_file(data: dict) -> None:
    """The docs/DESIGN.md results-file keys."""
    assert data["tool"] == "simulate"
    for key in ("workload", "profile", "slo", "runs", "summary"):
        assert key in data
    assert set(data["slo"]) >= {"mean_normalized_latency", "ttft", "tpot"}
    assert set(data["summary"]) >= {"max_rate_under_slo", "fcfs_saturation_rps"}
    assert data["runs"]
    for run in data["runs"]:
        assert set(run) >= set(RUN_KEYS)
        missing = [k for k in METRIC_KEYS if k not in run["metrics"]]
        assert not missing, missing
        # The latency breakdown (FastServe Fig. 15(b)) rides along as extra metric keys.
        assert {"mean_queue_s", "mean_exec_s", "mean_swap_s"} <= set(run["metrics"])


def test_simulate_cli_synthetic_rates(tmp_path: Path, cost, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rates.json"
    rc = main(["simulate", "--profile", PROFILE, "--workload", "synthetic-zipf", "--policy", "fcfs,srpt-oracle",
               "--rates", "1,4", "--num-requests", "150", "--max-batch-size", "8", "--out", str(out), "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "srpt-oracle" in printed and "mean norm" in printed
    data = json.loads(out.read_text())
    check_results_file(data)
    assert data["profile"] == PROFILE
    # Paper protocol default SLO: 10x the profile's decode iteration time.
    assert data["slo"]["mean_normalized_latency"] == pytest.approx(10 * cost.min_iteration_seconds())
    assert set(data["summary"]["max_rate_under_slo"]) == {"fcfs", "srpt-oracle"}
    assert sorted({r["rate"] for r in data["runs"]}) == [1.0, 4.0]
    assert len(data["runs"]) == 4
    for run in data["runs"]:
        m = run["metrics"]
        assert m["num_finished"] == 150 and "per_request" not in run  # compact unless --save-requests
        # Every second of a request is queueing or execution (no swapping yet): the breakdown adds up.
        assert m["mean_queue_s"] + m["mean_exec_s"] + m["mean_swap_s"] == pytest.approx(m["mean_jct"], rel=1e-6)
        assert m["kv_peak_blocks"] <= m["kv_blocks"]


def test_simulate_cli_sharegpt_loads_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, fig = tmp_path / "loads.json", tmp_path / "sim.png"
    rc = main(["simulate", "--profile", PROFILE, "--workload", "sharegpt", "--dataset", str(SHAREGPT),
               "--tokenizer", str(GPT2), "--policy", "fcfs,skip-join-mlfq", "--loads", "0.5,0.9", "--cv", "4",
               "--seeds", "0,1", "--num-requests", "80", "--max-batch-size", "8", "--out", str(out),
               "--save-requests", "--plot", str(fig), "--quiet"])
    assert rc == 0
    data = json.loads(out.read_text())
    check_results_file(data)
    summ = data["summary"]
    sat = summ["fcfs_saturation_rps"]
    assert sat > 0
    by_seed = summ["fcfs_saturation_rps_by_seed"]
    assert set(by_seed) == {"0", "1"}
    assert set(summ["max_load_under_slo"]) == {"fcfs", "skip-join-mlfq"}
    assert len(data["runs"]) == 2 * 2 * 2
    for run in data["runs"]:
        assert run["cv"] == 4.0 and run["load"] in (0.5, 0.9) and run["seed"] in (0, 1)
        # A load is a fraction of fcfs's saturation throughput on the same seed's workload.
        assert run["rate"] == pytest.approx(run["load"] * by_seed[str(run["seed"])])
        assert len(run["per_request"]["ttft"]) == 80
    assert data["workload"]["sweep"] == "load" and data["workload"]["name"] == "sharegpt"
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()

    # `report` re-plots saved results and merges files; shared policies are told apart by file.
    other = tmp_path / "again.json"
    other.write_text(out.read_text())
    replot = tmp_path / "report.png"
    assert main(["report", str(out), str(other), "--plot", str(replot)]) == 0
    printed = capsys.readouterr().out
    assert "fcfs [loads]" in printed and "skip-join-mlfq [again]" in printed
    assert replot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_without_per_request_data(tmp_path: Path) -> None:
    """Compact files (no --save-requests) still plot: latency curve and breakdown only."""
    out = tmp_path / "r.json"
    assert main(["simulate", "--profile", PROFILE, "--workload", "synthetic-fixed", "--policy", "fcfs",
                 "--rates", "2,5", "--num-requests", "40", "--out", str(out), "--quiet"]) == 0
    png = tmp_path / "r.png"
    assert main(["report", str(out), "--plot", str(png)]) == 0
    assert png.stat().st_size > 0


def test_simulate_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["simulate", "--profile", PROFILE, "--workload", "synthetic-fixed", "--num-requests", "10", "--quiet"]
    assert main(base + ["--policy", "no-such-policy", "--rates", "1"]) == 2
    assert "no-such-policy" in capsys.readouterr().err
    # A pool smaller than one request is refused up front, not cut short silently.
    assert main(base + ["--policy", "fcfs", "--rates", "1", "--kv-cache-blocks", "4"]) == 2
    assert "--kv-cache-blocks" in capsys.readouterr().err
    assert main(base + ["--policy", "fcfs", "--rates", "0"]) == 2


def test_srpt_oracle_beats_fcfs_under_load(cost, cache: DatasetCache) -> None:
    spec = SweepSpec(workload="sharegpt", policies=["fcfs", "srpt-oracle"], loads=[0.9], cv=1.0,
                     num_requests=200, max_batch_size=8, dataset=str(SHAREGPT), tokenizer=str(GPT2))
    res = run_sweep(cost, spec, cache=cache)
    mean = {r["policy"]: r["metrics"]["mean_normalized_latency"] for r in res["runs"]}
    assert mean["srpt-oracle"] <= mean["fcfs"]
    # Same work either way: both finish every request.
    assert all(r["metrics"]["num_finished"] == 200 for r in res["runs"])


def test_saturation_and_records(cost) -> None:
    wl = make_workload("synthetic-zipf", num_requests=60, rate=None, seed=3, max_len=300)
    cfg = SchedulerConfig(policy="fcfs", max_batch_size=4)
    blocks = ample_kv_blocks(wl, 4)
    assert blocks * 16 >= sum(r.prompt_len + r.output_len for r in wl)
    records, counters = simulate_run(cost, wl, cfg, blocks)
    span = max(r.finish_time for r in records)
    assert fcfs_saturation_rps(cost, wl, cfg, blocks) == pytest.approx(60 / span)
    assert counters["kv_blocks"] == blocks and counters["num_steps"] > 0
    for rec, req in zip(records, wl, strict=True):
        assert rec.output_tokens == req.output_len and rec.finished
        assert rec.queue_s + rec.exec_s == pytest.approx(rec.e2e)


def test_records_from_engine_requests(cost) -> None:
    """records_from_requests reads the server-side counters off engine requests."""

    wl = make_workload("synthetic-fixed", num_requests=12, rate=50.0, seed=0, input_len=40, output_len=30)
    engine = simulated_engine(SchedulerConfig(policy="skip-join-mlfq", max_batch_size=2), cost, kv_cache_blocks=64)
    reqs = replay(engine, wl)
    records = records_from_requests(reqs)
    assert [r.request_id for r in records] == [w.request_id for w in wl]
    assert sum(r.preemptions for r in records) == sum(q.metrics.preemptions for q in reqs)
    for rec, req in zip(records, reqs, strict=True):
        assert rec.exec_s == req.metrics.exec_s
        assert rec.token_times == req.metrics.token_times and rec.ttft is not None


def test_sweep_spec_takes_scheduler_defaults_from_the_config() -> None:
    from tokenslice.sim.simulate import SIMULATE_MAX_BATCH_SIZE
    from tokenslice.config import CacheConfig, SchedulerConfig

    spec = SweepSpec(workload="synthetic-lognormal", policies=["fcfs"], rates=[1.0])
    assert spec.scheduler_config("mlfq", 0.5) == SchedulerConfig(policy="mlfq", slo_normalized_latency=0.5,
                                                                 max_batch_size=SIMULATE_MAX_BATCH_SIZE,
                                                                 length_predictor=None)
    assert (spec.block_size, spec.offload_dtype) == (CacheConfig.block_size, CacheConfig.offload_dtype)
    tuned = SweepSpec(workload="synthetic-lognormal", policies=["fcfs"], rates=[1.0], eviction_amortization=0.0,
                      mlfq_num_queues=4, length_predictor="/some/dir")
    cfg = tuned.scheduler_config("fcfs", 0.5)
    assert (cfg.eviction_amortization, cfg.mlfq_num_queues, cfg.length_predictor) == (0.0, 4, None)


# ---------------------------------------------------------------- priority updates (FastSwitch §4)

def _priority_engine_class():
    from tokenslice.sim.engine import SimulatedEngine

    class PriorityRecordingEngine(SimulatedEngine):
        """Records the `set_priority` calls replay makes that reach a live request; counts
        fast-forwarded windows."""

        def set_priority(self, request_id: str, priority: int) -> bool:
            live = super().set_priority(request_id, priority)
            if live:
                self.calls.append((self.num_steps, request_id, priority))
            return live

        def _fast_forward(self, plan, horizon, max_steps):
            ran = super()._fast_forward(plan, horizon, max_steps)
            if ran is not None:
                self.windows += 1
            return ran

    return PriorityRecordingEngine


def _replay_with_updates(cost, fast_forward: bool, pattern: PriorityPattern | None):
    cls = _priority_engine_class()
    engine = simulated_engine(SchedulerConfig(policy="priority", max_batch_size=4), cost, kv_cache_blocks=4096,
                              engine_class=cls)
    engine.fast_forward = fast_forward
    engine.calls, engine.windows = [], 0
    wl = make_workload("synthetic-fixed", num_requests=12, rate=1.0, seed=3, input_len=64, output_len=200)
    reqs = replay(engine, wl, priority_updates=PriorityUpdates(pattern) if pattern else None)
    return engine, reqs


@pytest.mark.parametrize("kind", ["random", "markov"])
def test_replay_applies_priority_updates_at_the_same_steps_with_fast_forward(cost, kind: str) -> None:
    pattern = PriorityPattern(kind, update_freq=1 / 16, levels=4, seed=5)
    fast, fast_reqs = _replay_with_updates(cost, True, pattern)
    slow, slow_reqs = _replay_with_updates(cost, False, pattern)
    assert fast.windows > 0 and slow.windows == 0  # fast-forward ran, and stopped at each update point
    assert fast.calls and fast.calls == slow.calls
    # Every 16 steps, while requests are live, each live request gets a level.
    assert {step for step, _, _ in fast.calls} == set(range(16, fast.num_steps, 16))
    assert fast.num_steps == slow.num_steps
    assert [r.priority for r in fast_reqs] == [r.priority for r in slow_reqs]
    for a, b in zip(records_from_requests(fast_reqs), records_from_requests(slow_reqs), strict=True):
        assert a.token_times == b.token_times
    # Without updates fast-forward windows run past update points: the cap is what stops them.
    free, _ = _replay_with_updates(cost, True, None)
    assert free.windows < fast.windows and not free.calls


def test_replay_initial_priorities_come_from_the_pattern(cost) -> None:
    pattern = PriorityPattern("markov", update_freq=1e-6, levels=3, seed=9)  # no update point is reached
    engine, reqs = _replay_with_updates(cost, True, pattern)
    assert not engine.calls
    gen = PriorityUpdates(pattern)
    assert [r.priority for r in reqs] == [gen.initial(r) for r in reqs]  # arrival order = trace order here
    assert len({r.priority for r in reqs}) > 1


def test_simulate_cli_users_fairness_on_fastswitch_profile(tmp_path: Path) -> None:
    out = tmp_path / "users.json"
    rc = main(["simulate", "--profile", "llama-8b@a10-24gb", "--workload", "synthetic-lognormal", "--policy",
               "fcfs", "--rates", "4", "--num-requests", "60", "--num-users", "3", "--out", str(out), "--quiet"])
    assert rc == 0
    data = json.loads(out.read_text())
    check_results_file(data)
    assert data["workload"]["num_users"] == 3 and data["workload"]["priority_pattern"] is None
    run = data["runs"][0]
    assert sorted(run["per_user"]) == ["user-0", "user-1", "user-2"]
    assert sum(u["num_requests"] for u in run["per_user"].values()) == 60
    m = run["metrics"]
    assert m["num_users"] == 3 and 1 / 3 <= m["jain_service"] <= 1 and 1 / 3 <= m["jain_normalized_latency"] <= 1
    assert m["max_service_gap_tokens"] >= 0


def test_simulate_cli_priority_flags_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["simulate", "--profile", PROFILE, "--workload", "synthetic-fixed", "--num-requests", "10", "--quiet",
            "--policy", "fcfs", "--rates", "1"]
    with pytest.raises(SystemExit):
        main(base + ["--priority-pattern", "zigzag"])
    assert "zigzag" in capsys.readouterr().err
    assert main(base + ["--priority-pattern", "random", "--priority-update-freq", "0"]) == 2
    assert "frequency" in capsys.readouterr().err


def test_sweep_spec_priority_pattern_follows_the_seed() -> None:
    spec = SweepSpec(workload="synthetic-fixed", policies=["fcfs"], rates=[1.0], priority_pattern="markov",
                     priority_update_freq=0.02, priority_levels=4)
    assert spec.priority(7) == PriorityPattern("markov", 0.02, 4, 7)
    assert SweepSpec(workload="synthetic-fixed", policies=["fcfs"], rates=[1.0]).priority(7) is None
    assert SweepSpec.priority_update_freq == PriorityPattern.update_freq  # one default, in PriorityPattern


def test_simulate_cli_priority_pattern_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "prio.json"
    rc = main(["simulate", "--profile", "qwen-32b@a100-80gb", "--workload", "synthetic-lognormal", "--policy",
               "priority", "--rates", "2", "--num-requests", "40", "--num-users", "2", "--priority-pattern", "markov",
               "--priority-update-freq", "0.05", "--priority-levels", "4", "--out", str(out), "--quiet"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert (data["workload"]["priority_pattern"], data["workload"]["priority_update_freq"],
            data["workload"]["priority_levels"]) == ("markov", 0.05, 4)
    assert data["runs"][0]["metrics"]["num_finished"] == 40
