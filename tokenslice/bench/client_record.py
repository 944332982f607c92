"""What the benchmark client records of one request (docs/DESIGN.md, "Metrics"). No torch here."""
from __future__ import annotations

from dataclasses import dataclass

from tokenslice.bench.metrics import RequestRecord


@dataclass
class ClientRecord(RequestRecord):
    """A RequestRecord plus what only the client knows. Times are seconds from the run start."""

    scheduled_time: float = 0.0  # the workload's arrival time (arrival is when it was sent)
    chunks: int = 0  # token chunks received
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    finish_reason: str | None = None
    conversation_id: str | None = None
    turn: int = 0
    text: str = ""  # the streamed answer (the next turn's history needs it)
    response_id: str | None = None  # the server's id (cmpl-...), for priority updates


__all__ = ["ClientRecord"]
