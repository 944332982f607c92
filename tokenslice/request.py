"""Request state machine, sampling parameters and the outputs the engine streams back."""
from __future__ import annotations

import enum
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from tokenslice.delivery import DEFAULT_DELIVERY_RATE, read_time


class RequestState(enum.Enum):
    WAITING = "waiting"  # arrived, never run (or dropped for recompute)
    RUNNING = "running"  # in the current batch
    PREEMPTED = "preempted"  # has run, paused by the scheduler
    FINISHED = "finished"
    ABORTED = "aborted"


MAX_LOGPROBS = 20  # alternatives per position, as vLLM's default max_logprobs and OpenAI's top_logprobs
MAX_PENALTY = 2.0  # presence / frequency, as OpenAI bounds them
# Past these bounds a repeated token is as good as banned (or forced) anyway; closer to 0, dividing
# a float32 logit by the penalty overflows to inf.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-4, 1e4
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message is fit for the client."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# What a grammar constrains (SamplingParams.structured): JSON of any shape, JSON of a schema, a
# regular expression, one of a list of strings, an EBNF grammar, or an xgrammar structural tag
# (tool calls: free text around constrained calls).
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the output must follow: `kind` (STRUCTURED_KINDS) and its text (a JSON schema, a
    regex, a JSON list of choices, EBNF, a structural tag's JSON; "" for json_object). Hashable:
    compiled grammars are cached by it."""

    kind: str
    spec: str = ""


@dataclass
class SamplingParams:
    """How one request samples. These defaults are the only ones: the HTTP request fields take
    theirs from here (sampling_default)."""

    max_tokens: int = 16  # OpenAI's default for /v1/completions
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    # OpenAI's penalties, over the output so far: logit -= frequency * count + presence * (count > 0).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's (CTRL's) penalty over prompt and output: positive logits divided by it, negative multiplied.
    repetition_penalty: float = 1.0
    # Added to a token's logit before sampling; keys are token ids (OpenAI's logit_bias).
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability
    include_stop_str_in_output: bool = False  # keep a matched stop string (or stop token) in the text
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Log-probabilities from the model's raw logits (before temperature and any other logit
    # processing, as vLLM reports them): the top `logprobs` alternatives of each sampled token
    # (0: the sampled token's alone), and of each prompt token (`prompt_logprobs`). None: off.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Every token masked to what the grammar allows next (model/grammar.py); None: free text.
    structured: StructuredOutput | None = None

    def validate(self) -> None:
        # 0 only computes the prompt's logprobs (vLLM's echo without generation): it finishes
        # with "length" after prefill.
        if not isinstance(self.max_tokens, int) or self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise InvalidRequestError(f"max_tokens must be at least 1 (0 only with prompt_logprobs), got "
                                      f"{self.max_tokens}", "max_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise InvalidRequestError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}", name)
        if not self.temperature >= 0 or self.temperature == float("inf"):  # also refuses NaN
            raise InvalidRequestError(f"temperature must be a finite non-negative number, got {self.temperature}",
                                      "temperature")
        if not 0.0 < self.top_p <= 1.0:  # also refuses NaN
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}", "top_k")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}", "min_tokens")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty", "stop")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:  # also refuses NaN
                raise InvalidRequestError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}", name)
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}], "
                                      f"got {self.repetition_penalty}", "repetition_penalty")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        for tok, bias in self.logit_bias.items():
            if not isinstance(tok, int) or tok < 0:
                raise InvalidRequestError(f"logit_bias keys must be token ids (non-negative integers), got {tok!r}",
                                          "logit_bias")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequestError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], "
                                          f"got {bias} for token {tok}", "logit_bias")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative token ids", "stop_token_ids")
        if self.structured is not None and self.structured.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got "
                                      f"{self.structured.kind!r}", "structured")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the sampler indexes logits with must exist in the model's vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab_size})", name)

    @property
    def penalized(self) -> bool:
        """Sampling needs the request's token history (SeqSlice.history_token_ids)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def prompts_with_params(prompts: str | list[str] | list[int] | list[list[int]],
                        params: SamplingParams | list[SamplingParams] | None
                        ) -> tuple[list[str | list[int]], list[SamplingParams]]:
    """`generate`'s arguments as one list of prompts (one text or one token list is a single
    prompt) and one SamplingParams per prompt (one for all, or the default)."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]  # type: ignore[list-item]
    plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
    if len(plist) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
    return list(prompts), plist  # type: ignore[arg-type]


def sampling_default(name: str) -> Any:
    """The default of SamplingParams' field `name` (a new list or dict for those fields)."""
    f = next(f for f in fields(SamplingParams) if f.name == name)
    return f.default_factory() if f.default_factory is not MISSING else f.default


