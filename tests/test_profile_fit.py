"""`tokenslice profile --from-trace / --evaluate`: the cost model fitted on step traces, and the
simulator's clock that counts the engine loop's own time it found.

No timing thresholds: the synthetic trace is generated from known coefficients, the real one
is only checked to fit, evaluate and drive the simulator."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import STORIES
from tokenslice import LLM, SamplingParams
from tokenslice.bench.workloads import WorkloadRequest
from tokenslice.config import SchedulerConfig
from tokenslice.engine.engine import Engine
from tokenslice.sim.engine import simulated_engine
from tokenslice.sim.replay import replay
from tokenslice.engine.step_trace import StepRecord, load_step_trace
from tokenslice.sim.trace_fit import evaluate_steps, evaluate_trace, fit_steps, grid_measurements, traced_steps
from tokenslice.predict.cost import BatchShape, LoopShape, TransferSpec, load_cost_model
from tokenslice.predict.profile import PROFILE_FEATURES, ProfileCostModel

FORWARD = {"base": 4e-4, "prefill_tokens": 1.5e-5, "decode_seqs": 3e-5, "context_tokens": 3e-7,
           "prefill_context": 1e-8, "prefill_seqs": 2e-4, "has_prefill": 3e-4, "has_decode": 1e-4}
LOOP = {"base": 4e-5, "live": 6e-6, "sampled": 8e-6, "arrivals": 6e-5}
LINK = TransferSpec(bytes_per_s=2e9, op_overhead_s=2e-5)
BLOCK_BYTES = 16 * 1280


def synthetic_trace(n: int, seed: int) -> list[StepRecord]:
    """Steps of a made-up machine whose times follow FORWARD, LOOP and LINK, with 0.5% noise and
    every 40th step stalled 4x (a busy neighbour), as a real trace has."""
    rng = np.random.default_rng(seed)
    truth = ProfileCostModel(FORWARD, LINK, 1280, loop=LOOP)
    live, start, records = 12, 1000.0, []
    for i in range(n):
        kind = rng.integers(3)  # prefill only, decode only, mixed
        prefill = [[int(rng.integers(1, 400)), int(rng.integers(0, 300))] for _ in range(rng.integers(1, 4))] \
            if kind != 1 else []
        decode = [int(c) for c in rng.integers(2, 500, size=rng.integers(1, 16))] if kind != 0 else []
        batch = len(prefill) + len(decode)
        live = max(live, batch)
        sampled = len(decode) + int(rng.integers(0, len(prefill) + 1))
        finished = int(rng.integers(0, min(3, live)))  # never all: the engine stays busy
        arrivals = int(rng.integers(0, 4))
        swap = int(rng.integers(1, 64)) if rng.random() < 0.1 else 0
        runs = int(rng.integers(1, swap + 1)) if swap else 0
        copy_s = LINK.seconds(swap * BLOCK_BYTES, runs) if swap else 0.0
        noise = 1.0 + 0.005 * rng.standard_normal(2)
        stall = 4.0 if i % 40 == 39 else 1.0
        shape = BatchShape.from_lengths([tuple(p) for p in prefill], decode)
        step_s = truth.iteration_seconds(shape) * noise[0] * stall
        loop_s = truth.loop_seconds(LoopShape(live, sampled, arrivals)) * noise[1]
        records.append(StepRecord(i + 1, start, prefill=prefill, decode=decode, sampled=sampled, running=batch,
                                  waiting=live - batch, swap_out_blocks=swap, swap_out_runs=runs, finished=finished,
                                  step_seconds=step_s + copy_s, transfer_seconds=copy_s))
        start += step_s + copy_s + loop_s
        live = live - finished + arrivals
    return records


def test_fit_on_a_synthetic_trace_recovers_its_coefficients() -> None:
    steps = traced_steps(synthetic_trace(3000, seed=0))
    assert {s.kind for s in steps} == {"prefill", "decode", "mixed", "swap"}
    cost = fit_steps(steps, kv_bytes_per_token=1280, block_bytes=BLOCK_BYTES, transfer=TransferSpec(25e9, 1e-5),
                     match_total=False)
    for name in PROFILE_FEATURES:
        assert cost.coefficients[name] == pytest.approx(FORWARD[name], rel=0.05), name
    for name, value in LOOP.items():
        assert cost.loop[name] == pytest.approx(value, rel=0.05), name
    assert cost.transfer.bytes_per_s == pytest.approx(LINK.bytes_per_s, rel=0.05)
    assert cost.transfer.op_overhead_s == pytest.approx(LINK.op_overhead_s, rel=0.05)

    # Held out: a step is predicted within the noise, but the stalls.
    errors = evaluate_steps(cost, traced_steps(synthetic_trace(1000, seed=1)), BLOCK_BYTES)
    assert errors["all"].median < 0.02 and errors["forward"].median < 0.02
    assert errors["all"].p99 > 0.5  # the stalled steps are still there, not fitted away
    assert errors["all"].total < -0.01  # and the typical step leaves their time out
    assert set(errors) == {"all", "prefill", "decode", "mixed", "swap", "forward"}

    # Matching the total scales every term alike, so the steps add up to the traced time.
    matched = fit_steps(steps, kv_bytes_per_token=1280, block_bytes=BLOCK_BYTES, transfer=TransferSpec(25e9, 1e-5))
    scale = matched.coefficients["base"] / cost.coefficients["base"]
    assert scale > 1.01
    assert all(matched.coefficients[k] == pytest.approx(v * scale) for k, v in cost.coefficients.items())
    assert all(matched.loop[k] == pytest.approx(v * scale) for k, v in cost.loop.items())
    assert evaluate_steps(matched, steps, BLOCK_BYTES)["all"].total == pytest.approx(0.0, abs=1e-9)


def test_loop_time_counts_live_requests_and_idle_gaps_are_left_out() -> None:
    records = synthetic_trace(5, seed=2)
    records[2].running, records[2].waiting, records[2].finished = 1, 0, 1  # nothing left after step 3
    records[3].running, records[3].waiting = 2, 0
    steps = traced_steps(records)
    assert steps[2].wall_seconds is None and steps[4].wall_seconds is None  # idle after; last step
    assert steps[2].loop.arrivals == 2  # the two that arrived before step 4
    assert steps[0].loop.live == records[0].running + records[0].waiting
    assert steps[1].wall_seconds == pytest.approx(records[2].start - records[1].start)


def _steps(engine: Engine, n: int, output_len: int) -> list:
    trace = [WorkloadRequest(f"r{i}", 0.001 * i, None, 8 + i, output_len) for i in range(n)]
    return replay(engine, trace)


def test_simulator_clock_counts_the_loop_time() -> None:
    """One lone request: its finish time is the sum of its steps' forward and loop seconds, and
    the same with fast-forward off; a profile without loop terms (all older ones) is unchanged."""
    with_loop = ProfileCostModel(FORWARD, LINK, 1280, loop=LOOP)
    without = ProfileCostModel(FORWARD, LINK, 1280)
    cfg = SchedulerConfig(policy="fcfs", max_batch_size=4)
    (req,) = _steps(simulated_engine(cfg, with_loop, kv_cache_blocks=64), 1, 5)
    prefill = BatchShape.from_lengths(prefill=[(8, 0)])
    expected = with_loop.iteration_seconds(prefill) + with_loop.loop_seconds(LoopShape(1, 1, 1))
    for ctx in range(9, 13):
        expected += with_loop.iteration_seconds(BatchShape.from_lengths(decode=[ctx]))
        expected += with_loop.loop_seconds(LoopShape(1, 1, 0))
    assert req.metrics.finish_time == pytest.approx(expected, rel=1e-12)
    (plain,) = _steps(simulated_engine(cfg, without, kv_cache_blocks=64), 1, 5)
    assert plain.metrics.finish_time == pytest.approx(expected - with_loop.loop_seconds(LoopShape(1, 1, 1))
                                                      - 4 * with_loop.loop_seconds(LoopShape(1, 1, 0)), rel=1e-12)

    # Fast-forward repeats decode steps in bulk; with loop terms it stays exact.
    def finish_times(fast: bool) -> list[float]:
        eng = simulated_engine(cfg, with_loop, kv_cache_blocks=512)
        eng.fast_forward = fast
        return [r.metrics.finish_time for r in _steps(eng, 12, 40)]

    assert finish_times(True) == finish_times(False)


def test_old_profile_loads_with_no_loop_time() -> None:
    old = {"kind": "profile", "model": "stories260k", "device": "cpu-2t",
           "coefficients": {"base": 4e-4, "prefill_tokens": 1e-5, "decode_seqs": 3e-5, "context_tokens": 3e-7,
                            "prefill_context": 1e-9},
           "transfer": {"bytes_per_s": 1e9, "op_overhead_s": 1e-5}, "kv_bytes_per_token": 1280, "samples": 40,
           "r2": 0.99, "tensor_parallel": 1}
    cost = ProfileCostModel.from_dict(old)
    assert cost.loop == dict.fromkeys(cost.loop, 0.0) and not cost.has_loop_cost
    assert cost.loop_seconds(LoopShape(100, 16, 3)) == 0.0
    assert simulated_engine(SchedulerConfig(), cost, kv_cache_blocks=8).loop_cost is None
    assert ProfileCostModel.from_dict(json.loads(json.dumps(cost.to_dict()))).coefficients == cost.coefficients


def _record(path: Path, prompts: list[list[int]], max_tokens: int) -> None:
    with LLM(str(STORIES), dtype="float32", max_batch_size=8, step_trace=str(path)) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def test_fit_and_evaluate_real_traces_through_the_cli(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    fit_on, held_out, profile = tmp_path / "fit.jsonl", tmp_path / "held.jsonl", tmp_path / "profile.json"
    _record(fit_on, [rng.integers(3, 500, size=int(n)).tolist() for n in rng.integers(4, 60, size=24)], 24)
    _record(held_out, [rng.integers(3, 500, size=int(n)).tolist() for n in rng.integers(4, 60, size=16)], 16)
    cmd = [sys.executable, "-m", "tokenslice.cli", "--log-level", "WARNING", "profile", "--model", str(STORIES),
           "--dtype", "float32", "--repeats", "1", "--from-trace", str(fit_on), "-o", str(profile),
           "--evaluate", str(held_out)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr
    assert "median" in out.stdout and "decode" in out.stdout and "forward" in out.stdout
    cost = load_cost_model(str(profile))
    assert isinstance(cost, ProfileCostModel) and cost.samples == len(load_step_trace(fit_on))
    assert cost.min_iteration_seconds() > 0 and cost.has_loop_cost
    assert min(cost.loop.values()) >= 0 and min(cost.coefficients.values()) >= 0
    errors = evaluate_trace(cost, held_out)
    assert errors["all"].steps == len(load_step_trace(held_out)) - 1  # every step but the last is timed
    assert 0 <= errors["all"].median <= errors["all"].p90 <= errors["all"].p99

    # The fitted profile drives the simulator.
    sim = simulated_engine(SchedulerConfig(policy="skip-join-mlfq", max_batch_size=8), cost, kv_cache_blocks=256)
    assert sim.loop_cost is cost
    assert all(r.is_finished for r in _steps(sim, 10, 12))


def test_grid_batches_join_the_forward_fit(tmp_path: Path) -> None:
    """The grid profile's timed batches (large ones, which a short trace of small batches lacks),
    read back from its JSON, join the traced forward passes: on one machine the joint fit recovers
    its coefficients; a grid from a slower one pulls the fit half way."""
    truth = ProfileCostModel(FORWARD, LINK, 1280, loop=LOOP)
    small = [s for s in synthetic_trace(3000, seed=4) if len(s.decode) + len(s.prefill) <= 3]
    shapes = [BatchShape.from_lengths([(q, past)] * n if q else [], [c] * d)
              for q, past, n, d, c in [(0, 0, 0, d, c) for d in (1, 2, 4, 8, 16, 32) for c in (16, 128, 512)]
              + [(q, p, n, 0, 0) for q in (16, 64, 256) for p in (0, 128) for n in (1, 2, 4)]
              + [(q, 0, 1, d, 128) for q in (32, 128) for d in (4, 16)]]
    profile = tmp_path / "grid.json"
    profile.write_text(json.dumps({"kind": "profile", "coefficients": FORWARD, "measurements": [
        {**dataclasses.asdict(s), "seconds": truth.iteration_seconds(s)} for s in shapes]}))
    grid = grid_measurements(profile)
    assert [s for s, _ in grid] == shapes
    cost = fit_steps(traced_steps(small), kv_bytes_per_token=1280, block_bytes=BLOCK_BYTES, transfer=LINK,
                     match_total=False, grid=grid)
    for name in PROFILE_FEATURES:
        assert cost.coefficients[name] == pytest.approx(FORWARD[name], rel=0.05, abs=1e-12), name
    big = BatchShape.from_lengths([], [300] * 16)
    assert cost.iteration_seconds(big) == pytest.approx(truth.iteration_seconds(big), rel=0.02)
    # A grid timed twice as slow counts as much as the trace: the fit lands between the two.
    slow = fit_steps(traced_steps(small), kv_bytes_per_token=1280, block_bytes=BLOCK_BYTES, transfer=LINK,
                     match_total=False, grid=[(s, 2 * t) for s, t in grid])
    assert truth.iteration_seconds(big) < slow.iteration_seconds(big) < 2 * truth.iteration_seconds(big)
    with pytest.raises(ValueError, match="no grid measurements"):
        profile.write_text(json.dumps({"kind": "profile", "coefficients": FORWARD}))
        grid_measurements(profile)


def test_from_trace_with_grid_through_the_cli(tmp_path: Path) -> None:
    """`profile --from-trace T --with-grid G`: the grid's timed batches join the fit. A grid of
    batches larger than any traced, timed 10x what the trace alone predicts for them (relative to
    this machine's own trace, so its load does not matter), pulls the fit up there, short of the
    grid's own times."""
    rng = np.random.default_rng(1)
    trace, alone, mixed = tmp_path / "t.jsonl", tmp_path / "alone.json", tmp_path / "mixed.json"
    _record(trace, [rng.integers(3, 500, size=int(n)).tolist() for n in rng.integers(4, 40, size=12)], 12)
    base = [sys.executable, "-m", "tokenslice.cli", "--log-level", "WARNING", "profile", "--model", str(STORIES),
            "--dtype", "float32", "--repeats", "1", "--from-trace", str(trace), "--no-match-total"]

    def fit(out: Path, *extra: str) -> ProfileCostModel:
        done = subprocess.run([*base, "-o", str(out), *extra], capture_output=True, text=True, timeout=240,
                              cwd=Path(__file__).parents[1])
        assert done.returncode == 0, done.stderr
        return load_cost_model(str(out))

    traced_only = fit(alone)
    shapes = [BatchShape.from_lengths([], [128] * d) for d in (32, 48, 64)] + \
        [BatchShape.from_lengths([(q, 0)], []) for q in (512, 1024)]
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"kind": "profile", "coefficients": traced_only.coefficients, "measurements": [
        {**dataclasses.asdict(s), "seconds": 10 * traced_only.iteration_seconds(s)} for s in shapes]}))
    big = BatchShape.from_lengths([], [128] * 48)
    # The grid weighs as much as the trace under an L1 fit, so the fit lands between the two, where
    # the trace's steps put it (1.6x for this trace of stories260k).
    pulled = fit(mixed, "--with-grid", str(grid)).iteration_seconds(big)
    assert 1.25 * traced_only.iteration_seconds(big) < pulled < 10 * traced_only.iteration_seconds(big)


