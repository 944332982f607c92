"""How well the served chat model's own hidden states predict its answers' lengths (issue 33,
checks 1): the self length head against the embedding predictor on the same fixed test split.

    layers  choose the layer and the ridge penalty by 3-fold cross-validation on the TRAIN split
            only (folds by a hash of the prompt id), from states at t = 0 and 32
            (self_features.py --layers ...);
    final   fit the head on every train row of the chosen layer (t = 0, 8, 16, ...), score on the
            test split: Spearman of predicted vs true length at arrival (t = 0), of remaining
            length after 32 generated tokens, and of a prediction made `lag` tokens before it is
            used (what refining every k tokens ranks by between refinements), per source; the
            head's cost per prediction; writes the head to cache/predictor-self/.
    embed   the embedding predictor (all-MiniLM-L6-v2, kNN + MLP, tuned by its own
            cross-validation) seeded with the train split's prompts and the model's own lengths,
            scored on the same test prompts; writes it to cache/predictor-embed/.
    blend   the weight of the head against the embedding predictor at arrival ("both"), chosen
            on the train split, scored on the test split; writes cache/predictor-both/.

Results: results/self_eval_{layers,final,embed}.json.

    .venv/bin/python benchmarks/length/self_eval.py layers --features cache/states_layers.npz
    .venv/bin/python benchmarks/length/self_eval.py final --features cache/states_L.npz --layer L --ridge R
    .venv/bin/python benchmarks/length/self_eval.py embed
    .venv/bin/python benchmarks/length/self_eval.py blend --features cache/states.npz --layer L --ridge R
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tokenslice.bench.length_self import StateRows, fit_head, load_rows, predict_log, spearman_at, stale_spearman
from tokenslice.predict.blend import spearman
from tokenslice.predict.self_head import SELF_HEAD_FILE, SelfHeadConfig

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # own_answers.py: the sample and its files
from own_answers import RESULTS, prompt_texts  # noqa: E402

CACHE = HERE / "cache"
OUT = HERE / "results"
RIDGES = (0.1, 1.0, 10.0, 30.0)
MAX_TS = (64, 128, None)  # learn from states up to this many generated tokens (None: all)
LAGS = (0, 8, 16, 24, 32, 48, 56)
LAG_AT = (64, 128, 192, 256)


def fold_of(prompt_id: str, folds: int = 3) -> int:
    return int(hashlib.sha1(f"fold:{prompt_id}".encode()).hexdigest(), 16) % folds


def cv_scores(rows: StateRows, layer: int, ridge: float, max_t: int | None) -> dict[str, float]:
    """Mean out-of-fold Spearman at t = 0 and t = 32 (remaining), train rows only."""
    folds = np.array([fold_of(i) for i in rows.ids.tolist()])
    at0, at32 = [], []
    for f in range(3):
        head = fit_head(rows.where(folds != f), SelfHeadConfig(layer=layer, hidden_size=rows.hidden.shape[1],
                                                                ridge=ridge, max_t=max_t))
        val = rows.where(folds == f)
        at0.append(spearman_at(head, val, 0)["all"]["spearman"])
        at32.append(spearman_at(head, val, 32)["all"]["spearman"])
    return {"t0": float(np.mean(at0)), "t32": float(np.mean(at32))}


def cmd_layers(a: argparse.Namespace) -> dict[str, Any]:
    with np.load(a.features) as d:
        layers = sorted(int(k[5:]) for k in d if k.startswith("layer"))
    table = []
    for layer in layers:
        rows = load_rows(a.features, layer)
        rows = rows.where(rows.split == "train")
        for ridge in RIDGES:
            for max_t in MAX_TS:
                s = cv_scores(rows, layer, ridge, max_t)
                table.append({"layer": layer, "ridge": ridge, "max_t": max_t, **s})
                print(f"layer {layer:2d} ridge {ridge:<5} max_t {max_t!s:<5} CV Spearman t=0 {s['t0']:.3f}  "
                      f"t=32 {s['t32']:.3f}", flush=True)
    best = max(table, key=lambda r: r["t0"] + r["t32"])
    print(f"chosen: layer {best['layer']} ridge {best['ridge']} max_t {best['max_t']} "
          "(best sum of the two CV Spearmans)")
    return {"table": table, "chosen": best}


def cmd_final(a: argparse.Namespace) -> dict[str, Any]:
    rows = load_rows(a.features, a.layer)
    train, test = rows.where(rows.split == "train"), rows.where(rows.split == "test")
    cfg = SelfHeadConfig(layer=a.layer, hidden_size=rows.hidden.shape[1], ridge=a.ridge, refine_every=a.refine_every,
                         max_t=a.max_t)
    head = fit_head(train, cfg)
    out: dict[str, Any] = {"layer": a.layer, "ridge": a.ridge, "max_t": a.max_t, "refine_every": a.refine_every,
                           "train_rows": len(train), "test_rows": len(test),
                           "train_answers": len(set(train.ids.tolist())), "test_answers": len(set(test.ids.tolist()))}
    out["arrival"] = spearman_at(head, test, 0)
    out["after_32"] = spearman_at(head, test, 32)
    for name, t in (("arrival", 0), ("after_32", 32)):
        for src, v in out[name].items():
            v["ci90"] = bootstrap_ci(head, test, t, None if src == "all" else src)
    # A second, larger view (not the check): 5-fold cross-validation over every answer, train and test.
    out["cv5_all_answers"] = cv_all(rows, cfg)
    out["stale"] = {str(lag): _mean([stale_spearman(head, test, t, lag) for t in LAG_AT]) for lag in LAGS}
    # Cost of one prediction: the features and the dot product, one request at a time.
    one = test.where(test.t == 0)
    secs = []
    for i in range(min(200, len(one))):
        start = time.perf_counter()
        head.predict_remaining(one.hidden[i:i + 1], one.prompt_tokens[i:i + 1], one.t[i:i + 1],
                               one.prompt_hidden[i:i + 1])
        secs.append(time.perf_counter() - start)
    out["ms_per_prediction"] = {"median": 1000 * float(np.median(secs)), "p99": 1000 * float(np.quantile(secs, 0.99))}
    for name in ("arrival", "after_32"):
        print(name, {k: (v["n"], v["spearman"] and round(v["spearman"], 3)) for k, v in out[name].items()})
    print("stale (lag: mean Spearman at t in", LAG_AT, ")", {k: round(v, 3) for k, v in out["stale"].items() if v})
    print("ms per prediction", out["ms_per_prediction"])
    target = CACHE / "predictor-self"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True, mode=0o700)
    head.save(target / SELF_HEAD_FILE)
    print(f"wrote {target / SELF_HEAD_FILE}")
    return out


def bootstrap_ci(head: Any, rows: StateRows, t: int, source: str | None, reps: int = 1000) -> list[float]:
    """90% bootstrap interval of the Spearman at t (answers resampled)."""
    at = rows.where((rows.t == t) & ((rows.source == source) if source else np.ones(len(rows), bool)))
    pred = predict_log(head, at)
    rng = np.random.default_rng(0)
    vals = [spearman(pred[i], at.remaining[i]) for i in (rng.integers(0, len(at), len(at)) for _ in range(reps))]
    vals = [v for v in vals if v is not None]
    return [float(np.quantile(vals, 0.05)), float(np.quantile(vals, 0.95))]


def cv_all(rows: StateRows, cfg: SelfHeadConfig, folds: int = 5) -> dict[str, Any]:
    """Out-of-fold Spearman at t = 0 and 32 per source, pooled over folds of every answer."""
    fold = np.array([fold_of(i, folds) for i in rows.ids.tolist()])
    preds: dict[int, list[np.ndarray]] = {0: [], 32: []}
    parts: dict[int, list[StateRows]] = {0: [], 32: []}
    for f in range(folds):
        head = fit_head(rows.where(fold != f), cfg)
        for t in (0, 32):
            val = rows.where((fold == f) & (rows.t == t))
            preds[t].append(predict_log(head, val))
            parts[t].append(val)
    out: dict[str, Any] = {}
    for t, name in ((0, "arrival"), (32, "after_32")):
        p = np.concatenate(preds[t])
        truth = np.concatenate([v.remaining for v in parts[t]])
        src = np.concatenate([v.source for v in parts[t]])
        out[name] = {s: {"n": int(m.sum()), "spearman": spearman(p[m], truth[m])}
                     for s, m in (("all", np.ones(len(p), bool)), ("alpaca", src == "alpaca"),
                                  ("sharegpt", src == "sharegpt"))}
    print("5-fold CV over all answers:", {k: {s: (v["n"], round(v["spearman"], 3)) for s, v in d.items()}
                                           for k, d in out.items()})
    return out


def cmd_embed(a: argparse.Namespace) -> dict[str, Any]:
    from tokenslice.bench.length_eval import evaluate
    from tokenslice.predict.length import LengthPredictor

    recs = [json.loads(line) for line in RESULTS.read_text().splitlines()]
    texts = prompt_texts()
    train = [r for r in recs if r["split"] == "train"]
    test = [r for r in recs if r["split"] == "test"]
    target = CACHE / "predictor-embed"
    shutil.rmtree(target, ignore_errors=True)
    start = time.perf_counter()
    with LengthPredictor.create(target) as pred:
        pred.seed([texts[r["id"]] for r in train], [r["output_tokens"] for r in train],
                  censored=[False] * len(train), groups=[r["id"] for r in train])
    built = time.perf_counter() - start
    out: dict[str, Any] = {"train_answers": len(train), "build_s": built}
    with LengthPredictor.load(target, cache_size=0, background_training=False) as pred:
        for src in ("all", "alpaca", "sharegpt"):
            part = [r for r in test if src in ("all", r["source"])]
            res = evaluate(pred, [texts[r["id"]] for r in part], [r["output_tokens"] for r in part])
            out[src] = {k: res[k] for k in ("n", "spearman", "median_latency_ms", "p99_latency_ms")}
            print(src, out[src], flush=True)
    return out


def cmd_blend(a: argparse.Namespace) -> dict[str, Any]:
    """The "both" weight: chosen on the train split (head and embedding predictor fitted on one
    half, weights scored on the other), then scored on the test split with the final predictors
    (cache/predictor-self, cache/predictor-embed: run `final` and `embed` first)."""
    import tempfile

    from tokenslice.predict.length import LengthPredictor
    from tokenslice.predict.self_head import SelfLengthHead

    texts = prompt_texts()
    rows = load_rows(a.features, a.layer)
    train = rows.where(rows.split == "train")
    half = np.array([fold_of(i, 2) for i in train.ids.tolist()])
    cfg = SelfHeadConfig(layer=a.layer, hidden_size=rows.hidden.shape[1], ridge=a.ridge, max_t=a.max_t)
    head = fit_head(train.where(half == 0), cfg)
    fit_part = train.where((half == 0) & (train.t == 0))
    val = train.where((half == 1) & (train.t == 0))
    with tempfile.TemporaryDirectory() as tmp, LengthPredictor.create(Path(tmp) / "p") as pred:
        pred.seed([texts[i] for i in fit_part.ids.tolist()], fit_part.output_tokens.tolist(),
                  groups=fit_part.ids.tolist())
        embed_val = np.log1p(pred.predict([texts[i] for i in val.ids.tolist()]))
    self_val = predict_log(head, val)
    grid = [round(float(w), 1) for w in np.arange(0.0, 1.01, 0.1)]
    scores = {w: spearman(w * self_val + (1 - w) * embed_val, val.output_tokens) for w in grid}
    best = max(grid, key=lambda w: scores[w] or -1)
    print("train-half Spearman by self weight:", {w: round(v, 3) for w, v in scores.items()}, "-> chosen", best)
    test = rows.where((rows.split == "test") & (rows.t == 0))
    final = SelfLengthHead.load(CACHE / "predictor-self" / SELF_HEAD_FILE)
    with LengthPredictor.load(CACHE / "predictor-embed", cache_size=0, background_training=False) as pred:
        embed_test = np.log1p(pred.predict([texts[i] for i in test.ids.tolist()]))
    blend = best * predict_log(final, test) + (1 - best) * embed_test
    out: dict[str, Any] = {"weights": {str(w): v for w, v in scores.items()}, "chosen": best, "test": {}}
    for src in ("all", "alpaca", "sharegpt"):
        m = np.ones(len(test), bool) if src == "all" else test.source == src
        out["test"][src] = {"n": int(m.sum()), "spearman": spearman(blend[m], test.output_tokens[m])}
    print("both, test split, at arrival:", out["test"])
    final.config.blend_weight = best
    final.save(CACHE / "predictor-self" / SELF_HEAD_FILE)
    both = CACHE / "predictor-both"
    shutil.rmtree(both, ignore_errors=True)
    shutil.copytree(CACHE / "predictor-embed", both)
    shutil.copy(CACHE / "predictor-self" / SELF_HEAD_FILE, both / SELF_HEAD_FILE)
    return out


def _mean(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["layers", "final", "embed", "blend"])
    ap.add_argument("--features", type=Path)
    ap.add_argument("--layer", type=int)
    ap.add_argument("--ridge", type=float, default=1.0)
    ap.add_argument("--refine-every", type=int, default=16)
    ap.add_argument("--max-t", type=lambda v: None if v == "none" else int(v), default=128)
    a = ap.parse_args()
    result = {"layers": cmd_layers, "final": cmd_final, "embed": cmd_embed, "blend": cmd_blend}[a.mode](a)
    OUT.mkdir(exist_ok=True)
    path = OUT / f"self_eval_{a.mode}.json"
    path.write_text(json.dumps(result, indent=1, default=float) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
