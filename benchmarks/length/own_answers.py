"""The served chat model's own answers as length data (issue 33, part 1): SmolLM2-135M-Instruct
(the known model `smollm2-135m-instruct`, quantization auto) answers a fixed sample of Alpaca
prompts and ShareGPT first human turns, greedily (temperature 0, so the recorded length is exactly
what a later greedy run of the same prompt produces: an exact oracle), with max_tokens 512.

Sample (fixed before running): `--alpaca` records of alpaca_4500.json and `--sharegpt`
conversations of sharegpt_multiturn_800.json drawn with numpy seed `--seed`; prompts rendered
through the model's chat template as one user message (what /v1/chat/completions sends); prompts
over 1,024 tokens are left out (vLLM's benchmark filter). Test split, fixed before any training:
a prompt is a test prompt when sha1(its id) mod 5 == 0 (about 20%).

The run (in one fixed shuffled order, so any prefix mixes both sources) is continuous batching
through the offline engine (tokenslice.llm.LLM): up to `--batch` requests in flight, topped up as
they finish. Each finished answer is appended at once to
results/own_answers.jsonl (id, source, split, prompt and output token counts, finish reason: no
text), so an interrupted run resumes where it stopped. The answers' token ids, needed to
recompute hidden states along each answer (self_features.py), go to cache/answer_tokens.jsonl,
which is never committed.

    nohup .venv/bin/python benchmarks/length/own_answers.py --threads 1 --drain-file /tmp/own_answers.drain \
        > /tmp/own_answers.log 2>&1 &      # touch the drain file to end early on a prefix of the order
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from tokenslice.bench.datasets import alpaca_pairs, sharegpt_first_pair
from tokenslice.llm import LLM
from tokenslice.request import SamplingParams

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[2] / "shared" / "data"
RESULTS = HERE / "results" / "own_answers.jsonl"
TOKENS = HERE / "cache" / "answer_tokens.jsonl"
MODEL = "smollm2-135m-instruct"
MAX_PROMPT_TOKENS = 1024
MAX_MODEL_LEN = 2048
SAMPLE = (600, 600, 0)  # Alpaca prompts, ShareGPT prompts, seed: the sample of record


def is_test(prompt_id: str) -> bool:
    """The fixed test split: a hash of the id, so it never depends on what was sampled or trained."""
    return int(hashlib.sha1(prompt_id.encode()).hexdigest(), 16) % 5 == 0


def sample_prompts(n_alpaca: int, n_sharegpt: int, seed: int) -> list[tuple[str, str, str]]:
    """(id, source, prompt text), Alpaca first then ShareGPT, each drawn with `seed`."""
    rng = np.random.default_rng(seed)
    alpaca = alpaca_pairs(json.loads((SHARED / "alpaca_4500.json").read_text()))
    out = [(f"alpaca-{i}", "alpaca", alpaca[i][0])
           for i in sorted(rng.choice(len(alpaca), n_alpaca, replace=False).tolist())]
    convs = json.loads((SHARED / "sharegpt_multiturn_800.json").read_text())
    firsts = [(c["id"], p[0]) for c in convs if (p := sharegpt_first_pair(c)) is not None and p[0].strip()]
    picked = sorted(rng.choice(len(firsts), min(n_sharegpt, len(firsts)), replace=False).tolist())
    out += [(f"sharegpt-{firsts[i][0]}", "sharegpt", firsts[i][1]) for i in picked]
    return out


def prompt_texts() -> dict[str, str]:
    """The sample of record's prompt texts by id (what the results file's ids refer to)."""
    return {pid: text for pid, _, text in sample_prompts(*SAMPLE)}


def chat_ids(tokenizer: object, text: str) -> list[int]:
    """The token ids /v1/chat/completions runs for one user message."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--alpaca", type=int, default=SAMPLE[0])
    ap.add_argument("--sharegpt", type=int, default=SAMPLE[1])
    ap.add_argument("--seed", type=int, default=SAMPLE[2])
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--batch", type=int, default=48, help="requests in flight")
    ap.add_argument("--limit", type=int, default=None, help="answer only this many (timing)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--drain-file", type=Path, default=None,
                    help="once this file exists, start no new prompts and finish those in flight")
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    done = {json.loads(line)["id"] for line in a.out.read_text().splitlines()} if a.out.is_file() else set()
    t0 = time.perf_counter()
    llm = LLM(MODEL, max_model_len=MAX_MODEL_LEN, max_batch_size=a.batch, compile=a.compile)
    print(f"loaded {MODEL} in {time.perf_counter() - t0:.1f}s", flush=True)
    tok, engine = llm.tokenizer, llm.engine
    todo, too_long = [], 0
    for pid, source, text in sample_prompts(a.alpaca, a.sharegpt, a.seed):
        ids = chat_ids(tok, text)
        if len(ids) > MAX_PROMPT_TOKENS:
            too_long += 1
        elif pid not in done:
            todo.append((pid, source, ids))
    # One fixed shuffle: any prefix of the run is a random mix of both sources.
    todo = [todo[i] for i in np.random.default_rng(a.seed).permutation(len(todo))]
    todo = todo[:a.limit] if a.limit is not None else todo
    print(f"{len(todo)} to answer ({len(done)} done before, {too_long} prompts over {MAX_PROMPT_TOKENS} tokens "
          "left out)", flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    TOKENS.parent.mkdir(parents=True, exist_ok=True)
    meta = {pid: (source, len(ids)) for pid, source, ids in todo}
    queue = list(reversed(todo))
    answers: dict[str, list[int]] = {}  # token ids so far of the requests in flight
    live, answered, tokens, start = 0, 0, 0, time.perf_counter()
    with open(a.out, "a") as res, open(TOKENS, "a") as cache:
        while queue or live:
            if a.drain_file is not None and a.drain_file.exists() and queue:
                print(f"{a.drain_file} exists: no new prompts; finishing the {live} in flight", flush=True)
                queue.clear()  # a prefix of the fixed order, every answer of it complete
            while queue and live < a.batch:
                pid, _, ids = queue.pop()
                engine.add_request(ids, params, request_id=pid)
                live += 1
            for out in engine.step():
                got = answers.setdefault(out.request_id, [])
                got.extend(out.new_token_ids)
                if not out.finished:
                    continue
                live -= 1
                answered += 1
                source, n_prompt = meta[out.request_id]
                req_ids = answers.pop(out.request_id)
                tokens += len(req_ids)
                res.write(json.dumps({"id": out.request_id, "source": source,
                                      "split": "test" if is_test(out.request_id) else "train",
                                      "prompt_tokens": n_prompt, "output_tokens": len(req_ids),
                                      "finish_reason": out.finish_reason}) + "\n")
                cache.write(json.dumps({"id": out.request_id, "output_token_ids": req_ids}) + "\n")
                res.flush()
                cache.flush()
                if answered % 20 == 0:
                    el = time.perf_counter() - start
                    print(f"{answered}/{len(todo)} answered, {el:.0f}s, {tokens / el:.1f} output tok/s", flush=True)
    el = time.perf_counter() - start
    print(f"done: {answered} answers, {tokens} output tokens in {el:.0f}s ({tokens / max(el, 1e-9):.1f} tok/s)")
    llm.close()


if __name__ == "__main__":
    main()
