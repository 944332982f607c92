"""The one output path (docs/DESIGN.md, Data flow): a step's outputs get their text, stop strings
end requests, and the metrics a step reports are merged into each request's record. The engine
in this process (offline `generate`), AsyncEngine (in the event loop, overlapping the next step)
and EngineCoreClient (in the API-server process) all run their outputs through it.

A stop string is found in the text after the engine has moved on: the output that reveals it
becomes the request's last ("stop"), `on_stop` tells the engine to end the request, and what
the engine still sends for it afterwards is dropped.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from tokenslice.engine.detokenizer import IncrementalDetokenizer
from tokenslice.request import RequestMetrics, RequestOutput, SamplingParams, TokenLogprobs

_METRIC_SCALARS = tuple(f.name for f in dataclasses.fields(RequestMetrics) if f.name != "token_times")

# What to do with an output: hand it to the request's stream; only count it in the metrics (its
# stream is gone, the client aborted); or drop it (its stream already ended on a stop string).
Route = Literal["stream", "observe", "drop"]


@dataclass
class _Tracked:
    detok: IncrementalDetokenizer | None
    metrics: RequestMetrics | None = None  # the merged record, when steps send only their new token times


class OutputProcessor:
    def __init__(self, tokenizer: Any | None, on_stop: Callable[[str], None], *, merge_metrics: bool = False) -> None:
        """`on_stop(request_id)`: end a request the engine is still running (a stop string);
        `merge_metrics`: outputs carry only the token times since the last one (the engine core's
        wire format), so gather them into one record per request."""
        self.tokenizer = tokenizer
        self.on_stop = on_stop
        self.merge_metrics = merge_metrics
        self._tracked: dict[str, _Tracked] = {}
        self._stopped: set[str] = set()  # ended here on a stop string; later outputs are dropped

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer.for_request(self.tokenizer, prompt_token_ids, params)
        self._tracked[request_id] = _Tracked(detok)

    def forget(self, request_id: str) -> None:
        """The request's stream is gone (aborted, failed) or the engine finished it here."""
        self._tracked.pop(request_id, None)
        self._stopped.discard(request_id)

    def process(self, out: RequestOutput) -> Route:
        """Fill `out`'s text and merged metrics; say where it goes."""
        rid = out.request_id
        tracked = self._tracked.get(rid)
        if tracked is None:
            if rid in self._stopped:  # the step in flight at its stop string, or the end after it
                if out.finished:
                    self._stopped.discard(rid)
                return "drop"
            return "observe"  # an aborted request's last outputs still count in the metrics
        if self.merge_metrics and out.metrics is not None:
            out.metrics = _merged(tracked, out.metrics)
        if tracked.detok is not None and tracked.detok.apply(out):
            del self._tracked[rid]
            self._stopped.add(rid)
            self.on_stop(rid)
        elif out.finished:
            del self._tracked[rid]
        return "stream"


def _merged(tracked: _Tracked, sent: RequestMetrics) -> RequestMetrics:
    if tracked.metrics is None:
        tracked.metrics = sent
        return sent
    m = tracked.metrics
    for name in _METRIC_SCALARS:
        setattr(m, name, getattr(sent, name))
    m.token_times.extend(sent.token_times)
    return m


def joined_logprobs(acc: TokenLogprobs | None, part: TokenLogprobs | None) -> TokenLogprobs | None:
    """Logprobs of successive outputs of one request, concatenated."""
    if part is None:
        return acc
    acc = acc if acc is not None else TokenLogprobs()
    acc.extend(part)
    return acc
