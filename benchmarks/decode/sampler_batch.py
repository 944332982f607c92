"""The sampler's cost per decode step (model/sampler.py `Sampler.sample`) on CPU, for a vocabulary
of SmolLM2's size (49,152), at batch 1 / 16 / 64 / 256 and four mixes of requests:
  greedy   temperature 0
  top-p    temperature 0.8, top_p 0.95, unseeded
  seeded   temperature 0.8, top_k 50, each row its own seed
  mixed    a quarter of each of the above, and a quarter with a repetition penalty (greedy)
against `PerRowSampler`, a copy of the sampler as it was before it was batched (a Python loop over
the random rows: temperature, top-k, a sort for top-p and torch.multinomial, row by row).
Logits: a Zipf distribution (exponent 1.2, as language models' next-token distributions roughly
are) over each row's own random order of the vocabulary. Median microseconds per call and per row
over --reps calls (fresh logits each call, not timed). Prints a table; writes nothing.
Run it from another checkout (PYTHONPATH) to compare two versions of the sampler.

    PYTHONPATH=. .venv/bin/python benchmarks/decode/sampler_batch.py [--batches 1,16,64,256] [--reps 10] [--no-old]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from tokenslice.model.sampler import MAX_TEMPERATURE, Sampler
from tokenslice.plan import SeqSlice
from tokenslice.request import SamplingParams

VOCAB = 49_152
MIXES = ("greedy", "top-p", "seeded", "mixed")


class PerRowSampler(Sampler):
    """The per-row sampler this one replaced: bans, min_p and the draw row by row, one
    torch.Generator per request; bias and penalties as the batched sampler applies them."""

    def __init__(self, device: torch.device, base_seed: int) -> None:
        super().__init__(device, base_seed)
        self._torch_generators: dict[str, torch.Generator] = {}

    def _torch_generator(self, s: SeqSlice) -> torch.Generator:
        g = self._torch_generators.get(s.request_id)
        if g is None:
            seed = s.params.seed if s.params.seed is not None else self.base_seed * 1_000_003 + len(self._torch_generators)
            g = self._torch_generators[s.request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return g

    def sample(self, logits: torch.Tensor, slices: list[SeqSlice]) -> list[int]:
        for i, s in enumerate(slices):
            if s.num_output_tokens < s.params.min_tokens:
                banned = list(s.params.stop_token_ids)
                if s.eos_token_id is not None and not s.params.ignore_eos:
                    banned.append(s.eos_token_id)
                if banned:
                    logits[i, banned] = float("-inf")
        if any(s.params.logit_bias for s in slices):
            self._apply_logit_bias(logits, slices)
        if any(s.params.penalized for s in slices):
            self._apply_penalties(logits, slices)
        out = logits.argmax(dim=-1)
        for i, s in enumerate(slices):
            p = s.params
            if p.temperature == 0.0:
                continue
            row = logits[i] / min(p.temperature, MAX_TEMPERATURE)
            if p.min_p > 0.0:
                row = row.masked_fill(row - row.max() < torch.tensor(p.min_p).log(), float("-inf"))
            if 0 < p.top_k < row.shape[-1]:
                row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
            probs = torch.softmax(row, dim=-1)
            if p.top_p < 1.0:
                sorted_probs, order = torch.sort(probs, descending=True)
                drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= p.top_p
                drop[0] = False
                probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs.masked_fill(drop, 0.0))
            out[i] = torch.multinomial(probs, 1, generator=self._torch_generator(s))[0]
        return out.tolist()


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


def measure(cls: type[Sampler], mix: str, batch: int, reps: int) -> float:
    sampler = cls(torch.device("cpu"), 0)
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
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-old", action="store_true", help="time the current sampler only")
    a = p.parse_args()
    print(f"vocabulary {VOCAB}, {torch.get_num_threads()} threads; median us per call (per row)")
    print(f"{'mix':<8}{'batch':>6}{'per-row loop':>22}{'batched':>20}{'speed-up':>10}")
    for mix in MIXES:
        for batch in (int(b) for b in a.batches.split(",")):
            new = measure(Sampler, mix, batch, a.reps)
            old = None if a.no_old else measure(PerRowSampler, mix, batch, max(1, a.reps // 2) if batch > 16 else a.reps)
            old_cell = "" if old is None else f"{old:>12.0f} ({old / batch:>6.1f})"
            ratio = "" if old is None else f"{old / new:>9.1f}x"
            print(f"{mix:<8}{batch:>6}{old_cell:>22}{new:>12.0f} ({new / batch:>5.1f}){ratio:>10}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
