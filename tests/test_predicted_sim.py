"""srpt-predicted with a real LengthPredictor (ALISE §3.1) in the simulator (SweepSpec /
simulate_run) and in the real engine (Engine.from_config predicts at arrival, learns at finish)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tokenslice.sim.simulate import SweepSpec, predict_lengths, run_sweep, simulate_run
from tokenslice.bench.datasets import DatasetCache
from tokenslice.bench.workloads import make_workload
from tokenslice.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenslice.engine.engine import Engine
from tokenslice.sim.engine import simulated_engine
from tokenslice.sim.replay import replay
from tokenslice.predict.cost import load_cost_model
from tokenslice.predict.length import LengthPredictor, PredictorConfig
from tokenslice.bench.lengthdata import load_examples
from tokenslice.predict.regressor import RegressorConfig
from tokenslice.request import SamplingParams

SHARED = Path(__file__).resolve().parents[2] / "shared"
ALPACA = SHARED / "data" / "alpaca_4500.json"
GPT2 = SHARED / "tokenizers" / "gpt2"
STORIES = SHARED / "models" / "stories260k"
COST = load_cost_model("opt-13b@a100-40gb")
SEED_RECORDS = 100  # the predictor learns from Alpaca records [0, 100) ...
HELD_OUT = (100, 160)  # ... and the workload draws from records [100, 160): disjoint


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> object:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def predictor_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real predictor (MiniLM embeddings, faiss, a small MLP) seeded from 100 Alpaca records."""
    path = tmp_path_factory.mktemp("pred") / "alpaca100"
    seed = load_examples(ALPACA, GPT2)[:SEED_RECORDS]
    cfg = PredictorConfig(regressor=RegressorConfig(hidden=64, members=1), retrain_every=10_000)
    with LengthPredictor.create(path, cfg) as p:
        p.seed([e.prompt for e in seed], [e.output_len for e in seed], tune=False)
    return path


@pytest.fixture(scope="module")
def held_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "alpaca_held_out.json"
    path.write_text(json.dumps(json.loads(ALPACA.read_text())[slice(*HELD_OUT)]))
    return path


def spec(held_out: Path, predictor_dir: Path | None, **kw: object) -> SweepSpec:
    return SweepSpec(workload="alpaca", dataset=str(held_out), tokenizer=str(GPT2), num_requests=40, seeds=[0],
                     length_predictor=None if predictor_dir is None else str(predictor_dir), **kw)


def test_sweep_requests_carry_the_predictors_answers(held_out: Path, predictor_dir: Path) -> None:
    cache = DatasetCache()
    s = spec(held_out, predictor_dir, policies=["srpt-predicted"], rates=[2.0])
    reqs = s.make(0, 2.0, cache)
    assert all(r.prompt is not None and r.predicted_output_tokens is not None for r in reqs)
    with LengthPredictor.load(predictor_dir, background_training=False) as p:
        want = [max(1, round(x)) for x in p.predict([r.prompt for r in reqs])]
    assert [r.predicted_output_tokens for r in reqs] == want
    # Predictions, not the truth: some differ from the real output lengths.
    assert any(r.predicted_output_tokens != r.output_len for r in reqs)
    # Without the predictor the same workload has none; the arrivals and lengths are unchanged.
    plain = spec(held_out, None, policies=["srpt-predicted"], rates=[2.0]).make(0, 2.0, cache)
    assert all(r.predicted_output_tokens is None for r in plain)
    assert [(r.arrival_time, r.output_len) for r in plain] == [(r.arrival_time, r.output_len) for r in reqs]
    # Requests without text keep None; a prediction already given is kept.
    synth = make_workload("synthetic-fixed", num_requests=3, rate=1.0, seed=0)
    assert all(r.predicted_output_tokens is None for r in predict_lengths(synth, predictor_dir))
    given = [reqs[0].__class__(**{**reqs[0].__dict__, "predicted_output_tokens": 7})]
    assert predict_lengths(given, predictor_dir)[0].predicted_output_tokens == 7


def test_srpt_predicted_runs_to_completion_on_predictions(held_out: Path, predictor_dir: Path) -> None:
    s = spec(held_out, predictor_dir, policies=["fcfs", "srpt-predicted", "srpt-oracle"], rates=[3.0])
    res = run_sweep(COST, s, cache=DatasetCache())
    assert res["workload"]["length_predictor"] == str(predictor_dir)
    runs = {r["policy"]: r for r in res["runs"]}
    assert set(runs) == {"fcfs", "srpt-predicted", "srpt-oracle"}
    for r in runs.values():
        assert r["num_requests"] == 40 and r["metrics"]["mean_normalized_latency"] > 0
    # The predictions reach the policy: the simulator's requests carry them, and every one finishes.
    wl = s.make(0, 3.0, DatasetCache())
    eng = simulated_engine(s.scheduler_config("srpt-predicted", 0.2), COST, kv_cache_blocks=10_000)
    done = replay(eng, wl)
    assert [r.predicted_output_tokens for r in done] == [w.predicted_output_tokens for w in wl]
    assert all(r.is_finished and r.num_output_tokens == w.output_len for r, w in zip(done, wl, strict=True))
    # simulate_run predicts too when given the directory (the items came without predictions).
    bare = spec(held_out, None, policies=["srpt-predicted"], rates=[3.0]).make(0, 3.0, DatasetCache())
    records, _ = simulate_run(COST, bare, s.scheduler_config("srpt-predicted", 0.2), 10_000,
                              length_predictor=str(predictor_dir))
    assert len(records) == 40 and all(r.ok for r in records)
    assert [r.finish_time for r in records] == [r.finish_time for r in records_of(done)]


def records_of(reqs: list) -> list:
    from tokenslice.sim.simulate import records_from_requests

    return records_from_requests(reqs)


def test_spec_refuses_a_missing_predictor(held_out: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no length predictor"):
        spec(held_out, tmp_path / "none", policies=["srpt-predicted"], rates=[1.0]).validate()


def test_engine_predicts_at_arrival_and_learns_at_finish(predictor_dir: Path, tmp_path: Path) -> None:
    path = shutil.copytree(predictor_dir, tmp_path / "pred")  # the engine writes to its history
    cfg = EngineConfig(model=ModelConfig(model=str(STORIES), dtype="float32"), cache=CacheConfig(kv_cache_blocks=64),
                       scheduler=SchedulerConfig(policy="srpt-predicted", max_batch_size=4,
                                                 length_predictor=str(path)))
    engine = Engine.from_config(cfg)
    try:
        pred = engine.lengths.predictor if engine.lengths is not None else None
        assert pred is not None and pred.num_records == SEED_RECORDS
        prompts = ["Once upon a time there was a little dog.", "Lily liked to play in the park with her ball.",
                   "Tom saw a big red bird."]
        want = [max(1, round(x)) for x in pred.predict(prompts)]
        reqs = [engine.add_request(p, SamplingParams(max_tokens=6, temperature=0.0)) for p in prompts]
        assert [r.predicted_output_tokens for r in reqs] == want  # at arrival, before any step
        policy = engine.scheduler.policy
        assert [policy.predicted[r.request_id] for r in reqs] == [min(w, 6) for w in want]
        while engine.has_unfinished():
            engine.step()
        assert all(r.is_finished for r in reqs)
        # Every finished request enters the history (censored when cut off by max_tokens).
        assert pred.num_records == SEED_RECORDS + len(prompts)
    finally:
        engine.close()
    with LengthPredictor.load(path, background_training=False) as p:
        assert p.num_records == SEED_RECORDS + len(prompts)
