"""Token sampling: greedy, temperature, top-k, top-p, min_p, min_tokens, logit_bias and the
presence / frequency / repetition penalties. A seeded request has an RNG stream of its own, so it
draws the same tokens whatever else shares its batch; unseeded ones share the engine's stream.

Every control acts on the whole batch at once (a few tensors built from the rows that use them,
as vLLM's sampler does) and costs nothing when no request in the batch asks for it; random rows
draw together (`_draw`). Order as vLLM: logit bias, then penalties, then greedy choice; min_p
after temperature, then top-k, then top-p."""
from __future__ import annotations

import math

import torch

from tokenslice.plan import SeqSlice

MAX_TEMPERATURE = 1e4


class Sampler:
    def __init__(self, device: torch.device, base_seed: int) -> None:
        self.device = device
        self.base_seed = base_seed
        self._generators: dict[str, torch.Generator] = {}  # seeded requests' own streams
        # Unseeded requests draw from one stream, in batch order: deterministic per engine run.
        self._shared = torch.Generator(device=device).manual_seed(base_seed * 1_000_003)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)

    def _generator(self, s: SeqSlice) -> torch.Generator:
        g = self._generators.get(s.request_id)
        if g is None:
            g = self._generators[s.request_id] = torch.Generator(device=self.device).manual_seed(s.params.seed)
        return g

    def sample(self, logits: torch.Tensor, slices: list[SeqSlice]) -> list[int]:
        """logits: [len(slices), vocab] in fp32, one row per sampling slice; a fixed number of
        batched tensor ops whatever the rows ask, and one read of the tokens at the end."""
        params = [s.params for s in slices]
        self._ban_stops_before_min_tokens(logits, slices)
        if any(p.logit_bias for p in params):
            self._apply_logit_bias(logits, slices)
        if any(p.penalized for p in params):
            self._apply_penalties(logits, slices)
        out = logits.argmax(dim=-1)  # stays on the device: one host sync per step, at the end
        rows = [i for i, p in enumerate(params) if p.temperature > 0.0]
        if rows:
            index = torch.tensor(rows, device=self.device)
            out[index] = self._draw(logits[index], [slices[i] for i in rows])
        return out.tolist()

    def _ban_stops_before_min_tokens(self, logits: torch.Tensor, slices: list[SeqSlice]) -> None:
        rows: list[int] = []
        ids: list[int] = []
        for i, s in enumerate(slices):
            if s.num_output_tokens < s.params.min_tokens:
                banned = list(s.params.stop_token_ids)
                if s.eos_token_id is not None and not s.params.ignore_eos:
                    banned.append(s.eos_token_id)
                rows += [i] * len(banned)
                ids += banned
        if rows:
            logits[torch.tensor(rows, device=self.device), torch.tensor(ids, device=self.device)] = float("-inf")

    def _draw(self, logits: torch.Tensor, slices: list[SeqSlice]) -> torch.Tensor:
        """One token per row from its distribution after temperature, min_p, top-k and top-p (in
        that order), by inverse transform: one uniform number per row (a seeded row's from its own
        generator, so its tokens do not depend on the batch) against the row's cumulative mass.
        One number per row, not one per token: on CPU a vocabulary of exponential or Gumbel noise
        costs ten times the rest of the draw. Top-p rows draw among their candidates only."""
        dev, vocab = self.device, logits.shape[-1]
        params = [s.params for s in slices]
        # Past ~1e4 the distribution is uniform anyway; larger values would overflow to NaN.
        temp = torch.tensor([min(p.temperature, MAX_TEMPERATURE) for p in params], dtype=logits.dtype, device=dev)
        logits = logits / temp[:, None]
        if any(p.min_p > 0.0 for p in params):  # p_i >= min_p * p_max, in log space
            floor = torch.tensor([math.log(p.min_p) if p.min_p > 0.0 else -math.inf for p in params],
                                 dtype=logits.dtype, device=dev)
            logits = logits.masked_fill(logits - logits.max(dim=-1, keepdim=True).values < floor[:, None],
                                        float("-inf"))
        topk_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
        if topk_rows:  # the k-th largest logit of each such row, from one topk over the largest k
            index = self._index(topk_rows, len(params))
            k = torch.tensor([params[i].top_k for i in topk_rows], device=dev)
            sub = logits if index is None else logits[index]
            sub = sub.masked_fill(sub < sub.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None]),
                                  float("-inf"))
            if index is None:
                logits = sub
            else:
                logits[index] = sub
        probs = torch.softmax(logits, dim=-1)
        uniform = self._uniform(slices)
        topp_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
        if not topp_rows:
            return _inverse_cdf(probs, uniform)
        tokens = torch.empty(len(params), dtype=torch.long, device=dev)
        index = self._index(topp_rows, len(params))
        top_p = torch.tensor([params[i].top_p for i in topp_rows], dtype=probs.dtype, device=dev)
        kept, ids = _top_p(probs if index is None else probs[index], top_p)
        picked = ids.gather(1, _inverse_cdf(kept, uniform if index is None else uniform[index])[:, None])[:, 0]
        if index is None:
            return picked
        tokens[index] = picked
        rest = self._index([i for i, p in enumerate(params) if p.top_p >= 1.0], len(params))
        tokens[rest] = _inverse_cdf(probs[rest], uniform[rest])
        return tokens

    def _index(self, rows: list[int], n: int) -> torch.Tensor | None:
        """`rows` as an index tensor; None when they are all n rows (no gather needed)."""
        return None if len(rows) == n else torch.tensor(rows, device=self.device)

    def _uniform(self, slices: list[SeqSlice]) -> torch.Tensor:
        """One U[0, 1) number per row: unseeded rows' from the shared stream in one call, a
        seeded row's from its own."""
        dev = self.device
        uniform = torch.empty(len(slices), dtype=torch.float64, device=dev)
        shared = [i for i, s in enumerate(slices) if s.params.seed is None]
        if shared:
            uniform[torch.tensor(shared, device=dev)] = torch.rand(
                len(shared), dtype=torch.float64, device=dev, generator=self._shared)
        for i, s in enumerate(slices):
            if s.params.seed is not None:
                uniform[i] = torch.rand(1, dtype=torch.float64, device=dev, generator=self._generator(s))[0]
        return uniform

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


TOP_P_CANDIDATES = 256


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mass, token id) of each row's tokens, most likely first, the mass zeroed past the smallest
    prefix that reaches the row's top_p (the first token always stays: a top_p below float32's
    range must leave one). From the TOP_P_CANDIDATES most likely tokens when their mass reaches
    top_p in every row, which then hold every kept token (on CPU a topk of 256 is far cheaper
    than sorting a vocabulary), else from the whole sorted vocabulary."""
    vals, ids = probs.topk(min(TOP_P_CANDIDATES, probs.shape[-1]), dim=-1)
    if not bool((vals.sum(dim=-1) >= top_p).all()):
        vals, ids = probs.sort(dim=-1, descending=True)
    drop = (vals.cumsum(dim=-1) - vals) >= top_p[:, None]
    drop[:, 0] = False
    return vals.masked_fill(drop, 0.0), ids


def _inverse_cdf(mass: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the first column whose cumulative mass exceeds uniform x the row's total: column
    j with probability mass_j / total (rows need not be normalized; zero mass is never taken)."""
    cdf = mass.cumsum(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, so the search never steps past the last column with mass.
    target = torch.minimum((uniform[:, None] * total).to(cdf.dtype), torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[:, 0]
