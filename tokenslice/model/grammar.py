"""Structured outputs: a request's grammar (SamplingParams.structured) masks every token it samples
to what the grammar allows next. xgrammar (vLLM's default backend) compiles each grammar against
the model's tokenizer once (cached by its StructuredOutput), a matcher per request follows its
tokens, and the allowed-token bitmasks of a step's constrained rows are applied to the logits in
one call (on the device on CUDA).

A matcher belongs to its request for the request's whole life: preemption (recompute or swap)
keeps the tokens it has accepted, so it resumes where it was; only a finished request drops it."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr

from tokenslice.config import ModelConfig
from tokenslice.request import StructuredOutput

# The JSON a small model writes is more reliable without free whitespace: between tokens it
# would be allowed any run of spaces and newlines, and some models never leave such a run.
JSON_SEPARATORS = (", ", ": ")
MAX_COMPILED = 256  # compiled grammars kept per tokenizer (most recently used)


class GrammarError(ValueError):
    """A grammar xgrammar cannot compile; the message says why, fit for the client."""


def grammar_of(spec: StructuredOutput) -> xgr.Grammar:
    """The grammar `spec` describes, without a tokenizer (cheap: checks a request's grammar
    before it reaches the engine). Raises GrammarError naming the problem."""
    try:
        if spec.kind == "json_object":
            return xgr.Grammar.builtin_json_grammar()
        if spec.kind == "json_schema":
            return xgr.Grammar.from_json_schema(spec.spec, any_whitespace=False, separators=JSON_SEPARATORS)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.spec)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec.spec)))
        if spec.kind == "grammar":
            return xgr.Grammar.from_ebnf(spec.spec)
        if spec.kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(spec.spec)
    except (RuntimeError, ValueError, TypeError) as e:
        raise GrammarError(_reason(e)) from None
    raise GrammarError(f"unknown structured output kind {spec.kind!r}")


def choice_ebnf(choices: Sequence[str]) -> str:
    """One of `choices`, exactly: EBNF string literals take JSON's escapes."""
    if not choices:
        raise ValueError("choice needs at least one string")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _reason(e: Exception) -> str:
    # xgrammar prefixes its messages with "[time] /path/file.cc:line: ": the client needs the rest.
    text = str(e).strip()
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1] if "cc:" in text.split(": ", 1)[0] else text
    return text.splitlines()[0] if text else type(e).__name__


class Grammars:
    """Compiled grammars for one tokenizer: `grammar_of` each spec, compiled against the
    tokenizer, the most recent MAX_COMPILED kept by StructuredOutput (a stream of distinct
    schemas cannot grow the cache without bound). The tokenizer's vocabulary index (a second or
    two for 50k tokens) is built at the first compile, not at start-up."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiled: OrderedDict[StructuredOutput, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()  # the engine's compile thread and the sampler may both ask

    def _ready(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)
                # One thread: compiles run beside the step loop, whose compute threads need the cores.
                # The cache is ours (bounded, keyed by spec), not xgrammar's (unbounded by default).
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """Raises GrammarError for a grammar xgrammar refuses."""
        compiler = self._ready()
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        grammar = grammar_of(spec)
        try:
            compiled = compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(_reason(e)) from None
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return compiled


def model_grammars(cfg: ModelConfig) -> Grammars:
    """The grammars of the model `cfg` names, for a process that has not loaded its tokenizer
    (a worker rank): loaded here, at the first structured request."""
    from tokenslice.model.loader import eos_token_ids, load_arch, model_tokenizer

    arch = load_arch(cfg)
    tokenizer = model_tokenizer(cfg, arch)
    return Grammars(tokenizer, arch.vocab_size, eos_token_ids(tokenizer, arch))


class GrammarMasks:
    """The matchers of the requests a sampler serves, and the masking of a step's logits."""

    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        self._bitmask: torch.Tensor | None = None  # [rows, words] int32, grown on demand, reused

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._matchers.pop(rid, None)

    def matcher(self, request_id: str, spec: StructuredOutput) -> xgr.GrammarMatcher:
        m = self._matchers.get(request_id)
        if m is None:
            m = self._matchers[request_id] = xgr.GrammarMatcher(self.grammars.compile(spec))
        return m

    def apply(self, logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[xgr.GrammarMatcher]) -> None:
        """Mask rows `rows` of `logits` [N, vocab] to their matchers' allowed next tokens, in place."""
        n = logits.shape[0]
        words = (logits.shape[1] + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < n or self._bitmask.shape[1] != words:
            self._bitmask = xgr.allocate_token_bitmask(max(n, 8), logits.shape[1])
        bitmask = self._bitmask[:n]
        for i, m in zip(rows, matchers, strict=True):
            if m.is_terminated():  # past its end (a step planned before it finished): any token, dropped anyway
                bitmask[i].fill_(-1)
            else:
                m.fill_next_token_bitmask(bitmask, i)
        mask = bitmask if logits.device.type == "cpu" else bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.grammars.vocab_size, indices=list(rows))

    @staticmethod
    def accept(matchers: Sequence[xgr.GrammarMatcher], tokens: Sequence[int]) -> None:
        for m, t in zip(matchers, tokens, strict=True):
            if not m.is_terminated():
                m.accept_token(t)
