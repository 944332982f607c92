"""Decode step time of two checkouts of tokenslice on the same model and batch: did a change
slow the decode step down? Each round runs one measurement per checkout in its own process
(alternating, so machine drift hits both), logprobs and every sampling control off.

The 56M Llama of benchmarks/common/llama56m.py, fp32, one PyTorch thread, 64 prompt + 32 generated tokens per
request, greedy; reported: per checkout the median over rounds of the mean decode-only step.

    git worktree add /tmp/before <rev>
    .venv/bin/python benchmarks/decode/decode_step_versions.py /tmp/before . [--batches 16,64] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # benchmarks/common: shared helpers
from llama56m import build_checkpoint  # noqa: E402


HERE = Path(__file__).resolve().parent
# Run inside each checkout (PYTHONPATH = that checkout, so `import tokenslice` is its code); the
# measuring loop is this directory's, written against the engine API both checkouts share.
MEASURE = r"""
import json, sys
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[3])
from logprobs_overhead import NEW, decode_step_seconds
from tokenslice import LLM, SamplingParams
torch.set_num_threads(1)
batches = [int(b) for b in sys.argv[2].split(",")]
sp = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
with LLM(sys.argv[1], dtype="float32", max_batch_size=max(batches), kv_cache_blocks=1024) as llm:
    decode_step_seconds(llm.engine, 4, sp)  # warm-up
    print(json.dumps({b: decode_step_seconds(llm.engine, b, sp) for b in batches}))
"""


def measure(tree: Path, ckpt: Path, batches: str) -> dict[int, float]:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", MEASURE, str(ckpt), batches, str(HERE)], cwd=tree, env=env,
                       capture_output=True, text=True, timeout=600, check=True)
    return {int(k): v for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    trees = {"before": a.before.resolve(), "after": a.after.resolve()}
    runs: dict[str, list[dict[int, float]]] = {k: [] for k in trees}
    with tempfile.TemporaryDirectory() as d:
        build_checkpoint(Path(d))
        for i in range(a.rounds):
            order = list(trees) if i % 2 == 0 else list(reversed(trees))
            for k in order:
                runs[k].append(measure(trees[k], Path(d), a.batches))
    rows = []
    print(f"{'batch':>5} {'before ms':>10} {'after ms':>10} {'after/before':>13}")
    for b in [int(x) for x in a.batches.split(",")]:
        before = statistics.median(r[b] for r in runs["before"])
        after = statistics.median(r[b] for r in runs["after"])
        rows.append({"batch": b, "before_ms": 1e3 * before, "after_ms": 1e3 * after, "ratio": after / before,
                     "before_all_ms": [1e3 * r[b] for r in runs["before"]],
                     "after_all_ms": [1e3 * r[b] for r in runs["after"]]})
        print(f"{b:5d} {1e3 * before:10.2f} {1e3 * after:10.2f} {after / before:13.3f}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"benchmark": "decode_step_versions", "trees": {k: str(v) for k, v in trees.items()}, "rounds": a.rounds,
                                     "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
