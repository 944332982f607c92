"""Output-length predictor quality and latency (ALISE §3.1) on held-out prompts, against three
baselines: the training mean, a linear regression on prompt length, and the MLP alone.

Runs (output lengths in GPT-2 tokens, i.e. OPT's):
- alpaca: seeded from a fixed 4,000 of alpaca_4500.json, evaluated on the other 500;
- sharegpt: the first human->gpt pair of each of the 793 conversations, 593 seed / 200 test
  (a seeded split by conversation);
- sharegpt-allturns: the same 200 test conversations, seeded with every human->gpt pair of the
  593 training conversations (2,000+ pairs: later turns are extra training data, never test data).

k, the similarity threshold and the kNN weight are tuned by 3-fold cross-validation on the seed
data inside `LengthPredictor.seed` (never on the test split). Each predictor is then reloaded from
disk with the embedding cache off and scored by `tokenslice.bench.length_eval`; the timed part holds
/tmp/tokenslice-bench.lock, so it does not overlap other sessions' timing runs. ShareGPT's 200
test prompts give a Spearman standard error of ~0.07, so `--extra-seeds` repeats the ShareGPT
runs on other splits (quality only) to show the spread.

    .venv/bin/python benchmarks/predictor/predictor_quality.py   # all runs, into benchmarks/predictor/results/
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from tokenslice.predict.blend import spearman
from tokenslice.predict.embed import SentenceEmbedder
from tokenslice.bench.length_eval import evaluate, fit_prompt_length, format_table
from tokenslice.predict.length import LengthPredictor
from tokenslice.bench.lengthdata import LengthExample, load_examples, split_examples

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
RUNS = {  # name: (dataset file, seed turns, test size)
    "alpaca": ("alpaca_4500.json", "first", 500),
    "sharegpt": ("sharegpt_multiturn_800.json", "first", 200),
    "sharegpt-allturns": ("sharegpt_multiturn_800.json", "all", 200),
}
TARGETS = {"alpaca": 0.70, "sharegpt": 0.30, "sharegpt-allturns": 0.30}
MIN_GAIN_OVER_PROMPT_LENGTH = 0.15


@contextlib.contextmanager
def bench_lock(path: str | None) -> Iterator[None]:
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def niceness(value: int) -> Iterator[None]:
    """Run the untimed, CPU-heavy part (embedding the seed, training) at low priority, so it does
    not disturb other sessions' timing runs; back to normal priority for the timed part (lowering
    niceness again needs root, which this box's sessions are; otherwise it stays low)."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, value)
    try:
        yield
    finally:
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, 0, before)


def split_for(name: str, seed: int) -> tuple[list[LengthExample], list[LengthExample]]:
    file, turns, test_size = RUNS[name]
    path, tok = SHARED / "data" / file, SHARED / "tokenizers" / "gpt2"
    train = split_examples(load_examples(path, tok, turns=turns), test_size, seed).train
    # The test side always comes from first pairs, so every ShareGPT run scores the same prompts.
    test = split_examples(load_examples(path, tok, turns="first"), test_size, seed).test
    assert not {e.group for e in train} & {e.group for e in test}
    return train, test


def build(dir_: Path, train: list[LengthExample], embedder: SentenceEmbedder) -> float:
    start = time.perf_counter()
    with LengthPredictor.create(dir_, embedder=embedder) as p:
        p.seed([e.prompt for e in train], [e.output_len for e in train], groups=[e.group for e in train])
    return time.perf_counter() - start


def check_targets(name: str, result: dict) -> dict:
    gain = (result["spearman"] or 0) - (result["baselines"]["prompt_length"]["spearman"] or 0)
    return {"spearman_target": TARGETS[name], "spearman_met": (result["spearman"] or 0) >= TARGETS[name],
            "gain_over_prompt_length": gain, "gain_met": gain >= MIN_GAIN_OVER_PROMPT_LENGTH,
            "median_latency_target_ms": 10.0, "median_latency_met": result["median_latency_ms"] <= 10.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of " + ", ".join(RUNS))
    ap.add_argument("--split-seed", type=int, default=0)
    ap.add_argument("--extra-seeds", default="1,2,3,4", help="more ShareGPT splits, quality only ('' for none)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (see BENCHMARKS.md)")
    ap.add_argument("--lock", default="/tmp/tokenslice-bench.lock", help="flock held while timing ('' for none)")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "predictor" / "results"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    embedder = SentenceEmbedder(cache_size=20000)  # builds share embeddings; timing uses a cold one
    cold = SentenceEmbedder(cache_size=0)
    extra = [int(s) for s in a.extra_seeds.split(",") if s.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        for name in [r.strip() for r in a.runs.split(",") if r.strip()]:
            train, test = split_for(name, a.split_seed)
            print(f"== {name}: {len(train)} seed records, {len(test)} test prompts", flush=True)
            with niceness(19):
                secs = build(Path(tmp) / name, train, embedder)
            with bench_lock(a.lock), LengthPredictor.load(Path(tmp) / name, embedder=cold,
                                                           background_training=False) as p:
                load_before = os.getloadavg()[0]
                result = evaluate(p, [e.prompt for e in test], [e.output_len for e in test])
                result["load_average_1min"] = [load_before, os.getloadavg()[0]]  # others' jobs share the cores
            print(format_table(result), flush=True)
            record = {"benchmark": "predictor_quality", "run": name, "date": "2026-11-22",
                      "machine": f"{platform.machine()}, 2 shared CPU cores, torch {torch.__version__}, "
                                 f"{a.threads} thread(s), embedder in {str(cold.dtype).removeprefix('torch.')}",
                      "dataset": RUNS[name][0], "seed_turns": RUNS[name][1], "split_seed": a.split_seed,
                      "train_size": len(train), "test_size": len(test), "build_seconds": secs,
                      "command": "python benchmarks/predictor/predictor_quality.py " + " ".join(sys.argv[1:]),
                      "targets": check_targets(name, result), **result}
            if name.startswith("sharegpt") and extra:
                with niceness(19):
                    record["other_splits"] = other_splits(name, extra, embedder, Path(tmp))
                sp = [r["spearman"] for r in record["other_splits"]]
                print(f"   other splits {extra}: spearman {np.round(sp, 3).tolist()}", flush=True)
            out = Path(a.out_dir) / f"predictor_{name.replace('-', '_')}.json"
            out.write_text(json.dumps(record, indent=1) + "\n")
            print(f"wrote {out}", flush=True)
    return 0


def other_splits(name: str, seeds: list[int], embedder: SentenceEmbedder, tmp: Path) -> list[dict]:
    """Spearman of the predictor and of the prompt-length baseline on other seeded splits."""
    rows = []
    for seed in seeds:
        train, test = split_for(name, seed)
        dir_ = tmp / f"{name}-seed{seed}"
        build(dir_, train, embedder)
        with LengthPredictor.load(dir_, embedder=embedder, background_training=False) as p:
            prompts, truth = [e.prompt for e in test], [e.output_len for e in test]
            pred = p.predict(prompts)
            slope, icpt = fit_prompt_length(p)
            base = slope * np.array(embedder.count_tokens(prompts), dtype=float) + icpt
            rows.append({"split_seed": seed, "train_size": len(train), "spearman": spearman(pred, truth),
                         "prompt_length_spearman": spearman(base, truth),
                         "mlp_only_spearman": spearman([x or 0.0 for x in p.predict_mlp(prompts)], truth)})
    return rows


if __name__ == "__main__":
    sys.exit(main())
