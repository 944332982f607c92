"""Log-probabilities of sampled and prompt tokens from raw logits (vLLM's default "raw_logprobs":
before temperature, top-k/top-p and any other logit processing).

Computed only for the rows whose request asks, in one batched log_softmax + topk; prompt rows
go through the LM head in chunks so that a long prompt never holds [prompt_len, vocab] logits.
Results are plain lists (request.TokenLogprobs): they cross process borders.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenslice.request import TokenLogprobs

PROMPT_ROWS_PER_CHUNK = 256  # x vocab x 4 bytes of fp32 logits at a time (32 MiB at a 32k vocab)
# Vocabulary rows of a bf16/fp16 head upcast at a time for float32 logits (64 MiB at hidden 2048).
HEAD_ROWS_PER_CHUNK = 8192


def float32_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Logits in float32 from the head's own weights, for logprobs: a quantized head or a bf16
    one rounds its logits (bf16 keeps 8 bits: log-likelihoods move in steps of 1/64). The loader
    keeps `exact_head_weight` only where the head's logits are not float32 already."""
    weight = getattr(model, "exact_head_weight", None)
    if weight is None:
        return model.compute_logits(hidden).float()
    h = hidden.float()
    if weight.dtype == torch.float32:
        return F.linear(h, weight)
    return torch.cat([F.linear(h, weight[i:i + HEAD_ROWS_PER_CHUNK].float())
                      for i in range(0, weight.shape[0], HEAD_ROWS_PER_CHUNK)], dim=1)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, ks: list[int],
                   ranks: bool = False) -> list[TokenLogprobs]:
    """One TokenLogprobs (of one position) per row: the log-probability of `token_ids[row]` and
    the `ks[row]` most likely tokens; with `ranks`, the token's rank too (one more pass over the
    vocabulary: only prompt logprobs report it). logits: [rows, vocab] raw fp32."""
    logits = logits.float()
    # log_softmax(x)[i] = x[i] - logsumexp(x): only the values reported are shifted, so the
    # [rows, vocab] log-probabilities are never written (top-k of x and of log_softmax(x) agree).
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    chosen_t = logits.gather(1, token_ids.view(-1, 1))
    kmax = max(ks, default=0)
    # Everything reported in one float64 table (exact for fp32 values and token ids): one device read.
    parts = [chosen_t - lse, token_ids.view(-1, 1)]
    if ranks:
        parts.append((logits > chosen_t).sum(dim=-1, keepdim=True) + 1)
    if kmax:
        vals, idx = torch.topk(logits, kmax, dim=-1)
        parts += [vals - lse, idx]
    table = torch.cat([t.double() for t in parts], dim=1).cpu()
    chosen = table[:, 0].tolist()
    ids = table[:, 1].long().tolist()
    rank_list = table[:, 2].long().tolist() if ranks else []
    top_vals: list[list[float]] = [[] for _ in ks]
    top_ids: list[list[int]] = [[] for _ in ks]
    if kmax:
        start = 3 if ranks else 2
        all_vals, all_ids = table[:, start:start + kmax].tolist(), table[:, start + kmax:].long().tolist()
        top_vals = [v[:k] for v, k in zip(all_vals, ks, strict=True)]
        top_ids = [t[:k] for t, k in zip(all_ids, ks, strict=True)]
    return [TokenLogprobs([t], [c], rank_list[i:i + 1], [ti], [tv])
            for i, (t, c, ti, tv) in enumerate(zip(ids, chosen, top_ids, top_vals, strict=True))]


def prompt_logprobs(hidden: torch.Tensor, rows: list[int], targets: list[int], k: int,
                    compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> TokenLogprobs:
    """Log-probabilities of `targets` (the next prompt token of each row) at `rows` of `hidden`,
    with the top `k` alternatives; the LM head runs over at most PROMPT_ROWS_PER_CHUNK rows at once."""
    out = TokenLogprobs()
    device = hidden.device
    for i in range(0, len(rows), PROMPT_ROWS_PER_CHUNK):
        r = torch.tensor(rows[i:i + PROMPT_ROWS_PER_CHUNK], device=device)
        t = torch.tensor(targets[i:i + PROMPT_ROWS_PER_CHUNK], device=device)
        for one in token_logprobs(compute_logits(hidden[r]), t, [k] * len(r), ranks=True):
            out.extend(one)
    return out
