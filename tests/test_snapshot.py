"""The scheduler's live view (sched/snapshot.py) and `tokenslice simulate --record-state`.

A small memory-bound simulation with preemptions: every snapshot is plain JSON, shows the states a
preempting scheduler passes through, carries no text or token ids, and recording it changes no
result (the recorder only reads)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tokenslice.bench.record_state import StateRecorder
from tokenslice.sim.simulate import simulate_run
from tokenslice.bench.workloads import make_workload
from tokenslice.cli import main
from tokenslice.config import SchedulerConfig
from tokenslice.predict.cost import load_cost_model
from tokenslice.sched.registry import POLICY_NAMES
from tokenslice.sched.snapshot import REQUEST_STATES

PROFILE = "opt-13b@a100-40gb"
SHARED = Path(__file__).resolve().parents[2] / "shared"
REQUEST_KEYS = {"id", "user", "tenant", "state", "exec_s", "prompt_tokens", "output_tokens", "computed_tokens",
                "predicted_output_tokens", "priority", "preemptions", "swaps", "slack_s", "protected", "stall_s"}


def workload() -> list[Any]:
    # Long outputs at a high rate into a 40-block pool: the batch outgrows memory and preempts.
    return make_workload("synthetic-fixed", num_requests=24, rate=40.0, seed=1, input_len=64, output_len=120,
                         num_users=3)


def record(tmp_path: Path, policy: str, preemption: str, interval_s: float = 1e-9
           ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    cost = load_cost_model(PROFILE)
    path = tmp_path / f"{policy}-{preemption}.jsonl"
    cfg = SchedulerConfig(policy=policy, preemption=preemption, max_batch_size=8)
    with StateRecorder(path, interval_s) as rec:
        rec.start_run(policy=policy, seed=1)
        _, counters = simulate_run(cost, workload(), cfg, 40, state_recorder=rec)
    return [json.loads(line) for line in path.read_text().splitlines()], counters


def walk(value: Any) -> Any:
    """Every key and leaf of a JSON value."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from walk(v)
    elif isinstance(value, list):
        for v in value:
            yield from walk(v)
    else:
        yield value


@pytest.mark.parametrize("preemption", ["proactive-swap", "recompute"])
def test_snapshots_of_a_preempting_run(tmp_path: Path, preemption: str) -> None:
    snaps, _ = record(tmp_path, "skip-join-mlfq", preemption)
    assert len(snaps) > 10
    times = [s["t"] for s in snaps]
    assert times == sorted(times)
    seen = {r["state"] for s in snaps for r in s["requests"]}
    assert seen <= set(REQUEST_STATES)
    assert {"waiting", "running"} <= seen
    assert "on host" in seen if preemption == "proactive-swap" else ("to recompute" in seen and "on host" not in seen)
    assert any(r["preemptions"] > 0 for s in snaps for r in s["requests"])
    for s in snaps:
        assert s["run"] == {"policy": "skip-join-mlfq", "seed": 1}
        assert s["policy"] == "skip-join-mlfq" and s["preemption"] == preemption
        kv = s["kv"]
        assert kv["device"]["blocks"] == 40 and kv["device"]["used"] + kv["device"]["free"] == 40
        assert kv["host"]["used"] + kv["host"]["free"] == kv["host"]["blocks"]
        assert kv["reserved_blocks"] >= 0 and kv["transfers_in_flight"] >= 0
        live = {r["id"] for r in s["requests"]}
        assert all(set(r) == REQUEST_KEYS for r in s["requests"])
        queued = [q["id"] for level in s["queues"]["queues"] for q in level["requests"]]
        assert sorted(queued) == sorted(live)  # every live request sits in exactly one MLFQ queue
        assert all(level["quantum_s"] > 0 for level in s["queues"]["queues"])
    # FastServe §4.2's burst reserve exists only under proactive-swap.
    assert (max(s["kv"]["reserved_blocks"] for s in snaps) > 0) == (preemption == "proactive-swap")


def test_snapshots_hold_no_text_or_token_ids(tmp_path: Path) -> None:
    """Only counts, ids and numbers: no list of ints (token ids) and no prompt text anywhere."""
    snaps, _ = record(tmp_path, "vtc", "proactive-swap")
    for s in snaps:
        for leaf in walk(s):
            assert not isinstance(leaf, str) or len(leaf) < 40
        for r in s["requests"]:
            assert all(not isinstance(v, list) for v in r.values())
        for key in ("token_ids", "prompt", "output", "text"):
            assert key not in set(walk(s))
    users = {u["user"] for s in snaps for u in s["queues"]["users"]}
    assert users == {"user-0", "user-1", "user-2"}


def test_recording_changes_no_result(tmp_path: Path) -> None:
    cost = load_cost_model(PROFILE)
    cfg = SchedulerConfig(policy="srpt-predicted", preemption="proactive-swap", max_batch_size=8)
    plain, plain_counters = simulate_run(cost, workload(), cfg, 40)
    _, recorded_counters = record(tmp_path, "srpt-predicted", "proactive-swap")
    recorded, _ = simulate_run(cost, workload(), cfg, 40)
    assert plain_counters == recorded_counters
    assert [r.token_times for r in plain] == [r.token_times for r in recorded]


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_describes_its_queues(tmp_path: Path, policy: str) -> None:
    snaps, _ = record(tmp_path, policy, "recompute", interval_s=0.5)
    assert snaps
    for s in snaps:
        queues = s["queues"]
        assert isinstance(queues["kind"], str)
        json.dumps(queues)
    assert any(s["requests"] for s in snaps)


def test_interval_bounds_the_snapshots(tmp_path: Path) -> None:
    every, _ = record(tmp_path, "fcfs", "recompute")
    sparse, _ = record(tmp_path, "fcfs", "recompute", interval_s=0.5)
    assert len(sparse) < len(every)
    gaps = [b["t"] - a["t"] for a, b in zip(sparse, sparse[1:])]
    assert all(g >= 0.5 for g in gaps)
    assert sparse[0]["queues"]["kind"] == "fifo"
    with pytest.raises(ValueError, match="interval"):
        StateRecorder(tmp_path / "x.jsonl", 0.0)


def test_simulate_cli_record_state(tmp_path: Path) -> None:
    out = tmp_path / "state.jsonl"
    assert main(["simulate", "--profile", PROFILE, "--workload", "sharegpt",
                 "--dataset", str(SHARED / "data" / "sharegpt_multiturn_800.json"),
                 "--tokenizer", str(SHARED / "tokenizers" / "gpt2"), "--length-filter",
                 "--policy", "fcfs,skip-join-mlfq", "--preemption", "proactive-swap", "--rates", "4",
                 "--num-requests", "60", "--kv-cache-blocks", "200", "--record-state", str(out),
                 "--record-state-interval-s", "2", "--quiet"]) == 0
    snaps = [json.loads(line) for line in out.read_text().splitlines()]
    assert {s["run"]["policy"] for s in snaps} == {"fcfs", "skip-join-mlfq"}
    assert all(s["run"]["rate"] == 4.0 and s["run"]["seed"] == 0 for s in snaps)
    for policy in ("fcfs", "skip-join-mlfq"):
        times = [s["t"] for s in snaps if s["run"]["policy"] == policy]
        assert all(b - a >= 2 for a, b in zip(times, times[1:]))
    # Real dataset prompts: still no text in any snapshot.
    text = out.read_text()
    assert "token_ids" not in text and "conversations" not in text
