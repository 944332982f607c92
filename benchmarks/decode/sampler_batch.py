"""The sampler's cost per decode step (model/sampler.py `Sampler.sample`) on CPU, for a vocabulary
of SmolLM2's size (49,152), at batch 1 / 16 / 64 / 256 and four mixes of requests:
  greedy   temperature 0
  top-p    temperature 0.8, top_p 0.95, unseeded
  seeded   temperature 0.8, top_k 50, each row its own seed
  mixed    a quarter of each of the above, and a quarter with a repetition penalty (greedy)
Logits: a Zipf distribution (exponent 1.2, as language models' next-token distributions roughly
are) over each row's own random order of the vocabulary. Median microseconds per call and per row
over --reps calls (fresh logits each call, not timed).
Run it from another checkout (PYTHONPATH) to compare two versions of the sampler.

    PYTHONPATH=. .venv/bin/python benchmarks/decode/sampler_batch.py [--batches 1,16,64,256] [--reps 20]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from tokenslice.model.sampler import Sampler
from tokenslice.plan import SeqSlice
from tokenslice.request import SamplingParams

VOCAB = 49_152
MIXES = ("greedy", "top-p", "seeded", "mixed")


def params_for(mix: str, i: int) -> SamplingParams:
    kind = ("greedy", "top-p", "seeded", "penalty")[i % 4] if mix == "mixed" else mix
    if kind == "greedy":
        return SamplingParams(temperature=0.0)
    if kind == "top-p":
        return SamplingParams(temperature=0.8, top_p=0.95)
    if kind == "seeded":
        return SamplingParams(temperature=0.8, top_k=50, seed=i)
    return SamplingParams(temperature=0.0, repetition_penalty=1.2)


def rows(mix: str, batch: int) -> list[SeqSlice]:
    out = []
    for i in range(batch):
        p = params_for(mix, i)
        s = SeqSlice(f"r{i}", [1], 63, [0], True, p, 32)
        if p.penalized:
            s.history_token_ids = list(range(100 + i, 196 + i))
        out.append(s)
    return out


def measure(mix: str, batch: int, reps: int) -> float:
    sampler = Sampler(torch.device("cpu"), 0)
    slices = rows(mix, batch)
    gen = torch.Generator().manual_seed(batch)
    times = []
    zipf = -1.2 * torch.arange(1, VOCAB + 1, dtype=torch.float32).log()
    for _ in range(reps + 2):
        logits = zipf[torch.argsort(torch.rand(batch, VOCAB, generator=gen), dim=-1)]
        t = time.perf_counter()
        sampler.sample(logits, slices)
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:]) * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    print(f"{'mix':<8}{'batch':>6}{'us/call':>11}{'us/row':>9}  ({torch.get_num_threads()} threads)")
    for mix in MIXES:
        for batch in (int(b) for b in a.batches.split(",")):
            us = measure(mix, batch, a.reps)
            print(f"{mix:<8}{batch:>6}{us:>11.0f}{us / batch:>9.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