@dataclass
class TokenLogprobs:
    """Log-probabilities at consecutive positions: the token there and its log-probability, and
    the `k` most likely tokens with theirs (best first). Plain lists: crosses process borders."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)  # prompt positions only: 1 = most likely token
    top_token_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, other: TokenLogprobs) -> None:
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        self.ranks += other.ranks
        self.top_token_ids += other.top_token_ids
        self.top_logprobs += other.top_logprobs


@dataclass
class RequestMetrics:
    """Timestamps (clock seconds) and counters kept for every request."""

    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    exec_s: float = 0.0  # execution seconds of the steps it ran in (MLFQ's "attained service")
    iterations: int = 0
    preemptions: int = 0
    swaps: int = 0  # moves of its KV between tiers, either way
    recomputed_tokens: int = 0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    swap_ops: int = 0  # copy operations (contiguous runs) of its swaps
    swap_stall_s: float = 0.0  # time it would have run but waited for its KV (transfers)
    # Its reader at the request's delivery rate (tokenslice/delivery.py): when it read the last
    # token, and how long it waited for tokens in all; preemptions after its first token.
    read_time: float | None = None
    stall_s: float = 0.0
    started_preemptions: int = 0

    def add_token_time(self, now: float, delivery_rate: float) -> None:
        self.token_times.append(now)
        self.read_time, wait = read_time(self.read_time, now, delivery_rate)
        self.stall_s += wait

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival_time if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class EngineRequest:
    """A new request as it enters the engine: the one message the server, the offline API and
    trace replays hand over (tokenized; the engine validates it on arrival)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float | None = None  # None: when the engine receives it
    user: str | None = None  # the OpenAI `user` field
    priority: int = 0  # lower runs first
    expected_output_tokens: int | None = None  # the true length: oracles and experiments only
    predicted_output_tokens: int | None = None  # an output-length prediction made upstream
    eos_after: int | None = None  # trace replay: stop as at an EOS after this many tokens (Request.eos_after)
    cache_prefix: bool = True  # Request.cache_prefix
    prefix_leader: str | None = None  # Request.prefix_leader
    tenant: str | None = None  # the API key's tenant (serve --api-keys): vtc shares service per tenant
    delivery_rate: float | None = None  # Request.delivery_rate; None: the server's
    # What the client asked in its own words (a prompt, a chat's message contents: no template),
    # for the embedding length predictor, which was seeded with such text; None: detokenized ids.
    prompt_text: str | None = None


