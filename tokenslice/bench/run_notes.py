"""What a bench table's numbers do not say: why requests failed (grouped by reason, numbers in the
messages folded so that one cause is one line) and how many requests were capped to the served
context. Printed under the summary by `tokenslice bench`. No torch here."""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

MAX_REASON_CHARS = 160
_NUMBER = re.compile(r"\d+(\.\d+)?")
_REQUEST_ID = re.compile(r"\b(?:chatcmpl|cmpl)-[0-9A-Za-z_-]+")  # the server's ids: one per request


def reason_key(error: str) -> str:
    """One failure cause however its numbers and request ids differ ("... 600 were requested" and
    "... 610 ...")."""
    text = _NUMBER.sub("N", _REQUEST_ID.sub("<id>", error))
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS - 1] + "…"


def _x(run: Mapping[str, Any]) -> str:
    for key in ("rate", "concurrency"):
        if run.get(key) is not None:
            return f"{key} {run[key]:g}"
    return "-"


def failure_lines(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per run with failed requests: the count of each reason, most frequent first."""
    out = []
    for res in results:
        for run in res.get("runs", []):
            counts = (run.get("per_request") or {}).get("error_counts") or {}
            if not counts:
                continue
            grouped: Counter[str] = Counter()
            for error, n in counts.items():
                grouped[reason_key(error)] += n
            out.append(f"  {run['policy']} {_x(run)}: {sum(grouped.values())} failed")
            out += [f"    {n} x {reason}" for reason, n in grouped.most_common()]
    return out


def capped_lines(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """How many requests were capped to the served max_model_len (the same workload at every point)."""
    seen = set()
    for res in results:
        for run in res.get("runs", []):
            capped = run.get("capped_to_context")
            if capped:
                seen.add((capped["requests"], run.get("num_requests"), capped["max_model_len"]))
    return [f"  {n} of {total} requests capped to fit the served max_model_len {limit} (prompt + output)"
            for n, total, limit in sorted(seen)]


def format_notes(results: Sequence[Mapping[str, Any]]) -> str:
    """The notes block ('' when there is nothing to say)."""
    lines = capped_lines(results)
    failures = failure_lines(results)
    if failures:
        lines += ["failed requests by reason:", *failures]
    return "\n".join(lines)


__all__ = ["reason_key", "failure_lines", "capped_lines", "format_notes"]
