"""Token sampling: greedy, temperature, top-k, top-p, min_p, min_tokens, logit_bias and the
presence / frequency / repetition penalties. Every request has an RNG stream of its own (its seed,
or base_seed and the order it first drew in), so it draws the same tokens whatever else shares its
batch; greedy rows draw nothing.

Every control acts on the whole batch at once (small per-row parameter tensors, as vLLM's sampler
builds) and costs nothing when no request in the batch asks for it; random rows draw together
(`_draw`), in a fixed number of tensor ops that stay on the logits' device until the one read of
the tokens at the end. Order as vLLM: logit bias, then penalties, then greedy choice; min_p after
temperature, then top-k, then top-p. Rows with a grammar (structured outputs, model/grammar.py)
are masked to the tokens it allows last, so nothing after can bring a banned token back."""
from __future__ import annotations

import random
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tokenslice.plan import SeqSlice
from tokenslice.request import SamplingParams

if TYPE_CHECKING:  # xgrammar's import (half a second) waits for the first structured request
    from tokenslice.model.grammar import GrammarMasks, Grammars

MAX_TEMPERATURE = 1e4
TOP_P_CANDIDATES = 256
NO_TOP_P = 2.0  # above any prefix's share of the mass: drops nothing


class Sampler:
    def __init__(self, device: torch.device, base_seed: int) -> None:
        self.device = device
        self.base_seed = base_seed
        # One stream per request, on the host: a draw is one number per row, not a device launch.
        self._generators: dict[str, random.Random] = {}
        self._unseeded = 0
        # Structured outputs: where this process's compiled grammars come from (the engine's, or a
        # worker's own), asked at the first constrained row.
        self.grammar_source: Callable[[], Grammars] | None = None
        self._masks: GrammarMasks | None = None

    def _grammar_masks(self) -> GrammarMasks:
        if self._masks is None:
            if self.grammar_source is None:
                raise RuntimeError("a request asks for structured output, and this sampler has no grammars")
            from tokenslice.model.grammar import GrammarMasks

            self._masks = GrammarMasks(self.grammar_source())
        return self._masks

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)
        if self._masks is not None:
            self._masks.forget(request_ids)

    def _generator(self, s: SeqSlice) -> random.Random:
        g = self._generators.get(s.request_id)
        if g is None:
            seed = s.params.seed
            if seed is None:  # deterministic per engine run, distinct per request
                self._unseeded += 1
                seed = self.base_seed * 1_000_003 + self._unseeded
            # Modulo 2^64 as torch.Generator takes it: random.Random would seed -s and s alike.
            g = self._generators[s.request_id] = random.Random(seed % 2**64)
        return g

    def _tensor(self, values: list[int] | list[float], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return self._to_device(torch.tensor(values, dtype=dtype))

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the sampler's device; on CUDA through pinned memory, as a copy from
        pageable memory waits for the stream (the forward) to finish."""
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def sample(self, logits: torch.Tensor, slices: list[SeqSlice]) -> list[int]:
        """logits: [len(slices), vocab] in fp32, one row per sampling slice (overwritten); a fixed
        number of batched tensor ops whatever the rows ask, and one read of the tokens at the end."""
        params = [s.params for s in slices]
        self._ban_stops_before_min_tokens(logits, slices)
        if any(p.logit_bias for p in params):
            self._apply_logit_bias(logits, slices)
        if any(p.penalized for p in params):
            self._apply_penalties(logits, slices)
        constrained = [i for i, p in enumerate(params) if p.structured is not None]
        if constrained:
            masks = self._grammar_masks()
            matchers = [masks.matcher(slices[i].request_id, params[i].structured) for i in constrained]
            masks.apply(logits, constrained, matchers)
        out = logits.argmax(dim=-1)
        if any(p.temperature > 0.0 for p in params):
            rows, tokens = self._draw(logits, slices)
            out[rows] = tokens
        tokens = out.tolist()
        if constrained:
            masks.accept(matchers, [tokens[i] for i in constrained])
        return tokens

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
            logits[self._tensor(rows), self._tensor(ids)] = float("-inf")

    def _draw(self, logits: torch.Tensor, slices: list[SeqSlice]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, tokens) for the rows with a temperature: one token each from its distribution
        after temperature, min_p, top-k and top-p (in that order), by inverse transform: one
        uniform number per row, from the row's own stream, against the row's cumulative mass (on
        CPU a vocabulary of exponential or Gumbel noise costs ten times the rest of the draw).
        Rows with top-k or top-p draw among their most likely tokens, the others over the vocabulary."""
        vocab = logits.shape[-1]
        few: list[int] = []
        whole: list[int] = []
        for i, s in enumerate(slices):
            p = s.params
            if p.temperature > 0.0:
                (few if 0 < p.top_k < vocab or p.top_p < 1.0 else whole).append(i)
        rows = few + whole
        table = array("d")
        for i in rows:
            p = slices[i].params
            # Past ~1e4 the distribution is uniform anyway; larger temperatures would overflow to NaN.
            table.extend((i, min(p.temperature, MAX_TEMPERATURE), p.min_p, p.top_k if 0 < p.top_k < vocab else 0,
                          p.top_p if p.top_p < 1.0 else NO_TOP_P, self._generator(slices[i]).random()))
        # One copy to the device for all rows' parameters; from a buffer, 4x cheaper than from a list.
        t = self._to_device(torch.frombuffer(table, dtype=torch.float64).view(len(rows), 6))
        index = t[:, 0].long()
        temp, min_p, top_k, top_p = t[:, 1:5].to(logits.dtype).unbind(1)
        uniform = t[:, 5]
        x = logits if rows == list(range(len(slices))) else logits[index]
        x.div_(temp[:, None])
        x.sub_(x.amax(dim=-1, keepdim=True)).exp_()  # unnormalised probabilities in place, the largest 1
        if any(slices[i].params.min_p > 0.0 for i in rows):  # keep p_i >= min_p * p_max
            x.masked_fill_(x < min_p[:, None], 0.0)
        n = len(few)
        parts = []
        if few:
            parts.append(_draw_among_top(x[:n], [slices[i].params for i in few], top_k[:n], top_p[:n], uniform[:n]))
        if whole:
            parts.append(_search(x[n:].cumsum_(dim=-1), uniform[n:]))
        return index, parts[0] if len(parts) == 1 else torch.cat(parts)

    def _apply_logit_bias(self, logits: torch.Tensor, slices: list[SeqSlice]) -> None:
        rows, cols, bias = [], [], []
        for i, s in enumerate(slices):
            for tok, b in s.params.logit_bias.items():
                rows.append(i)
                cols.append(tok)
                bias.append(b)
        index = (self._tensor(rows), self._tensor(cols))
        logits.index_put_(index, self._tensor(bias, logits.dtype), accumulate=True)

    def _apply_penalties(self, logits: torch.Tensor, slices: list[SeqSlice]) -> None:
        """Presence and frequency penalties over each row's output tokens (OpenAI), repetition
        penalty over prompt and output (Keskar et al., CTRL §4.1, as vLLM and transformers apply it);
        at the (row, token) pairs of the histories only, never over a row's whole vocabulary."""
        seen_rows: list[int] = []
        seen_ids: list[int] = []
        out_rows: list[int] = []
        out_ids: list[int] = []
        table = array("d")
        for i, s in enumerate(slices):
            p = s.params
            table.extend((p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
            if p.penalized:
                history = s.history_token_ids
                seen_rows += [i] * len(history)
                seen_ids += history
                out_rows += [i] * s.num_output_tokens
                out_ids += history[len(history) - s.num_output_tokens:]
        t = self._to_device(torch.frombuffer(table, dtype=torch.float64).view(len(slices), 3).to(logits.dtype))
        # A pair seen twice is written twice with the same value: a plain index_put stays exact.
        seen = (self._tensor(seen_rows), self._tensor(seen_ids))
        rep = t[seen[0], 0]
        v = logits[seen]
        logits[seen] = torch.where(v > 0, v / rep, v * rep)
        out = (self._tensor(out_rows), self._tensor(out_ids))
        logits.index_put_(out, -t[out[0], 1], accumulate=True)  # frequency: once per occurrence
        logits[out] = logits[out] - t[out[0], 2]  # presence: once per token


def _draw_among_top(mass: torch.Tensor, params: list[SamplingParams], top_k: torch.Tensor, top_p: torch.Tensor,
                    uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of unnormalised probabilities `mass`: among the row's top_k most likely
    (0: all), the smallest prefix that reaches top_p of their mass (the first token always stays:
    a top_p below float32's range must leave one). From the largest top_k, or with a row that has
    top-p alone the TOP_P_CANDIDATES, most likely tokens when they hold every kept one (on CPU a
    topk of 256 is far cheaper than sorting a vocabulary), else from the whole sorted vocabulary.
    On CUDA such rows sort at once: checking would read the device mid-step."""
    vocab = mass.shape[-1]
    top_k_max = max((p.top_k for p in params if 0 < p.top_k < vocab), default=0)
    top_p_alone = any(p.top_p < 1.0 and not 0 < p.top_k < vocab for p in params)
    has_k = top_k > 0
    total = mass.sum(dim=-1) if top_p_alone else None
    if top_p_alone and mass.is_cuda:
        vals, ids = mass.sort(dim=-1, descending=True)
    else:
        vals, ids = mass.topk(min(vocab, max(top_k_max, TOP_P_CANDIDATES if top_p_alone else 0)), dim=-1)
        if total is not None:
            need = torch.where(has_k | (top_p >= NO_TOP_P), 0.0, top_p * total)
            if not bool((vals.sum(dim=-1) >= need).all()):
                vals, ids = mass.sort(dim=-1, descending=True)
    if top_k_max:
        column = torch.arange(vals.shape[-1], device=vals.device)
        vals = vals.masked_fill(column >= torch.where(has_k, top_k, vocab)[:, None], 0.0)
    if any(p.top_p < 1.0 for p in params):
        norm = vals.sum(dim=-1) if total is None else torch.where(has_k, vals.sum(dim=-1), total)
        drop = (vals.cumsum(dim=-1) - vals) >= (top_p * norm)[:, None]
        drop[:, 0] = False
        vals = vals.masked_fill(drop, 0.0)
    return ids.gather(1, _search(vals.cumsum(dim=-1), uniform)[:, None])[:, 0]


def _search(cdf: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the first column whose cumulative mass `cdf` exceeds uniform x the row's total:
    column j with probability mass_j / total (rows need not be normalized; zero mass is never taken)."""
    total = cdf[:, -1:]
    # Strictly below the total, so the search never steps past the last column with mass.
    target = torch.minimum((uniform[:, None] * total).to(cdf.dtype), torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[:, 0]