def test_async_scheduling_overlaps_the_loop_time_in_the_simulator() -> None:
    """With the engine's async scheduling a step takes the longer of its forward and its loop
    time, in single steps and in fast-forward alike; without loop terms nothing changes."""
    with_loop = ProfileCostModel(FORWARD, LINK, 1280, loop=LOOP)
    cfg = SchedulerConfig(policy="fcfs", max_batch_size=4)
    (req,) = _steps(simulated_engine(cfg, with_loop, kv_cache_blocks=64, async_scheduling=True), 1, 5)
    prefill = BatchShape.from_lengths(prefill=[(8, 0)])
    expected = max(with_loop.iteration_seconds(prefill), with_loop.loop_seconds(LoopShape(1, 1, 1)))
    for ctx in range(9, 13):
        expected += max(with_loop.iteration_seconds(BatchShape.from_lengths(decode=[ctx])),
                        with_loop.loop_seconds(LoopShape(1, 1, 0)))
    assert req.metrics.finish_time == pytest.approx(expected, rel=1e-12)

    def finish_times(fast: bool, overlap: bool, cost: ProfileCostModel = with_loop) -> list[float]:
        eng = simulated_engine(cfg, cost, kv_cache_blocks=512, async_scheduling=overlap)
        eng.fast_forward = fast
        return [r.metrics.finish_time for r in _steps(eng, 12, 40)]

    assert finish_times(True, True) == finish_times(False, True)
    assert max(finish_times(True, True)) < max(finish_times(True, False))
    without = ProfileCostModel(FORWARD, LINK, 1280)
    assert finish_times(True, True, without) == finish_times(True, False, without)
