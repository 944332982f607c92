"""Workloads: who asks what, and when (docs/DESIGN.md, "Benchmark protocols").

A workload is a list of `WorkloadRequest` (arrival time, prompt and output lengths, optional
user / priority / conversation). It comes from

- a dataset: Alpaca (`{instruction, input, output}`) or ShareGPT (`{id, conversations}`), token
  counts from a local Hugging Face tokenizer, cached in a `DatasetCache` object (in memory only);
- or synthetic lengths: fixed, Zipf(theta) over a range, or log-normal, each capped;

with arrivals that are Poisson, Gamma with a given coefficient of variation (bursty, CV > 1), or
all at once. Everything is deterministic from one seed. No torch here.

Priority patterns (FastSwitch §4): `PriorityPattern` / `PriorityUpdates` give every request an
initial priority level at arrival and new levels for the live requests every 1/f iterations.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

WORKLOAD_NAMES = ("alpaca", "sharegpt", "sharegpt-multiturn", "synthetic-fixed", "synthetic-zipf",
                  "synthetic-lognormal")

# File names looked for when --dataset names a directory rather than a file.
DEFAULT_DATASET_FILES: dict[str, tuple[str, ...]] = {
    "alpaca": ("alpaca_4500.json", "alpaca_data.json", "alpaca.json"),
    "sharegpt": ("sharegpt_multiturn_800.json", "ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt.json"),
}

# vLLM's benchmark filter: drop degenerate and over-long pairs so every request fits a 2k context.
FILTER_MIN_LEN = 4
FILTER_MAX_PROMPT = 1024
FILTER_MAX_TOTAL = 2048


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


@dataclass(frozen=True)
class DatasetRecord:
    """One (prompt, response) pair with its token counts under some tokenizer."""

    prompt: str
    prompt_len: int
    output_len: int
    prompt_token_ids: tuple[int, ...] = ()
    conversation_id: str | None = None
    turn: int = 0


@dataclass(frozen=True)
class Conversation:
    """A multi-turn ShareGPT conversation: (human, gpt) text pairs in order."""

    conversation_id: str
    turns: tuple[tuple[str, str], ...]


# ---------------------------------------------------------------- dataset text extraction

def alpaca_pairs(records: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """(prompt, response): instruction + "\\n" + input when input is non-empty, else instruction."""
    out = []
    for r in records:
        inp = r.get("input") or ""
        prompt = f"{r['instruction']}\n{inp}" if inp else r["instruction"]
        out.append((prompt, r.get("output") or ""))
    return out


def sharegpt_turns(record: dict[str, Any]) -> list[tuple[str, str]]:
    """(human, gpt) pairs in order, after skipping leading non-human turns (some records open with
    a gpt or system turn). A human turn not followed by a gpt turn is dropped."""
    conv = record.get("conversations") or []
    i = 0
    while i < len(conv) and conv[i].get("from") != "human":
        i += 1
    pairs = []
    while i + 1 < len(conv):
        if conv[i].get("from") == "human" and conv[i + 1].get("from") == "gpt":
            pairs.append((conv[i]["value"], conv[i + 1]["value"]))
            i += 2
        else:
            i += 1
    return pairs


def sharegpt_first_pair(record: dict[str, Any]) -> tuple[str, str] | None:
    """The first human->gpt pair after leading non-human turns, or None (record skipped)."""
    conv = record.get("conversations") or []
    i = 0
    while i < len(conv) and conv[i].get("from") != "human":
        i += 1
    if i + 1 < len(conv) and conv[i + 1].get("from") == "gpt":
        return conv[i]["value"], conv[i + 1]["value"]
    return None


def load_conversations(path: str | Path) -> list[Conversation]:
    """Every ShareGPT conversation with at least one (human, gpt) pair."""
    out = []
    for i, rec in enumerate(_read_json_list(path)):
        turns = sharegpt_turns(rec)
        if turns:
            out.append(Conversation(str(rec.get("id", i)), tuple(turns)))
    return out


def _read_json_list(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"dataset file {str(p)!r} does not exist")
    data = json.loads(p.read_text())
    if not isinstance(data, list):
        raise ValueError(f"dataset {str(p)!r} must be a JSON list of records")
    return data


# ---------------------------------------------------------------- tokenized, cached datasets

class DatasetCache:
    """Tokenizers and tokenized datasets, kept in memory per (dataset file, tokenizer directory).

    An object rather than module state, so that callers decide its lifetime (a test session, one
    benchmark sweep); pass the same one to repeated `make_workload` calls to tokenize once.
    """

    def __init__(self) -> None:
        self._tokenizers: dict[str, Any] = {}
        self._records: dict[tuple[str, str, str, float], list[DatasetRecord]] = {}
        self._turns: dict[tuple[str, str, float], list[list[DatasetRecord]]] = {}

    def tokenizer(self, path: str | Path) -> Any:
        key = str(Path(path).resolve())
        if key not in self._tokenizers:
            from transformers import AutoTokenizer  # heavy import: only when a dataset is tokenized

            tok = AutoTokenizer.from_pretrained(key, local_files_only=True)
            tok.model_max_length = 1 << 62  # we count tokens, never feed a model: silence length warnings
            self._tokenizers[key] = tok
        return self._tokenizers[key]

    def _encode(self, tokenizer: str | Path, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        # One batch call: the Rust tokenizer parallelises it (4,500 Alpaca records in well under a second).
        return self.tokenizer(tokenizer)(texts, add_special_tokens=False)["input_ids"]

    def _pairs_to_records(self, pairs: list[tuple[str, str]], tokenizer: str | Path,
                          ids: list[str | None], turns: list[int]) -> list[DatasetRecord]:
        prompts = self._encode(tokenizer, [p for p, _ in pairs])
        outputs = self._encode(tokenizer, [o for _, o in pairs])
        return [DatasetRecord(prompt=p, prompt_len=len(pi), output_len=len(oi), prompt_token_ids=tuple(pi),
                              conversation_id=cid, turn=t)
                for (p, _), pi, oi, cid, t in zip(pairs, prompts, outputs, ids, turns)]

    def records(self, kind: str, path: str | Path, tokenizer: str | Path) -> list[DatasetRecord]:
        """Tokenized prompt/response pairs: kind "alpaca", or "sharegpt" (first pair per conversation)."""
        p = Path(path).resolve()
        key = (kind, str(p), str(Path(tokenizer).resolve()), p.stat().st_mtime if p.exists() else 0.0)
        if key not in self._records:
            raw = _read_json_list(p)
            if kind == "alpaca":
                pairs = alpaca_pairs(raw)
                ids: list[str | None] = [None] * len(pairs)
            elif kind == "sharegpt":
                found = [(str(r.get("id", i)), sharegpt_first_pair(r)) for i, r in enumerate(raw)]
                kept = [(cid, pair) for cid, pair in found if pair is not None]
                if not kept:
                    raise ValueError(f"{str(p)!r} has no human->gpt pair "
                                     "(prompt-only files cannot give output lengths)")
                ids = [cid for cid, _ in kept]
                pairs = [pair for _, pair in kept]
            else:
                raise ValueError(f"unknown dataset kind {kind!r}; expected alpaca or sharegpt")
            self._records[key] = self._pairs_to_records(pairs, tokenizer, ids, [0] * len(pairs))
        return self._records[key]

    def conversation_records(self, path: str | Path, tokenizer: str | Path) -> list[list[DatasetRecord]]:
        """Per conversation, one record per (human, gpt) turn. prompt_len counts the human turn
        alone: a multi-turn client prepends the history itself."""
        p = Path(path).resolve()
        key = (str(p), str(Path(tokenizer).resolve()), p.stat().st_mtime if p.exists() else 0.0)
        if key not in self._turns:
            convs = load_conversations(p)
            flat = [(c.conversation_id, t, pair) for c in convs for t, pair in enumerate(c.turns)]
            recs = self._pairs_to_records([x[2] for x in flat], tokenizer, [x[0] for x in flat],
                                          [x[1] for x in flat])
            grouped: list[list[DatasetRecord]] = []
            for rec in recs:
                if rec.turn == 0:
                    grouped.append([])
                grouped[-1].append(rec)
            self._turns[key] = grouped
        return self._turns[key]


def load_alpaca(path: str | Path, tokenizer: str | Path, cache: DatasetCache | None = None) -> list[DatasetRecord]:
    return (cache or DatasetCache()).records("alpaca", path, tokenizer)


def load_sharegpt(path: str | Path, tokenizer: str | Path, cache: DatasetCache | None = None) -> list[DatasetRecord]:
    return (cache or DatasetCache()).records("sharegpt", path, tokenizer)


def filter_lengths(records: Sequence[DatasetRecord], min_len: int = FILTER_MIN_LEN,
                   max_prompt: int = FILTER_MAX_PROMPT, max_total: int = FILTER_MAX_TOTAL) -> list[DatasetRecord]:
    """vLLM's benchmark filter: drop prompt or output < min_len, prompt > max_prompt,
    prompt + output > max_total."""
    return [r for r in records if r.prompt_len >= min_len and r.output_len >= min_len
            and r.prompt_len <= max_prompt and r.prompt_len + r.output_len <= max_total]


# ---------------------------------------------------------------- synthetic lengths

@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution; samples are integers in [min_len, max_len].

    kind "fixed": always `value`. "zipf": P(min_len + k - 1) proportional to k^-theta for rank
    k = 1..(max_len - min_len + 1), heavy-tailed like real outputs (FastServe's synthetic
    workloads). "lognormal": mean `value` with log-space std `sigma` (mu = ln value - sigma^2/2).
    """

    kind: str = "fixed"
    value: float = 128.0
    theta: float = 1.5
    sigma: float = 1.0
    min_len: int = 1
    max_len: int = 2048

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.min_len < 1 or self.max_len < self.min_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
        if self.kind == "fixed":
            out = np.full(n, round(self.value), dtype=np.int64)
        elif self.kind == "zipf":
            ranks = np.arange(1, self.max_len - self.min_len + 2, dtype=float)
            p = ranks ** -self.theta
            out = self.min_len - 1 + rng.choice(ranks.astype(np.int64), size=n, p=p / p.sum())
        elif self.kind == "lognormal":
            if self.value <= 0 or self.sigma < 0:
                raise ValueError(f"lognormal needs value > 0 and sigma >= 0, got {self.value}, {self.sigma}")
            mu = math.log(self.value) - self.sigma ** 2 / 2
            out = np.rint(rng.lognormal(mu, self.sigma, size=n)).astype(np.int64)
        else:
            raise ValueError(f"unknown length distribution {self.kind!r}; expected fixed, zipf or lognormal")
        return np.clip(out, self.min_len, self.max_len)


