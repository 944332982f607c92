"""Token sampling: greedy, temperature, top-k, top-p, min_tokens; one RNG stream per request so a
seeded request draws the same tokens whatever else shares its batch."""
from __future__ import annotations

import torch

from tokenslice.plan import SeqSlice

MAX_TEMPERATURE = 1e4


class Sampler:
    def __init__(self, device: torch.device, base_seed: int) -> None:
        self.device = device
        self.base_seed = base_seed
        self._generators: dict[str, torch.Generator] = {}
        self._unseeded = 0

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)

    def _generator(self, s: SeqSlice) -> torch.Generator:
        g = self._generators.get(s.request_id)
        if g is None:
            if s.params.seed is not None:
                seed = s.params.seed
            else:  # deterministic per engine run, distinct per request
                self._unseeded += 1
                seed = self.base_seed * 1_000_003 + self._unseeded
            g = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[s.request_id] = g
        return g

    def sample(self, logits: torch.Tensor, slices: list[SeqSlice]) -> list[int]:
        """logits: [len(slices), vocab] in fp32, one row per sampling slice."""
        for i, s in enumerate(slices):
            if s.num_output_tokens < s.params.min_tokens:
                banned = list(s.params.stop_token_ids)
                if s.eos_token_id is not None and not s.params.ignore_eos:
                    banned.append(s.eos_token_id)
                if banned:
                    logits[i, banned] = float("-inf")
        out = logits.argmax(dim=-1).tolist()
        for i, s in enumerate(slices):
            p = s.params
            if p.temperature == 0.0:
                continue
            # Past ~1e4 the distribution is uniform anyway; larger values would overflow to NaN.
            row = logits[i] / min(p.temperature, MAX_TEMPERATURE)
            if 0 < p.top_k < row.shape[-1]:
                kth = torch.topk(row, p.top_k).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            probs = torch.softmax(row, dim=-1)
            if p.top_p < 1.0:
                sorted_probs, order = torch.sort(probs, descending=True)
                cum = torch.cumsum(sorted_probs, dim=-1)
                # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
                drop = (cum - sorted_probs) >= p.top_p
                drop[0] = False  # a top_p below float32's range must still leave a token
                sorted_probs = sorted_probs.masked_fill(drop, 0.0)
                probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
            out[i] = int(torch.multinomial(probs, 1, generator=self._generator(s)))
        return out
