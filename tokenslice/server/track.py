"""One generation request's log line and usage: a `Track` per API request, updated as outputs
arrive. The line has the id, tokens, finish reason and latency; prompt and output text are
never logged."""
from __future__ import annotations

import hashlib
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi import Request

from tokenslice.server.choices import Choice
from tokenslice.server.identity import OPERATOR, Tenant, tenant_of
from tokenslice.server.responses import UsageInfo

log = logging.getLogger("tokenslice.server")
LOG_TEXT_CHARS = 160  # of a client's value (a path, an id) in a log line


def log_text(text: str, limit: int = LOG_TEXT_CHARS) -> str:
    """A client's value as a log line may carry it: control characters escaped (no forged lines),
    at most `limit` characters; a longer value is cut and named by its length and a hash, so
    that two long values can still be told apart."""
    safe = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text[:limit + 1])
    if len(text) <= limit and len(safe) <= limit:
        return safe
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{safe[:limit]}...[{len(text)} chars, sha256 {digest}]"


@dataclass
class Track:
    """What the request log line reports; updated as outputs arrive."""

    request_id: str
    route: str
    start: float
    status: int = 200
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    outcome: str = "ok"
    tenant: Tenant = OPERATOR  # who sent it: its API key's tenant (server/identity.py)
    quiet: bool = False  # --disable-log-requests: log the line only when the request failed

    def account(self, choices: list[Choice]) -> None:
        """Usage of all choices: each prompt counted once (set at submission), every generated token."""
        self.completion_tokens = sum(c.num_output_tokens for c in choices)
        reasons = sorted({c.finish_reason for c in choices if c.finish_reason})
        self.finish_reason = ",".join(reasons) or None

    def log(self) -> None:
        if self.quiet and self.status < 400 and self.outcome == "ok":
            return
        log.info("%s %s status=%d prompt_tokens=%d completion_tokens=%d finish=%s latency=%.3fs%s",
                 self.request_id, self.route, self.status, self.prompt_tokens, self.completion_tokens,
                 self.finish_reason, time.monotonic() - self.start,
                 "" if self.outcome == "ok" else f" ({log_text(self.outcome)})")

    @property
    def usage(self) -> UsageInfo:
        return UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                         total_tokens=self.prompt_tokens + self.completion_tokens)


def new_track(request: Request, prefix: str, route: str) -> Track:
    """A new request id (`{prefix}-{hex}`) and its track, left on the request for the error handlers."""
    server = getattr(request.app.state, "server", None)
    quiet = server is not None and not server.settings.log_requests
    track = Track(f"{prefix}-{uuid.uuid4().hex}", route, time.monotonic(), quiet=quiet)
    track.tenant = tenant_of(request.state)
    request.state.track = track  # the error handlers log with it
    return track
