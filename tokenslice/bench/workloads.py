"""Workloads: who asks what, and when (docs/DESIGN.md, "Benchmark protocols").

A workload is a list of `WorkloadRequest` (arrival time, prompt and output lengths, optional
user / priority / conversation). `make_workload` builds one from a dataset (datasets.py) or from
synthetic lengths (lengths.py), with arrivals from arrivals.py. Everything is deterministic from
one seed. No torch here.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from tokenslice.bench.arrivals import arrival_times
from tokenslice.bench.datasets import DatasetCache, filter_lengths, resolve_dataset
from tokenslice.bench.lengths import LengthDist, scale_io_ratio

WORKLOAD_NAMES = ("alpaca", "sharegpt", "sharegpt-multiturn", "synthetic-fixed", "synthetic-zipf",
                  "synthetic-lognormal")


@dataclass
class WorkloadRequest:
    """One request of a workload. `prompt` is None when no text matches `prompt_len` (synthetic or
    rescaled lengths); a client then synthesises a prompt of `prompt_len` tokens."""

    request_id: str
    arrival_time: float  # seconds from the start of the run
    prompt: str | None
    prompt_len: int
    output_len: int  # tokens to generate (sent as max_tokens with ignore_eos)
    user: str | None = None
    priority: int | None = None
    conversation_id: str | None = None
    turn: int = 0
    prompt_token_ids: list[int] | None = None
    # Output length a predictor expects (srpt-predicted); None: none given. Set by the simulator's
    # SweepSpec.length_predictor, never by make_workload.
    predicted_output_tokens: int | None = None


def sample_indices(pool_size: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """n indices into a pool: without replacement when n <= pool_size, else with replacement."""
    if pool_size <= 0:
        raise ValueError("cannot sample from an empty dataset (after filtering)")
    return rng.choice(pool_size, size=n, replace=n > pool_size)


def _fit_ids(ids: Sequence[int], length: int) -> list[int]:
    """Truncate or cycle token ids to `length`, so a rescaled request still has a real-text prompt."""
    if not ids:
        return []
    reps = -(-length // len(ids))
    return (list(ids) * reps)[:length]


def parse_user_shares(text: str) -> list[float]:
    """"10,1,1,1" -> [10.0, 1.0, 1.0, 1.0] (--user-shares)."""
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"user shares must be comma-separated numbers, got {text!r}") from None


def check_user_shares(shares: Sequence[float], num_users: int | None) -> np.ndarray:
    out = np.asarray(shares, dtype=np.float64)
    if len(out) == 0 or not np.all(np.isfinite(out)) or np.any(out <= 0):
        raise ValueError(f"user shares must be positive numbers, got {list(shares)}")
    if num_users is not None and num_users != len(out):
        raise ValueError(f"{len(out)} user shares for {num_users} users")
    return out


def make_workload(name: str, *, num_requests: int, rate: float | None = None, cv: float = 1.0, seed: int = 0,
                  dataset: str | Path | None = None, tokenizer: str | Path | None = None,
                  max_tokens_cap: int | None = None, max_prompt_len: int | None = None,
                  io_ratio: float | None = None, length_filter: bool = False,
                  input_len: int = 128, output_len: int = 128, zipf_theta: float = 1.5, sigma: float = 1.0,
                  min_len: int = 1, max_len: int = 2048,
                  input_dist: LengthDist | None = None, output_dist: LengthDist | None = None,
                  num_users: int | None = None, num_priorities: int | None = None,
                  user_shares: Sequence[float] | None = None,
                  cache: DatasetCache | None = None) -> list[WorkloadRequest]:
    """Build a workload by name (WORKLOAD_NAMES), deterministic from `seed`.

    Datasets ("alpaca", "sharegpt", "sharegpt-multiturn") need `dataset` (file or directory) and
    `tokenizer` (a local HF tokenizer directory). "sharegpt-multiturn" yields each conversation's
    first turn with its conversation id; later turns depend on responses and are the client's job.
    Synthetic: "synthetic-fixed" uses input_len/output_len; "synthetic-zipf" draws both from
    Zipf(zipf_theta) over [min_len, max_len]; "synthetic-lognormal" draws with means
    input_len/output_len and log-std sigma, capped to [min_len, max_len]. input_dist/output_dist
    override these.

    Order of operations: length filter -> sample requests -> io_ratio rescale -> caps
    (max_prompt_len truncates prompts, max_tokens_cap caps outputs). Arrivals, request choice,
    lengths and user/priority labels use independent streams spawned from `seed`, so e.g. the
    arrival times at a seed are the same for every workload of the same size and rate.

    Users: `num_users` spreads requests uniformly; `user_shares` (e.g. [10, 1, 1, 1]: one heavy
    user with 10x each other's rate) draws each request's user with probability proportional to
    its share.
    """
    if name not in WORKLOAD_NAMES:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOAD_NAMES)}")
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    rng_pick, rng_len, rng_arrive, rng_label = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4))

    prompts: list[str | None]
    token_ids: list[list[int] | None]
    conv_ids: list[str | None] = [None] * num_requests
    if name in ("alpaca", "sharegpt", "sharegpt-multiturn"):
        kind = "alpaca" if name == "alpaca" else "sharegpt"
        if tokenizer is None:
            raise ValueError(f"workload {name!r} needs a tokenizer directory to count tokens")
        pool = (cache or DatasetCache()).records(kind, resolve_dataset(kind, dataset), tokenizer)
        if length_filter:
            pool = filter_lengths(pool)
        picked = [pool[i] for i in sample_indices(len(pool), num_requests, rng_pick)]
        p_lens = np.array([r.prompt_len for r in picked], dtype=np.int64)
        o_lens = np.array([r.output_len for r in picked], dtype=np.int64)
        prompts = [r.prompt for r in picked]
        token_ids = [list(r.prompt_token_ids) for r in picked]
        if name == "sharegpt-multiturn":
            conv_ids = [r.conversation_id for r in picked]
    else:
        kind_of = {"synthetic-fixed": "fixed", "synthetic-zipf": "zipf", "synthetic-lognormal": "lognormal"}[name]
        in_d = input_dist or LengthDist(kind_of, value=input_len, theta=zipf_theta, sigma=sigma, min_len=min_len,
                                        max_len=max(max_len, input_len if kind_of == "fixed" else min_len))
        out_d = output_dist or LengthDist(kind_of, value=output_len, theta=zipf_theta, sigma=sigma, min_len=min_len,
                                          max_len=max(max_len, output_len if kind_of == "fixed" else min_len))
        p_lens = in_d.sample(rng_len, num_requests)
        o_lens = out_d.sample(rng_len, num_requests)
        prompts = [None] * num_requests
        token_ids = [None] * num_requests

    if io_ratio is not None and num_requests > 0:
        p_lens, o_lens = scale_io_ratio(p_lens, o_lens, io_ratio)
    if max_prompt_len is not None:
        p_lens = np.minimum(p_lens, max_prompt_len)
    if max_tokens_cap is not None:
        o_lens = np.minimum(o_lens, max_tokens_cap)
    # Zero-length outputs (empty responses) still generate one token when sent with max_tokens.
    o_lens = np.maximum(o_lens, 1)

    arrivals = arrival_times(num_requests, rate, cv, rng_arrive)
    if user_shares is not None:
        shares = check_user_shares(user_shares, num_users)
        users = rng_label.choice(len(shares), size=num_requests, p=shares / shares.sum())
    else:
        users = rng_label.integers(num_users, size=num_requests) if num_users else None
    prios = rng_label.integers(num_priorities, size=num_requests) if num_priorities else None

    out = []
    for i in range(num_requests):
        plen = int(p_lens[i])
        ids = token_ids[i]
        text = prompts[i]
        if ids is not None and plen != len(ids):
            ids, text = _fit_ids(ids, plen), None  # the text no longer matches the length
        out.append(WorkloadRequest(
            request_id=f"req-{i}", arrival_time=float(arrivals[i]), prompt=text, prompt_len=plen,
            output_len=int(o_lens[i]), user=f"user-{users[i]}" if users is not None else None,
            priority=int(prios[i]) if prios is not None else None, conversation_id=conv_ids[i],
            turn=0, prompt_token_ids=ids))
    return out


# Tokens of the context left free for what the server adds to a text prompt (a BOS token, a chat
# template) and for a tokenizer counting differently from the bench's; token-id prompts need none.
TEXT_SLACK_TOKENS = 32


def fit_context(requests: Sequence[WorkloadRequest], max_model_len: int | None,
                client: Any = None) -> tuple[list[WorkloadRequest], int]:
    """The requests with prompt + output within the server's context (`max_model_len`; None: as
    they are), and how many were changed. Outputs are shortened first; a prompt that leaves no room
    is cut so that the output keeps up to half the context. `client` (a ClientConfig) says how
    prompts are sent: as token ids (exact) or as text (TEXT_SLACK_TOKENS kept free)."""
    if max_model_len is None:
        return list(requests), 0
    as_ids = client is not None and client.endpoint == "completions"
    out, capped = [], 0
    for r in requests:
        ids = as_ids and (client.prompt_format == "synthetic" or r.prompt is None)
        limit = max(2, max_model_len - (0 if ids else TEXT_SLACK_TOKENS))
        if r.prompt_len + r.output_len <= limit:
            out.append(r)
            continue
        capped += 1
        plen = r.prompt_len if r.prompt_len < limit else limit - min(r.output_len, limit // 2)
        changes: dict[str, Any] = {"prompt_len": plen, "output_len": max(1, min(r.output_len, limit - plen))}
        if plen != r.prompt_len:  # the text no longer matches the length: send its ids, cut
            changes.update(prompt=None, prompt_token_ids=_fit_ids(r.prompt_token_ids or [], plen) or None)
        out.append(replace(r, **changes))
    return out, capped


def workload_stats(requests: Sequence[WorkloadRequest]) -> dict[str, float]:
    """Means and medians of lengths, offered rate: for reports and sanity checks."""
    if not requests:
        return {"num_requests": 0}
    p = np.array([r.prompt_len for r in requests], dtype=float)
    o = np.array([r.output_len for r in requests], dtype=float)
    span = max(r.arrival_time for r in requests) - min(r.arrival_time for r in requests)
    return {"num_requests": len(requests), "prompt_mean": float(p.mean()), "prompt_median": float(np.median(p)),
            "output_mean": float(o.mean()), "output_median": float(np.median(o)),
            "offered_rps": (len(requests) - 1) / span if span > 0 else math.inf}


def save_workload(path: str | Path, requests: Sequence[WorkloadRequest]) -> None:
    """One JSON object per line, so a trace can be replayed by the engine or the client."""
    with Path(path).open("w") as f:
        for r in requests:
            f.write(json.dumps(asdict(r)) + "\n")


def load_workload(path: str | Path) -> list[WorkloadRequest]:
    with Path(path).open() as f:
        return [WorkloadRequest(**json.loads(line)) for line in f if line.strip()]


__all__ = ["WORKLOAD_NAMES", "TEXT_SLACK_TOKENS", "WorkloadRequest", "sample_indices", "parse_user_shares",
           "check_user_shares", "fit_context", "make_workload", "workload_stats", "save_workload", "load_workload"]