class Request:
    """One generation request as the scheduler sees it: tokens, KV progress, state, accounting."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float, *, user: str | None = None, tenant: str | None = None, priority: int = 0,
                 expected_output_tokens: int | None = None, predicted_output_tokens: int | None = None,
                 eos_token_id: int | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.user = user
        self.tenant = tenant
        self.priority = priority
        self.expected_output_tokens = expected_output_tokens  # known only to oracles and experiments
        # An output-length predictor's guess, set at arrival (srpt-predicted, ALISE §3.1); None: no predictor.
        self.predicted_output_tokens = predicted_output_tokens
        self.eos_token_id = eos_token_id
        self.output_token_ids: list[int] = []
        self.state = RequestState.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.max_total_tokens: int | None = None  # context limit, set by the engine
        # A trace replay's end of answer: the request stops ("stop") after this many output tokens,
        # as if the model sampled EOS there. Replays set it instead of max_tokens = the trace length,
        # which would hand every policy that reads max_tokens the answer's length. Policies never read it.
        self.eos_after: int | None = None
        self.finish_reason: str | None = None
        # Its KV may be shared through the prefix cache: false for placeholder prompts (a
        # simulated trace without token ids), whose equal ids do not mean equal text.
        self.cache_prefix = True
        # A sibling sample (n > 1) of the same prompt: it waits until this request's prompt KV is
        # computed, then starts from it through the prefix cache instead of computing it again.
        self.prefix_leader: str | None = None
        # Its reader's pace in tokens/s: the delivery timeline the stall guard keeps (the
        # scheduler's delivery_rate unless the request set its own).
        self.delivery_rate: float = DEFAULT_DELIVERY_RATE
        # The next prompt position whose logprob is due (prompt_logprobs): a recompute runs
        # positions again, and each is reported once.
        self.next_prompt_logprob = 1
        self.cumulative_logprob = 0.0  # of the sampled tokens, when their logprobs are computed
        self.metrics = RequestMetrics(arrival_time=arrival_time)

    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs are asked for and not all reported: its prompt must really be computed."""
        return self.params.prompt_logprobs is not None and self.next_prompt_logprob < len(self.prompt_token_ids)

    def mark_running(self, now: float) -> None:
        """Chosen for a step; the first time is its first scheduling (queueing delay ends)."""
        if self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = now
        self.state = RequestState.RUNNING

    def waits_for(self, leader: Request | None) -> bool:
        """Whether it waits for its live prefix leader to compute the prompt they share, so as to
        attach that KV from the prefix cache (it would compute it itself if it could not attach)."""
        return (leader is not None and leader.num_computed_tokens < leader.num_prompt_tokens
                and self.cache_prefix and leader.cache_prefix and not self.needs_prompt_logprobs)

    def take_prompt_logprob_targets(self, start: int, n: int) -> tuple[int, list[int]]:
        """For a slice computing positions start..start+n-1: (its first row to report, the prompt
        tokens those rows predict), marked reported. Row j predicts the token at j + 1."""
        if self.params.prompt_logprobs is None:
            return 0, []
        first = max(start, self.next_prompt_logprob - 1)
        end = min(start + n, len(self.prompt_token_ids) - 1)
        if first >= end:
            return 0, []
        self.next_prompt_logprob = end + 1
        return first - start, self.prompt_token_ids[first + 1:end + 1]

    def stop_reason(self, tok: int) -> str | None:
        """Why the request stops after sampling `tok` (its last output token), or None."""
        p = self.params
        n = len(self.output_token_ids)
        if n >= p.min_tokens:
            if not p.ignore_eos and tok == self.eos_token_id:
                return "stop"
            if p.stop_token_ids and tok in p.stop_token_ids:
                return "stop"
            if self.eos_after is not None and n >= self.eos_after:
                return "stop"
        if n >= p.max_tokens:
            return "length"
        if self.max_total_tokens is not None and len(self.prompt_token_ids) + n >= self.max_total_tokens:
            return "length"
        return None

    @property
    def tokens_until_forced_stop(self) -> int:
        """Output tokens left before max_tokens, the context limit or a replay's end stops it."""
        n_out = len(self.output_token_ids)
        k = self.params.max_tokens - n_out
        if self.eos_after is not None:
            k = min(k, self.eos_after - n_out)
        if self.max_total_tokens is not None:
            k = min(k, self.max_total_tokens - len(self.prompt_token_ids) - n_out)
        return k

    @property
    def is_finished(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.ABORTED)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Uncomputed tokens: the whole prompt on first run, 1 when decoding."""
        return self.num_tokens - self.num_computed_tokens

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, state={self.state.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")


@dataclass
class RequestOutput:
    """What one step produced for one request; `text_delta` is new text since the last output."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    metrics: RequestMetrics | None = None
    user: str | None = None  # the request's OpenAI `user` (per-user metrics)
    # When SamplingParams asks: of new_token_ids, and of the prompt positions computed since the
    # last output (in order, from position 1; the first prompt token has none).
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None
    cumulative_logprob: float | None = None  # of all sampled tokens so far, with logprobs on
    tenant: str | None = None  # the request's tenant (per-tenant metrics)


@dataclass
class CompletionOutput:
    """A finished request, as the offline `LLM.generate` returns it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    metrics: RequestMetrics
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None
    cumulative_logprob: float | None = None
