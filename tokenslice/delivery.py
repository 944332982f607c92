"""A started stream's delivery timeline as its reader sees it (docs/DESIGN.md, "Stall guard"):
the reader takes one token every 1/rate seconds from the first one on, and waits when the next
token has not arrived. Tokens that arrive ahead of that pace sit in the reader's buffer, so the
stream may pause that long unseen (Andes, arXiv 2404.16283 §3); time the reader waits is stall.
Plain functions over token arrival times: the scheduler, the metrics and the benchmarks share them."""
from __future__ import annotations

from collections.abc import Sequence

# A fast reader's pace in tokens/s (about 450 words a minute): slower readers only widen the slack.
DEFAULT_DELIVERY_RATE = 10.0
# Andes' QoE compares against a timeline that starts this long after arrival (its expected TTFT).
DEFAULT_EXPECTED_TTFT_S = 1.0


def read_time(prev_read: float | None, arrival: float, rate: float) -> tuple[float, float]:
    """(when the reader reads a token arriving at `arrival`, how long the reader waited for it),
    given when it read the previous one (None: this is the first token, read on arrival)."""
    if prev_read is None:
        return arrival, 0.0
    due = prev_read + 1.0 / rate
    return (arrival, arrival - due) if arrival > due else (due, 0.0)


def reader_times(token_times: Sequence[float], rate: float) -> tuple[list[float], float]:
    """When the reader reads each token, and the total time it waited (stall seconds)."""
    read: list[float] = []
    stall = 0.0
    prev: float | None = None
    for t in token_times:
        prev, wait = read_time(prev, t, rate)
        read.append(prev)
        stall += wait
    return read, stall


def stall_seconds(token_times: Sequence[float], rate: float) -> float:
    return reader_times(token_times, rate)[1]


def qoe(arrival: float, token_times: Sequence[float], rate: float,
        expected_ttft_s: float = DEFAULT_EXPECTED_TTFT_S) -> float | None:
    """Andes' QoE (arXiv 2404.16283 §3.1): the area under the tokens the reader has read, capped
    by the expected timeline (first token `expected_ttft_s` after arrival, then `rate` tokens/s),
    over the area under that timeline, both up to when the timeline ends. 1 when every token is
    read no later than expected; None for a stream without tokens."""
    if not token_times:
        return None
    read, _ = reader_times(token_times, rate)
    expected = [arrival + expected_ttft_s + i / rate for i in range(len(read))]
    end = max(expected[-1], read[-1]) + 1.0 / rate
    # Both curves count tokens; min of two counting curves reaches k when both have k tokens.
    ideal = sum(end - e for e in expected)
    got = sum(max(0.0, end - max(r, e)) for r, e in zip(read, expected, strict=True))
    return got / ideal if ideal > 0 else 1.0