# ---------------------------------------------------------------- arrivals, sampling, scaling

def arrival_times(n: int, rate: float | None, cv: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (s) of n requests, the first at 0.

    rate None or inf: all at once (a closed-loop client then limits concurrency). Otherwise gaps
    are Gamma with mean 1/rate and coefficient of variation cv: shape 1/cv^2, scale 1/(rate*shape).
    cv = 1 is exactly Poisson (Gamma of shape 1 is the exponential, drawn the same way); cv = 0 is
    evenly spaced; cv > 1 is bursty (the steady-state protocol uses cv = 4).
    """
    if n <= 0:
        return np.zeros(0)
    if rate is None or math.isinf(rate):
        return np.zeros(n)
    if rate <= 0:
        raise ValueError(f"rate must be positive (or None for all at once), got {rate}")
    if cv < 0:
        raise ValueError(f"cv must be >= 0, got {cv}")
    if cv == 0:
        gaps = np.full(n - 1, 1.0 / rate)
    else:
        shape = 1.0 / cv ** 2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def sample_indices(pool_size: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """n indices into a pool: without replacement when n <= pool_size, else with replacement."""
    if pool_size <= 0:
        raise ValueError("cannot sample from an empty dataset (after filtering)")
    return rng.choice(pool_size, size=n, replace=n > pool_size)


def scale_io_ratio(prompt_lens: np.ndarray, output_lens: np.ndarray, ratio: float) -> tuple[np.ndarray, np.ndarray]:
    """Rescale lengths so mean(input) / mean(output) = ratio with mean(input + output) unchanged.

    Rule (FastServe Fig. 14 varies the input:output ratio at constant total work): with means I, O
    and T = I + O, inputs are multiplied by a = T*R / ((1+R)*I) and outputs by b = T / ((1+R)*O),
    then rounded, each at least 1. Each side keeps its distribution's shape; only its scale moves.
    """
    if ratio <= 0:
        raise ValueError(f"io_ratio must be positive, got {ratio}")
    p = np.asarray(prompt_lens, dtype=float)
    o = np.asarray(output_lens, dtype=float)
    if len(p) == 0:
        return p.astype(np.int64), o.astype(np.int64)
    mean_in, mean_out = p.mean(), o.mean()
    total = mean_in + mean_out
    a = total * ratio / ((1 + ratio) * mean_in)
    b = total / ((1 + ratio) * mean_out)
    return (np.maximum(np.rint(p * a), 1).astype(np.int64), np.maximum(np.rint(o * b), 1).astype(np.int64))


def _fit_ids(ids: Sequence[int], length: int) -> list[int]:
    """Truncate or cycle token ids to `length`, so a rescaled request still has a real-text prompt."""
    if not ids:
        return []
    reps = -(-length // len(ids))
    return (list(ids) * reps)[:length]


def resolve_dataset(kind: str, dataset: str | Path | None) -> Path:
    """The dataset file: `dataset` itself, or a default file name inside a `dataset` directory."""
    if dataset is None:
        raise ValueError(f"workload needs a dataset path (--dataset FILE or DIRECTORY); looked for "
                         f"{', '.join(DEFAULT_DATASET_FILES[kind])} in a directory")
    p = Path(dataset)
    if p.is_dir():
        for name in DEFAULT_DATASET_FILES[kind]:
            if (p / name).is_file():
                return p / name
        raise ValueError(f"no {kind} dataset in {str(p)!r}; expected one of {', '.join(DEFAULT_DATASET_FILES[kind])}")
    if not p.is_file():
        raise ValueError(f"dataset {str(p)!r} does not exist")
    return p


# ---------------------------------------------------------------- the workload

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


# ---------------------------------------------------------------- priority patterns (FastSwitch §4)

PRIORITY_PATTERNS = ("random", "markov")
# FastSwitch §4 varies priorities among discrete levels; the level count is not stated in the
# paper's text we could find, so 8 levels is our choice.
DEFAULT_PRIORITY_LEVELS = 8
# Markov pattern: a level stays with this probability, else moves one level up or down.
DEFAULT_MARKOV_STAY = 0.5


@dataclass(frozen=True)
class PriorityPattern:
    """How priorities change during a run (FastSwitch §4, "Random" and "Markov" patterns).

    Levels are integers in [0, levels). Every `period` = round(1 / update_freq) iterations (engine
    steps) the levels of all live requests are recomputed: update_freq 0.01 is every 100 steps.

    - random: each live request draws an independent uniform level.
    - markov: each request's level follows a chain: stay with probability `markov_stay`, else up
      or down one level with equal probability; a move past either end stays put. The matrix is
      symmetric, hence doubly stochastic, so the uniform distribution is stationary: initial
      levels are uniform in both patterns and the marginals never drift.
    """

    kind: str = "random"
    update_freq: float = 0.01
    levels: int = DEFAULT_PRIORITY_LEVELS
    seed: int = 0
    markov_stay: float = DEFAULT_MARKOV_STAY

    def validate(self) -> None:
        if self.kind not in PRIORITY_PATTERNS:
            raise ValueError(f"unknown priority pattern {self.kind!r}; choose from {', '.join(PRIORITY_PATTERNS)}")
        if not 0 < self.update_freq <= 1:
            raise ValueError(f"priority update frequency must be in (0, 1], got {self.update_freq}")
        if self.levels < 1:
            raise ValueError(f"priority levels must be >= 1, got {self.levels}")
        if not 0 <= self.markov_stay <= 1:
            raise ValueError(f"markov stay probability must be in [0, 1], got {self.markov_stay}")

    @property
    def period(self) -> int:
        """Iterations between update points."""
        return max(1, round(1 / self.update_freq))

    def describe(self) -> dict[str, Any]:
        """The results-file form (`workload` dict)."""
        return {"priority_pattern": self.kind, "priority_update_freq": self.update_freq,
                "priority_levels": self.levels, "priority_seed": self.seed, "markov_stay": self.markov_stay}


class PriorityUpdates:
    """A seeded stream of priority levels for one run (engine.PriorityUpdates).

    `initial` and `at_iteration` draw from two independent streams of the seed, so the levels
    depend only on the sequence of calls: the same trace on the same engine gives the same levels.
    """

    def __init__(self, pattern: PriorityPattern) -> None:
        pattern.validate()
        self.pattern = pattern
        self.period = pattern.period
        init_seq, update_seq = np.random.SeedSequence(pattern.seed).spawn(2)
        self._init_rng = np.random.default_rng(init_seq)
        self._update_rng = np.random.default_rng(update_seq)
        self._level: dict[str, int] = {}  # each live request's current level (the Markov state)

    def initial(self, request: Any) -> int:
        """The level of a request at arrival (anything with a `request_id`)."""
        level = int(self._init_rng.integers(self.pattern.levels))
        self._level[request.request_id] = level
        return level

    def at_iteration(self, iteration: int, live_request_ids: Sequence[str]) -> dict[str, int]:
        """New levels for every live request at an update point (in the order given)."""
        live = list(live_request_ids)
        levels = self.pattern.levels
        if self.pattern.kind == "random":
            new = self._update_rng.integers(levels, size=len(live))
        else:
            # A request never seen (its arrival went elsewhere) starts from the stationary (uniform) law.
            cur = np.array([self._level[rid] if rid in self._level else self._update_rng.integers(levels)
                            for rid in live], dtype=np.int64)
            u = self._update_rng.random(len(live))
            move = (1 - self.pattern.markov_stay) / 2
            step = np.where(u < move, -1, np.where(u < 2 * move, 1, 0))
            nxt = cur + step
            new = np.where((nxt < 0) | (nxt >= levels), cur, nxt)  # a move past an end stays put
        self._level = {rid: int(v) for rid, v in zip(live, new, strict=True)}  # finished requests drop out
        return dict(self._level)


__all__ = ["WORKLOAD_NAMES", "WorkloadRequest", "DatasetRecord", "Conversation", "DatasetCache", "LengthDist",
           "alpaca_pairs", "sharegpt_turns", "sharegpt_first_pair", "load_conversations", "load_alpaca",
           "load_sharegpt", "filter_lengths", "arrival_times", "sample_indices", "scale_io_ratio",
           "resolve_dataset", "make_workload", "workload_stats", "save_workload", "load_workload",
           "PRIORITY_PATTERNS", "DEFAULT_PRIORITY_LEVELS", "PriorityPattern", "PriorityUpdates"]
