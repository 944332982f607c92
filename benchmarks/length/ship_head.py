"""Rebuild the self length head that ships with the package for `smollm2-135m-instruct`
(tokenslice/predict/heads/smollm2-135m-instruct.npz): what srpt-predicted uses with no set-up.

Steps (each skipped when its output exists, so an interrupted run resumes):
  1. own_answers.py answers the fixed sample of Alpaca and ShareGPT prompts greedily, in its fixed
     order, `--answers` of them (the data manifest: ids, splits and lengths, no text, committed as
     results/ship_head_answers.jsonl; token ids in cache/, never committed);
  2. self_features.py computes the states after layer `--layer` every 8 generated tokens;
  3. `tokenslice predictor build-self` fits the head on the train split (ids whose sha1 mod 5 != 0);
  4. the fitted weights alone (no sums: a few KB) are written into the package. Served, they are
     the prior the deployment's own answers refine (predict/self_head.py).
It prints the head's Spearman rank correlation at arrival (t = 0) on the held-out test split.

    nohup .venv/bin/python benchmarks/length/ship_head.py > /tmp/ship_head.log 2>&1 &
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MANIFEST = HERE / "results" / "ship_head_answers.jsonl"
SHIPPED = ROOT / "tokenslice" / "predict" / "heads" / "smollm2-135m-instruct.npz"
LAYER = 15  # of 30: the layer benchmarks/length/self_eval.py chose for this model


def run(*args: str) -> None:
    print("+", " ".join(args), flush=True)
    subprocess.run(args, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--answers", type=int, default=486, help="answers of the fixed order to record")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layer", type=int, default=LAYER)
    a = ap.parse_args()
    py = sys.executable
    done = len(MANIFEST.read_text().splitlines()) if MANIFEST.is_file() else 0
    if done < a.answers:
        run(py, str(HERE / "own_answers.py"), "--threads", str(a.threads), "--limit", str(a.answers - done),
            "--out", str(MANIFEST))
    with tempfile.TemporaryDirectory() as tmp:
        feats, head_dir = Path(tmp) / "features.npz", Path(tmp) / "head"
        run(py, str(HERE / "self_features.py"), "--answers", str(MANIFEST), "--layers", str(a.layer),
            "--every", "8", "--threads", str(a.threads), "--out", str(feats))
        run(str(Path(py).parent / "tokenslice"), "predictor", "build-self", "--features", str(feats),
            "--layer", str(a.layer), "--out", str(head_dir))
        from tokenslice.bench.length_self import load_rows, spearman_at
        from tokenslice.predict.self_head import SELF_HEAD_FILE, SelfLengthHead

        head = SelfLengthHead.load(head_dir / SELF_HEAD_FILE)
        rows = load_rows(feats, a.layer)
        test = rows.where(rows.split == "test")
        print(f"held-out Spearman at arrival: {spearman_at(head, test, 0)}")
        SHIPPED.parent.mkdir(exist_ok=True)
        head.save(SHIPPED, sums=False)
        SHIPPED.chmod(0o644)  # a package file: the state directory's copy is the private one
    print(f"wrote {SHIPPED} ({SHIPPED.stat().st_size} bytes; fitted on {head.answers} answers)")


if __name__ == "__main__":
    main()
