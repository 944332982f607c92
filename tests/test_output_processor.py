"""The one output path (engine/output.py) on a real tokenizer: text, stop strings, where each
output goes, metrics merged from the engine core's per-step token times."""
from __future__ import annotations

from pathlib import Path

import pytest

from tokenslice.engine.output import OutputProcessor
from tokenslice.model.loader import load_tokenizer
from tokenslice.request import RequestMetrics, RequestOutput, SamplingParams

GPT2 = Path(__file__).resolve().parents[2] / "shared" / "tokenizers" / "gpt2"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(GPT2))


def _outputs(tokenizer, text: str, rid: str = "r") -> list[RequestOutput]:
    ids = tokenizer(text)["input_ids"]
    return [RequestOutput(rid, [t], "", i == len(ids) - 1, "length" if i == len(ids) - 1 else None,
                          metrics=RequestMetrics(token_times=[float(i)]))
            for i, t in enumerate(ids)]


def test_text_of_a_stream_equals_the_decoded_answer(tokenizer) -> None:
    stops: list[str] = []
    proc = OutputProcessor(tokenizer, stops.append)
    proc.add("r", tokenizer("Once")["input_ids"], SamplingParams())
    outs = _outputs(tokenizer, " upon a time, there was a café.")
    assert [proc.process(o) for o in outs] == ["stream"] * len(outs)
    assert "".join(o.text_delta for o in outs) == " upon a time, there was a café."
    assert stops == []


def test_a_stop_string_ends_the_stream_and_drops_what_the_engine_sends_after(tokenizer) -> None:
    stops: list[str] = []
    proc = OutputProcessor(tokenizer, stops.append)
    proc.add("r", tokenizer("Once")["input_ids"], SamplingParams(stop=["time"]))
    outs = _outputs(tokenizer, " upon a time, there was")
    routes = [proc.process(o) for o in outs]
    ended = routes.index("drop") - 1
    assert stops == ["r"]  # the engine is told once
    assert outs[ended].finished and outs[ended].finish_reason == "stop"
    assert "".join(o.text_delta for o in outs[:ended + 1]) == " upon a "
    assert set(routes[ended + 1:]) == {"drop"}
    # The engine's final output for it cleared the record: a reused id streams again.
    proc.add("r", [], SamplingParams())
    assert proc.process(RequestOutput("r", [], "", True, "length")) == "stream"


def test_an_aborted_request_is_only_observed(tokenizer) -> None:
    proc = OutputProcessor(tokenizer, lambda rid: None)
    proc.add("a", [], SamplingParams())
    proc.forget("a")  # the client left
    assert proc.process(RequestOutput("a", [11], "", False)) == "observe"


def test_metrics_from_the_core_are_merged_into_one_record(tokenizer) -> None:
    proc = OutputProcessor(tokenizer, lambda rid: None, merge_metrics=True)
    proc.add("r", [], SamplingParams())
    outs = _outputs(tokenizer, "one two three")
    for o in outs:
        proc.process(o)
    assert outs[-1].metrics is outs[0].metrics
    assert outs[-1].metrics.token_times == [float(i) for i in range(len(outs))]


def test_without_a_tokenizer_outputs_still_route(tokenizer) -> None:
    proc = OutputProcessor(None, lambda rid: None)
    proc.add("r", [1, 2], SamplingParams(stop=["x"]))
    out = RequestOutput("r", [5], "", True, "length")
    assert proc.process(out) == "stream" and out.text_delta == ""
