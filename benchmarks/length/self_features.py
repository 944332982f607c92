"""Hidden states of the served chat model along its own answers (issue 33, part 2): the features
the self length head learns from, computed from own_answers.py's recorded answers.

One prefill pass over prompt + answer per record gives the state after each decoder layer at every
position; serving captures the same states one token at a time (runner.py, capture_hidden), so
the row "after t generated tokens" is position prompt_tokens - 1 + t: at t = 0 the prompt's last
token (what prefill captures), at t > 0 the decode step that samples token t + 1.

    --layers 6,12,... --every 8   states after each listed layer at t = 0, 8, 16, ... < length

Each answer's states go to cache/states/<id>.npz as they are computed (a rerun skips the answers
already there, so it can follow own_answers.py as it progresses); then all of them are merged
into `--out` (float16, not committed): rows, with ids, t and lengths beside them; and per answer
the mean state over its prompt's positions (`pool{L}`, `pool_id`), an alternative arrival feature.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenslice.llm import LLM
from tokenslice.plan import SeqSlice, StepPlan
from tokenslice.request import SamplingParams

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # own_answers.py: the sample and its files
from own_answers import MAX_MODEL_LEN, MODEL, RESULTS, TOKENS, chat_ids, prompt_texts  # noqa: E402

CACHE = HERE / "cache"
STATES = CACHE / "states"


def load_answers(results: Path = RESULTS) -> list[dict]:
    """own_answers.py's records joined with their answer token ids and prompt ids."""
    toks = {}
    for line in TOKENS.read_text().splitlines():
        r = json.loads(line)
        toks[r["id"]] = r["output_token_ids"]
    recs = [json.loads(line) for line in results.read_text().splitlines()]
    return [r | {"output_token_ids": toks[r["id"]]} for r in recs if r["id"] in toks]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", required=True, help="comma-separated decoder layers (0-based)")
    ap.add_argument("--every", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--answers", type=Path, default=RESULTS, help="own_answers.py's results file (its --out)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    layers = sorted(int(x) for x in a.layers.split(","))
    STATES.mkdir(parents=True, exist_ok=True)
    answers = load_answers(a.answers)
    todo = [r for r in answers if not (STATES / f"{r['id']}.npz").is_file()]
    print(f"{len(todo)} answers to compute, {len(answers) - len(todo)} already in {STATES}", flush=True)
    if todo:
        compute(todo, layers, a.every)
    merge([r["id"] for r in answers], layers, a.out, a.answers)


def compute(answers: list[dict], layers: list[int], every: int) -> None:
    # The prompts' token ids again (the same sample, the same chat template).
    llm = LLM(MODEL, max_model_len=MAX_MODEL_LEN, max_batch_size=1, kv_cache_blocks=MAX_MODEL_LEN // 16 + 1)
    texts = prompt_texts()
    runner, tok = llm.engine.runner, llm.tokenizer
    blocks = list(range(MAX_MODEL_LEN // 16 + 1))
    taken: dict[int, torch.Tensor] = {}
    pooled: dict[int, torch.Tensor] = {}
    at: dict[str, Any] = {}

    def hook(i: int):  # noqa: ANN202
        def f(_mod, _inp, out):  # noqa: ANN001, ANN202
            taken[i] = out.index_select(0, at["rows"]).float()
            pooled[i] = out[:at["prompt"]].float().mean(0)  # the prompt's mean state (an alternative feature)
        return f

    handles = [runner.model.model.layers[i].register_forward_hook(hook(i)) for i in layers]
    start = time.perf_counter()
    for n, r in enumerate(answers):
        prompt = chat_ids(tok, texts[r["id"]])
        assert len(prompt) == r["prompt_tokens"], r["id"]
        ts = list(range(0, r["output_tokens"], every))
        rows = [len(prompt) - 1 + t for t in ts]
        at |= {"rows": torch.tensor(rows), "prompt": len(prompt)}
        plan = StepPlan(prefill=[SeqSlice("f", prompt + r["output_token_ids"], 0, blocks, False, SamplingParams(), 0)])
        runner.prompt_hidden(plan, layers[-1], rows)
        arrays = {f"layer{i}": taken[i].numpy().astype(np.float16) for i in layers}
        arrays |= {f"pool{i}": pooled[i].numpy().astype(np.float16) for i in layers}
        tmp = STATES / f"{r['id']}.tmp.npz"
        np.savez(tmp, t=np.asarray(ts), **arrays)
        tmp.replace(STATES / f"{r['id']}.npz")
        if (n + 1) % 20 == 0:
            print(f"{n + 1}/{len(answers)} answers, {time.perf_counter() - start:.0f}s", flush=True)
    for h in handles:
        h.remove()
    llm.close()


def merge(ids: list[str], layers: list[int], out: Path, results: Path = RESULTS) -> None:
    recs = {json.loads(line)["id"]: json.loads(line) for line in results.read_text().splitlines()}
    feats: dict[str, list[np.ndarray]] = {}
    meta: dict[str, list[Any]] = {k: [] for k in ("id", "t", "output_tokens", "prompt_tokens", "finish_reason",
                                                   "split", "source")}
    for rid in ids:
        r = recs[rid]
        with np.load(STATES / f"{rid}.npz") as d:
            for i in layers:
                feats.setdefault(f"layer{i}", []).append(d[f"layer{i}"])
                feats.setdefault(f"pool{i}", []).append(d[f"pool{i}"][None])
            ts = d["t"].tolist()
        for t in ts:
            for k in meta:
                meta[k].append(t if k == "t" else r[k])
    arrays = {k: np.concatenate(v) for k, v in feats.items()} | {"pool_id": np.asarray(ids)}
    np.savez(out, **arrays, **{k: np.asarray(v) for k, v in meta.items()})
    print(f"wrote {out}: {len(meta['t'])} rows of {len(ids)} answers, layers {layers}")


if __name__ == "__main__":
    main()
