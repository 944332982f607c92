"""`tokenslice predictor build` and `predictor eval`: the output-length predictor (ALISE §3.1)."""
from __future__ import annotations

import argparse
from typing import Any

from tokenslice.cli.args import write_json
from tokenslice.config import EMBED_DTYPES


def _predictor_examples(a: argparse.Namespace, turns: str) -> list[Any]:
    from tokenslice.bench.lengthdata import load_examples, select

    try:
        examples = load_examples(a.dataset, a.tokenizer, turns=turns)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    return select(examples, a.split, a.test_size, a.split_seed)


def cmd_predictor_build(a: argparse.Namespace) -> int:
    import time

    from tokenslice.predict.length import LengthPredictor, PredictorConfig

    examples = _predictor_examples(a, a.turns)
    start = time.perf_counter()
    try:
        pred = LengthPredictor.create(a.out, PredictorConfig(embedder=a.embedder, embedder_dtype=a.embedder_dtype,
                                                               retrain_every=a.retrain_every))
    except (FileExistsError, FileNotFoundError) as e:
        raise ValueError(str(e)) from None
    with pred:
        pred.seed([e.prompt for e in examples], [e.output_len for e in examples],
                  groups=[e.group for e in examples], tune=not a.no_tune)
        cfg = pred.config
        tuned = "" if pred.tune_score is None else f", cross-validated Spearman {pred.tune_score:.3f}"
        print(f"seeded {pred.num_records} records from {a.dataset} in {time.perf_counter() - start:.1f}s: "
              f"k={cfg.k} threshold={cfg.threshold} knn_weight={cfg.knn_weight}{tuned}")
    print(f"wrote {a.out} (use it as: tokenslice serve --length-predictor {a.out} ...)")
    return 0


def cmd_predictor_eval(a: argparse.Namespace) -> int:
    from tokenslice.bench.length_eval import evaluate, format_table
    from tokenslice.predict.length import LengthPredictor

    # Held-out prompts are always first turns (a later turn's prompt lacks its conversation).
    examples = _predictor_examples(a, "first")
    try:
        pred = LengthPredictor.load(a.predictor, cache_size=0, background_training=False)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    with pred:
        result = evaluate(pred, [e.prompt for e in examples], [e.output_len for e in examples])
    result["dataset"] = str(a.dataset)
    result["split"] = {"part": a.split, "test_size": a.test_size, "seed": a.split_seed}
    print(format_table(result))
    if a.out:
        write_json(a.out, result)
    return 0


def _add_dataset_args(q: argparse.ArgumentParser) -> None:
    q.add_argument("--dataset", required=True, help="Alpaca or ShareGPT JSON file")
    q.add_argument("--tokenizer", required=True, help="tokenizer directory that counts output tokens")
    q.add_argument("--split", default="all", choices=["all", "train", "test"],
                   help="use the whole dataset, or one side of a seeded split (needs --test-size)")
    q.add_argument("--test-size", type=int, default=None, help="records (conversations) held out for test")
    q.add_argument("--split-seed", type=int, default=0)


def add_subcommand(sub: Any) -> None:
    p = sub.add_parser("predictor", help="build or evaluate an output-length predictor")
    ps = p.add_subparsers(dest="predictor_command", required=True)

    b = ps.add_parser("build", help="create a predictor seeded from a dataset (tunes and trains it)")
    _add_dataset_args(b)
    b.add_argument("--out", required=True, help="predictor directory to create")
    b.add_argument("--turns", default="first", choices=["first", "all"],
                   help="ShareGPT: seed with each conversation's first human->gpt pair, or every pair")
    b.add_argument("--embedder", default=None,
                   help="sentence-embedding model directory (default: the installed all-MiniLM-L6-v2)")
    b.add_argument("--embedder-dtype", default="auto", choices=list(EMBED_DTYPES),
                   help="encoder weights' dtype; auto: bfloat16 where the CPU computes it natively")
    b.add_argument("--retrain-every", type=int, default=256, help="new records between MLP retrainings")
    b.add_argument("--no-tune", action="store_true", help="keep the default k / threshold / knn weight")
    b.set_defaults(func=cmd_predictor_build)

    e = ps.add_parser("eval", help="score a predictor and three baselines on a dataset (read-only)")
    _add_dataset_args(e)
    e.add_argument("--predictor", required=True, help="predictor directory")
    e.add_argument("--out", default=None, help="write the results as JSON")
    e.set_defaults(func=cmd_predictor_eval)
