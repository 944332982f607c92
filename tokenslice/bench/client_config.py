"""How the benchmark client talks to a server (docs/DESIGN.md, "Metrics"): the endpoint, the
prompt format, timeouts and the think time between a conversation's turns. No torch here."""
from __future__ import annotations

from dataclasses import dataclass

ENDPOINTS = ("completions", "chat")
PROMPT_FORMATS = ("auto", "synthetic")
# The server's short answers (/v1/models, /metrics, priority updates): a deadline for a hung server,
# long enough that a busy machine still meets it.
CONTROL_TIMEOUT_S = 120.0


@dataclass
class ClientConfig:
    """How to talk to the server; `base_url` with or without the trailing /v1."""

    base_url: str
    model: str | None = None  # None: the first model /v1/models lists
    api_key: str | None = None
    endpoint: str = "completions"
    ignore_eos: bool = True
    send_expected_length: bool = False  # tokenslice extension read by srpt-oracle
    temperature: float = 0.0
    seed: int = 0  # request i is sent with seed + i, so its tokens do not depend on the batch
    request_timeout_s: float = 600.0
    max_concurrency: int | None = None
    prompt_format: str = "auto"  # auto: workload text, else its ids, else synthetic ids; synthetic: always ids
    metrics_prefix: str = "tokenslice:"
    turn_gap_s: float = 0.0  # user think time between a conversation's turns
    history_max_chars: int | None = None  # drop a conversation's oldest turns past this (model context)

    def validate(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {', '.join(PROMPT_FORMATS)}, got {self.prompt_format!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be positive, got {self.request_timeout_s}")

    @property
    def root(self) -> str:
        url = self.base_url.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


__all__ = ["ENDPOINTS", "PROMPT_FORMATS", "CONTROL_TIMEOUT_S", "ClientConfig"]
