"""`tokenslice predictor build`, `build-self` and `eval`: the output-length predictors (ALISE §3.1;
the self length head on the served model's own hidden states, predict/self_head.py)."""
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


def cmd_predictor_build_self(a: argparse.Namespace) -> int:
    """A self length head (predict/self_head.py) fitted on recorded hidden states."""
    from pathlib import Path

    from tokenslice.bench.length_self import fit_head, load_rows, spearman_at
    from tokenslice.predict.self_head import SELF_HEAD_FILE, SelfHeadConfig

    try:
        rows = load_rows(a.features, a.layer)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    train = rows if a.split == "all" else rows.where(rows.split == a.split)
    out = Path(a.out)
    if (out / SELF_HEAD_FILE).exists():
        raise ValueError(f"{out} already holds a self length head")
    cfg = SelfHeadConfig(layer=a.layer, hidden_size=rows.hidden.shape[1], ridge=a.ridge, refine_every=a.refine_every,
                         max_t=a.max_t if a.max_t > 0 else None, budget_s=a.budget_ms / 1000,
                         blend_weight=a.blend_weight)
    head = fit_head(train, cfg)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    head.save(out / SELF_HEAD_FILE)
    fitted = spearman_at(head, train, 0).get("all", {})
    print(f"fitted a layer-{a.layer} head on {len(train)} rows ({a.split}) of {a.features}; "
          f"in-sample Spearman at arrival {fitted.get('spearman') or float('nan'):.3f}")
    print(f"wrote {out / SELF_HEAD_FILE} (use it as: tokenslice serve --length-predictor {out} ...)")
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

    f = ps.add_parser("build-self", help="fit a self length head on the served model's recorded hidden states")
    f.add_argument("--features", required=True,
                   help=".npz of hidden states along recorded answers (benchmarks/length/self_features.py)")
    f.add_argument("--layer", type=int, required=True, help="decoder layer whose states the head reads")
    f.add_argument("--out", required=True, help="predictor directory (may already hold an embedding predictor)")
    f.add_argument("--split", default="train", choices=["train", "test", "all"], help="which rows to fit on")
    f.add_argument("--ridge", type=float, default=1.0, help="L2 penalty per row on standardised features")
    f.add_argument("--refine-every", type=int, default=16, help="generated tokens between re-predictions")
    f.add_argument("--max-t", type=int, default=128, help="learn from states up to this many generated tokens (0: all)")
    f.add_argument("--budget-ms", type=float, default=2.0, help="prediction time per engine step")
    f.add_argument("--blend-weight", type=float, default=0.7,
                   help="with an embedding predictor beside it: this head's weight at the end of prefill")
    f.set_defaults(func=cmd_predictor_build_self)

    e = ps.add_parser("eval", help="score a predictor and three baselines on a dataset (read-only)")
    _add_dataset_args(e)
    e.add_argument("--predictor", required=True, help="predictor directory")
    e.add_argument("--out", default=None, help="write the results as JSON")
    e.set_defaults(func=cmd_predictor_eval)
