"""Latency statistics, SLO accounting, max rate under SLO and the results file (tokenslice/bench/metrics.py)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenslice.bench.metrics import (METRIC_KEYS, SLO, RequestRecord, fairness_metrics, goodput, jain_index,
                                      makespan, max_rate_detail, max_rate_under_slo, max_service_gap, meets_slo,
                                      percentile, results_file, run_entry, slo_attainment, summarize, sweep_summary,
                                      user_summary)


def rec(rid: str, arrival: float, times: list[float], **kw: object) -> RequestRecord:
    return RequestRecord.from_token_times(rid, arrival, times, **kw)


def test_per_request_definitions() -> None:
    r = rec("a", 1.0, [1.5, 1.7, 2.0, 2.5], prompt_tokens=10)
    assert r.output_tokens == 4 and r.finish_time == 2.5
    assert r.e2e == pytest.approx(1.5)
    assert r.normalized_latency == pytest.approx(1.5 / 4)
    assert r.ttft == pytest.approx(0.5)
    assert r.tbt == pytest.approx([0.2, 0.3, 0.5])
    assert r.tpot == pytest.approx((1.5 - 0.5) / 3)
    one = rec("b", 0.0, [0.4])
    assert one.tpot is None and one.tbt == [] and one.normalized_latency == pytest.approx(0.4)
    # Finish after the last token (e.g. the [DONE] event) is the e2e end.
    late = rec("c", 0.0, [1.0, 2.0], finish_time=2.5)
    assert late.e2e == 2.5 and late.tpot == pytest.approx(1.5)
    failed = RequestRecord("d", 0.0, ok=False, error="timeout", finish_time=3.0)
    assert failed.e2e is None and failed.ttft is None and failed.normalized_latency is None


def test_percentile_nearest_rank_examples() -> None:
    vals = list(range(1, 101))  # 1..100
    assert percentile(vals, 50) == 50
    assert percentile(vals, 95) == 95
    assert percentile(vals, 99) == 99
    assert percentile(vals, 99.9) == 100
    assert percentile(vals, 100) == 100
    assert percentile(vals, 0) == 1
    assert percentile(range(1000), 99.9) == 998  # rank 999 exactly, despite float rounding
    assert percentile([15, 20, 35, 40, 50], 30) == 20  # textbook example
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1], 101)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=300), st.floats(0, 100))
def test_percentile_properties(values: list[float], q: float) -> None:
    p = percentile(values, q)
    assert p in values  # nearest rank never interpolates
    n = len(values)
    # At least q% of values are <= p, and fewer than q% are strictly below it.
    assert sum(v <= p for v in values) >= q / 100 * n - 1e-9
    assert sum(v < p for v in values) < max(q / 100 * n, 1) + 1e-9
    assert percentile(values, 0) == min(values) and percentile(values, 100) == max(values)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0, 1e3, allow_nan=False), min_size=1, max_size=100), st.floats(0, 100), st.floats(0, 100))
def test_percentile_is_monotone_in_q(values: list[float], q1: float, q2: float) -> None:
    lo, hi = sorted((q1, q2))
    assert percentile(values, lo) <= percentile(values, hi)


def test_summarize_keys_and_values() -> None:
    records = [rec("a", 0.0, [1.0, 2.0, 3.0], prompt_tokens=5, preemptions=1, swap_out_bytes=100, swap_ops=2,
                   queue_s=0.5, exec_s=2.5),
               rec("b", 1.0, [1.5, 2.0], prompt_tokens=7, recomputed_tokens=30, swap_stall_s=0.01, queue_s=0.1,
                   exec_s=0.9),
               RequestRecord("c", 2.0, ok=False, error="HTTP 500", finish_time=2.1)]
    s = summarize(records)
    assert set(METRIC_KEYS) <= set(s)
    assert s["num_requests"] == 3 and s["num_finished"] == 2 and s["num_failed"] == 1
    assert s["mean_normalized_latency"] == pytest.approx((3.0 / 3 + 1.0 / 2) / 2)
    assert s["mean_ttft"] == pytest.approx((1.0 + 0.5) / 2)
    assert s["p99_ttft"] == 1.0 and s["p999_ttft"] == 1.0
    assert s["mean_tbt"] == pytest.approx((1.0 + 1.0 + 0.5) / 3)  # every gap, pooled
    assert s["p999_tbt"] == 1.0
    assert s["mean_jct"] == pytest.approx((3.0 + 1.0) / 2) and s["p95_jct"] == 3.0
    assert s["makespan_s"] == pytest.approx(3.0)
    assert s["throughput_rps"] == pytest.approx(2 / 3.0)
    assert s["throughput_tok_s"] == pytest.approx(5 / 3.0)
    assert (s["preemptions"], s["recomputed_tokens"], s["swap_out_bytes"], s["swap_ops"]) == (1, 30, 100, 2)
    assert s["swap_stall_s"] == pytest.approx(0.01)
    assert s["queue_s"] == pytest.approx(0.2) and s["exec_s"] == pytest.approx(3.4 / 3)
    assert "slo_attainment" not in s
    json.dumps(s, allow_nan=False)  # valid JSON: no NaN anywhere


def test_summarize_empty_and_all_failed_is_json_clean() -> None:
    for records in ([], [RequestRecord("x", 0.0, ok=False)]):
        s = summarize(records, slo=0.5)
        assert set(METRIC_KEYS) <= set(s)
        assert s["mean_normalized_latency"] is None and s["throughput_rps"] == 0.0
        json.dumps(s, allow_nan=False)
    assert summarize([RequestRecord("x", 0.0, ok=False)], slo=0.5)["slo_attainment"] == 0.0


def test_counters_override() -> None:
    s = summarize([rec("a", 0.0, [1.0], swap_in_bytes=5)], counters={"swap_in_bytes": 4096, "swap_stall_s": 0.3})
    assert s["swap_in_bytes"] == 4096 and s["swap_stall_s"] == 0.3


def test_slo_attainment_counts_failures_in_denominator() -> None:
    slo = SLO(mean_normalized_latency=0.6, ttft=1.0)
    good = rec("a", 0.0, [0.5, 1.0])  # normalized 0.5, ttft 0.5
    slow_ttft = rec("b", 0.0, [1.5, 1.6, 1.7, 1.8])  # normalized 0.45 but ttft 1.5
    slow = rec("c", 0.0, [0.2, 2.0])  # normalized 1.0
    failed = RequestRecord("d", 0.0, ok=False, finish_time=0.1)
    records = [good, slow_ttft, slow, failed]
    assert [meets_slo(r, slo) for r in records] == [True, False, False, False]
    assert slo_attainment(records, slo) == 0.25
    assert makespan(records) == 2.0
    assert goodput(records, slo) == pytest.approx(1 / 2.0)
    s = summarize(records, slo=slo)
    assert s["slo_attainment"] == 0.25 and s["goodput_rps"] == pytest.approx(0.5)
    # TPOT bound; a one-token answer has no TPOT and cannot violate it.
    assert meets_slo(rec("e", 0.0, [0.1]), SLO(tpot=0.001))
    assert not meets_slo(rec("f", 0.0, [0.1, 0.3]), SLO(tpot=0.1))
    assert SLO.from_any(0.3) == SLO(mean_normalized_latency=0.3)
    assert SLO.from_any({"ttft": 2.0, "tpot": None}) == SLO(ttft=2.0)


def test_max_rate_interpolates_between_last_pass_and_first_fail() -> None:
    rates = [1.0, 2.0, 3.0, 4.0]
    vals = [0.1, 0.2, 0.4, 0.8]
    assert max_rate_under_slo(rates, vals, 0.3) == pytest.approx(2.5)
    assert max_rate_under_slo(rates, vals, 0.2) == pytest.approx(2.0)  # exactly at the SLO counts as within
    assert max_rate_under_slo(list(reversed(rates)), list(reversed(vals)), 0.6) == pytest.approx(3.5)
    # Only the first crossing matters, even if a later point dips back under.
    assert max_rate_under_slo(rates, [0.1, 0.5, 0.2, 0.1], 0.3) == pytest.approx(1.5)
    d = max_rate_detail(rates, vals, 0.05)
    assert d.rate == 0.0 and d.infeasible
    d = max_rate_detail(rates, vals, 10.0)
    assert d.rate == 4.0 and d.censored and not d.infeasible
    # A run where nothing finished (metric None) is past the SLO; no interpolation toward it.
    assert max_rate_under_slo(rates, [0.1, 0.2, None, None], 0.3) == 2.0
    assert max_rate_under_slo([1.0, 2.0], [0.1, math.nan], 0.3) == 1.0
    with pytest.raises(ValueError):
        max_rate_under_slo([1.0], [0.1, 0.2], 0.3)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0.1, 100), st.floats(0, 10)), min_size=1, max_size=12,
                unique_by=lambda p: p[0]),
       st.floats(0.01, 10))
def test_max_rate_properties(points: list[tuple[float, float]], slo: float) -> None:
    rates = [p[0] for p in points]
    vals = [p[1] for p in points]
    d = max_rate_detail(rates, vals, slo)
    srt = sorted(points)
    if d.infeasible:
        assert d.rate == 0.0 and srt[0][1] > slo
        return
    # Never below a rate known to pass before the first failure, never at or past the first failing rate.
    first_fail = next((r for r, v in srt if v > slo), None)
    passing = [r for r, v in srt if v <= slo and (first_fail is None or r < first_fail)]
    assert d.rate >= max(passing) - 1e-9
    if first_fail is None:
        assert d.censored and d.rate == max(rates)
    else:
        assert d.rate <= first_fail + 1e-9


def test_results_file_round_trip_and_validation() -> None:
    records = [rec(str(i), i * 0.5, [i * 0.5 + 0.1 * k for k in range(1, 6)]) for i in range(20)]
    metrics = summarize(records, slo=0.3)
    runs = [run_entry("fcfs", "recompute", r, {**metrics, "mean_normalized_latency": v}, load=None, cv=1.0,
                      num_requests=20, seed=0) for r, v in [(1.0, 0.1), (2.0, 0.5)]]
    runs += [run_entry("skip-join-mlfq", "proactive-swap", r, {**metrics, "mean_normalized_latency": v}, cv=1.0,
                       num_requests=20, seed=0) for r, v in [(1.0, 0.1), (2.0, 0.2)]]
    summary = sweep_summary(runs, SLO(mean_normalized_latency=0.3), fcfs_saturation_rps=2.2)
    assert summary["max_rate_under_slo"] == {"fcfs": pytest.approx(1.5), "skip-join-mlfq": 2.0}
    assert summary["max_rate_censored"] == ["skip-join-mlfq"]
    out = results_file("simulate", {"name": "alpaca", "num_requests": 20}, "opt-13b@a100-40gb",
                       SLO(mean_normalized_latency=0.3), runs, summary)
    text = json.dumps(out, allow_nan=False)
    back = json.loads(text)
    assert set(back) == {"tool", "workload", "profile", "slo", "runs", "summary"}
    assert back["slo"] == {"mean_normalized_latency": 0.3, "ttft": None, "tpot": None}
    assert {"policy", "preemption", "rate", "load", "cv", "num_requests", "seed", "metrics"} <= set(back["runs"][0])
    assert set(METRIC_KEYS) <= set(back["runs"][0]["metrics"])
    assert back["summary"]["fcfs_saturation_rps"] == 2.2
    with pytest.raises(ValueError, match="tool"):
        results_file("serve", {}, "p", None, runs, summary)
    with pytest.raises(ValueError, match="mean_ttft"):
        results_file("bench", {}, "p", None, [{"policy": "fcfs", "metrics": {"mean_normalized_latency": 1.0}}], {})
    with pytest.raises(ValueError, match="missing"):
        run_entry("fcfs", None, 1.0, {})


def test_sweep_summary_splits_policies_run_with_several_preemption_modes() -> None:
    m = {k: 0.0 for k in METRIC_KEYS}
    runs = [run_entry("fcfs", mode, 1.0, {**m, "mean_normalized_latency": 0.1}) for mode in ("recompute", "defer")]
    assert set(sweep_summary(runs, 0.3)["max_rate_under_slo"]) == {"fcfs/recompute", "fcfs/defer"}
    # Another metric against a bare-number bound.
    runs = [run_entry("fcfs", "recompute", r, {**m, "p99_ttft": v}) for r, v in [(1.0, 1.0), (3.0, 3.0)]]
    assert sweep_summary(runs, 2.0, metric="p99_ttft")["max_rate_under_slo"]["fcfs"] == pytest.approx(2.0)


def test_metrics_match_numpy_on_random_runs() -> None:
    rng = np.random.default_rng(0)
    records = []
    for i in range(500):
        arrival = float(i) * 0.1
        gaps = rng.exponential(0.05, size=int(rng.integers(1, 40)))
        records.append(rec(str(i), arrival, list(arrival + 0.2 + np.cumsum(gaps))))
    s = summarize(records)
    norm = np.array([r.normalized_latency for r in records])
    assert s["mean_normalized_latency"] == pytest.approx(norm.mean())
    # numpy's "inverted_cdf" method is the nearest-rank definition.
    assert s["p95_normalized_latency"] == pytest.approx(np.percentile(norm, 95, method="inverted_cdf"))
    tbt = np.concatenate([np.diff(r.token_times) for r in records])
    assert s["p999_tbt"] == pytest.approx(np.percentile(tbt, 99.9, method="inverted_cdf"))


# ---------------------------------------------------------------- fairness across users

def _rec(rid: str, user: str, arrival: float, times: list[float], prompt: int) -> RequestRecord:
    return RequestRecord.from_token_times(rid, arrival, times, prompt_tokens=prompt, user=user)


def test_jain_index_hand_values() -> None:
    assert jain_index([3.0, 3.0, 3.0]) == 1.0
    assert jain_index([4.0, 0.0]) == 0.5  # 16 / (2 * 16): one user has everything
    assert jain_index([1.0, 2.0]) == pytest.approx(0.9)  # 9 / (2 * 5)
    assert jain_index([0.0, 0.0]) == 1.0
    assert jain_index([]) is None


def test_user_service_latency_and_gap_hand_computed() -> None:
    # a: prompt 2, tokens at 1, 2, 3; b: prompt 2, tokens at 4, 5, 6; both arrive at 0.
    recs = [_rec("a", "u-a", 0.0, [1.0, 2.0, 3.0], 2), _rec("b", "u-b", 0.0, [4.0, 5.0, 6.0], 2)]
    users = user_summary(recs)
    assert users["u-a"] == {"num_requests": 1, "num_finished": 1, "service_tokens": 5.0,
                            "mean_normalized_latency": 1.0, "mean_ttft": 1.0, "mean_jct": 3.0}
    assert users["u-b"]["service_tokens"] == 5.0 and users["u-b"]["mean_normalized_latency"] == 2.0
    # Both backlogged on [0, 3]: a got 2 + 1 at t=1, then 1 at t=2 and t=3; b nothing.
    assert max_service_gap(recs) == 5.0
    m = summarize(recs)
    assert m["num_users"] == 2
    assert m["jain_service"] == 1.0
    assert m["jain_normalized_latency"] == pytest.approx(0.9)
    assert m["max_service_gap_tokens"] == 5.0


def test_service_gap_counts_only_while_both_are_backlogged() -> None:
    # u-a is served on [0, 2] alone, then on [10, 13]; u-b waits on [5, 12.5]. Only [10, 12.5]
    # counts: a's cumulative service minus b's there is 2, 3, 2, 3, 2 (t = 10, 11, 11.5, 12, 12.5).
    recs = [_rec("a1", "u-a", 0.0, [1.0, 2.0], 0), _rec("a2", "u-a", 10.0, [11.0, 12.0, 13.0], 0),
            _rec("b", "u-b", 5.0, [11.5, 12.5], 0)]
    assert max_service_gap(recs) == 1.0
    assert user_summary(recs)["u-a"]["num_requests"] == 2
    # Never backlogged together: no gap.
    apart = [_rec("a", "u-a", 0.0, [1.0], 0), _rec("b", "u-b", 2.0, [3.0], 0)]
    assert max_service_gap(apart) == 0.0


def test_fairness_keys_only_with_users() -> None:
    recs = [RequestRecord.from_token_times("x", 0.0, [1.0, 2.0])]
    assert fairness_metrics(recs) == {}
    assert "jain_service" not in summarize(recs)
    assert max_service_gap([_rec("a", "u-a", 0.0, [1.0], 0)]) is None
