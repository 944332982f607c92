"""Token sampling: greedy, temperature, top-k, top-p, min_p, min_tokens, logit_bias and the
presence / frequency / repetition penalties; one RNG stream per request so a seeded request draws
the same tokens whatever else shares its batch.

Bias, penalties and min_p act on the whole batch at once (a few tensors built from the rows that
use them, as vLLM's sampler does) and cost nothing when no request in the batch asks for them.
Order as vLLM: logit bias, then penalties, then greedy choice; min_p after temperature."""
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
        if any(s.params.logit_bias for s in slices):
            self._apply_logit_bias(logits, slices)
        if any(s.params.penalized for s in slices):
            self._apply_penalties(logits, slices)
        out = logits.argmax(dim=-1)  # stays on the device: one host sync per step, at the end
        if any(s.params.min_p > 0.0 and s.params.temperature > 0.0 for s in slices):
            self._apply_min_p(logits, slices)
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
            out[i] = torch.multinomial(probs, 1, generator=self._generator(s))[0]
        return out.tolist()

    def _apply_logit_bias(self, logits: torch.Tensor, slices: list[SeqSlice]) -> None:
        rows, cols, bias = [], [], []
        for i, s in enumerate(slices):
            for tok, b in s.params.logit_bias.items():
                rows.append(i)
                cols.append(tok)
                bias.append(b)
        index = (torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device))
        logits.index_put_(index, torch.tensor(bias, dtype=logits.dtype, device=self.device), accumulate=True)

    def _apply_penalties(self, logits: torch.Tensor, slices: list[SeqSlice]) -> None:
        """Presence and frequency penalties over each row's output tokens (OpenAI), repetition
        penalty over prompt and output (Keskar et al., CTRL §4.1, as vLLM and transformers apply it)."""
        rows = [i for i, s in enumerate(slices) if s.params.penalized]
        out_rows: list[int] = []
        out_ids: list[int] = []
        prompt_rows: list[int] = []
        prompt_ids: list[int] = []
        for j, i in enumerate(rows):
            s = slices[i]
            split = len(s.history_token_ids) - s.num_output_tokens
            prompt_ids += s.history_token_ids[:split]
            prompt_rows += [j] * split
            out_ids += s.history_token_ids[split:]
            out_rows += [j] * (len(s.history_token_ids) - split)
        dev = self.device
        index = torch.tensor(rows, device=dev)
        sub = logits[index]
        counts = torch.zeros_like(sub)
        counts.index_put_((torch.tensor(out_rows, dtype=torch.long, device=dev),
                           torch.tensor(out_ids, dtype=torch.long, device=dev)),
                          torch.ones(len(out_ids), dtype=sub.dtype, device=dev), accumulate=True)
        seen = counts > 0
        seen_anywhere = seen.clone()
        seen_anywhere[torch.tensor(prompt_rows, dtype=torch.long, device=dev),
                      torch.tensor(prompt_ids, dtype=torch.long, device=dev)] = True

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(slices[i].params, name) for i in rows], dtype=sub.dtype, device=dev)[:, None]

        rep = column("repetition_penalty")
        sub = torch.where(seen_anywhere, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - column("frequency_penalty") * counts - column("presence_penalty") * seen
        logits[index] = sub

    def _apply_min_p(self, logits: torch.Tensor, slices: list[SeqSlice]) -> None:
        """Keep tokens whose probability (at the row's temperature) is at least min_p times the
        most likely token's: log p_i - log p_max = (logit_i - logit_max) / T >= log(min_p)."""
        rows = [i for i, s in enumerate(slices) if s.params.min_p > 0.0 and s.params.temperature > 0.0]
        dev = self.device
        index = torch.tensor(rows, device=dev)
        sub = logits[index]
        temp = torch.tensor([min(slices[i].params.temperature, MAX_TEMPERATURE) for i in rows],
                            dtype=sub.dtype, device=dev)[:, None]
        floor = torch.tensor([slices[i].params.min_p for i in rows], dtype=sub.dtype, device=dev).log()[:, None]
        drop = (sub - sub.max(dim=-1, keepdim=True).values) / temp < floor
        logits[index] = sub.masked_fill(drop, float("-inf"))
