"""Hidden states of the served chat model along its own answers (issue 33, part 2): the features
the self length head learns from, computed from own_answers.py's recorded answers.

One prefill pass over prompt + answer per record gives the state after each decoder layer at every
position; serving captures the same states one token at a time (runner.py, capture_hidden), so
the row "after t generated tokens" is position prompt_tokens - 1 + t: at t = 0 the prompt's last
token (what prefill captures), at t > 0 the decode step that samples token t + 1.

    --layers 6,12,... --every 8   states after each listed layer at t = 0, 8, 16, ... < length

Written as float16 .npz under cache/ (not committed): rows, with ids, t and lengths beside them.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from tokenslice.llm import LLM
from tokenslice.plan import SeqSlice, StepPlan
from tokenslice.request import SamplingParams

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # own_answers.py: the sample and its files
from own_answers import MAX_MODEL_LEN, MODEL, RESULTS, TOKENS, chat_ids, prompt_texts  # noqa: E402

CACHE = HERE / "cache"


def load_answers() -> list[dict]:
    """own_answers.py's records joined with their answer token ids and prompt ids."""
    toks = {}
    for line in TOKENS.read_text().splitlines():
        r = json.loads(line)
        toks[r["id"]] = r["output_token_ids"]
    recs = [json.loads(line) for line in RESULTS.read_text().splitlines()]
    return [r | {"output_token_ids": toks[r["id"]]} for r in recs if r["id"] in toks]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", required=True, help="comma-separated decoder layers (0-based)")
    ap.add_argument("--every", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    layers = sorted(int(x) for x in a.layers.split(","))
    answers = load_answers()
    # The prompts' token ids again (the same sample, the same chat template).
    llm = LLM(MODEL, max_model_len=MAX_MODEL_LEN, max_batch_size=1, kv_cache_blocks=MAX_MODEL_LEN // 16 + 1)
    texts = prompt_texts()
    runner, tok = llm.engine.runner, llm.tokenizer
    blocks = list(range(MAX_MODEL_LEN // 16 + 1))
    model_layers = runner.model.model.layers
    taken: dict[int, torch.Tensor] = {}
    rows_at: list[torch.Tensor] = []

    def hook(i: int):
        def f(_mod, _inp, out):  # noqa: ANN001
            taken[i] = out.index_select(0, rows_at[0]).float()
        return f

    handles = [model_layers[i].register_forward_hook(hook(i)) for i in layers]
    feats: dict[int, list[np.ndarray]] = {i: [] for i in layers}
    meta = {"id": [], "t": [], "output_tokens": [], "prompt_tokens": [], "finish_reason": [], "split": [],
            "source": []}
    start = time.perf_counter()
    for n, r in enumerate(answers):
        prompt = chat_ids(tok, texts[r["id"]])
        assert len(prompt) == r["prompt_tokens"], r["id"]
        seq = prompt + r["output_token_ids"]
        length = r["output_tokens"]
        ts = list(range(0, length, a.every))
        rows = [len(prompt) - 1 + t for t in ts]
        rows_at[:] = [torch.tensor(rows)]
        plan = StepPlan(prefill=[SeqSlice("f", seq, 0, blocks, False, SamplingParams(), 0)])
        runner.prompt_hidden(plan, layers[-1], rows)
        for i in layers:
            feats[i].append(taken[i].numpy().astype(np.float16))
        for t in ts:
            for k, v in (("id", r["id"]), ("t", t), ("output_tokens", length), ("prompt_tokens", len(prompt)),
                         ("finish_reason", r["finish_reason"]), ("split", r["split"]), ("source", r["source"])):
                meta[k].append(v)
        if (n + 1) % 50 == 0:
            print(f"{n + 1}/{len(answers)} answers, {time.perf_counter() - start:.0f}s", flush=True)
    for h in handles:
        h.remove()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    arrays = {f"layer{i}": np.concatenate(feats[i]) for i in layers}
    np.savez(a.out, **arrays, **{k: np.asarray(v) for k, v in meta.items()})
    print(f"wrote {a.out}: {len(meta['t'])} rows, layers {layers}, {time.perf_counter() - start:.0f}s")
    llm.close()


if __name__ == "__main__":
    main()
