"""API keys and the tenants they stand for (`serve --api-keys FILE`): who sent a request, which
requests it may see and re-prioritise, the priorities it may ask for, and its limits.

The file (TOML, or JSON when it ends in .json) maps tenants to their keys and settings:

    [tenants.alice]
    keys = ["sk-alice-1"]          # or key_sha256 = ["<64 hex digits>"]: the file then holds no secret
    weight = 2.0                   # vtc: its share of service against other tenants (default 1)
    priority_min = 0               # the priorities it may ask for; outside them they are clamped
    priority_max = 100             #   (defaults 0 and unbounded: no tenant outranks the default 0)
    max_in_flight = 16             # engine requests (one per choice) live at once; more get 429
    tokens_per_minute = 100000     # prompt + max_tokens x choices, charged at admission; more get 429
    admin = false                  # sees and re-prioritises every request; may read /metrics

The single `--api-key` (and no key at all) is the operator: admin, no range, no limits, no
tenant (its requests share service as one tenant, divided by `user` as before).
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import time
import tomllib
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tokenslice.engine.protocol import RequestStream

# Tenant names become Prometheus label values and `tenant_weights` entries: short, plain.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
TOKENS_WINDOW_S = 60.0  # tokens_per_minute's sliding window


@dataclass(frozen=True)
class Tenant:
    name: str | None  # None: the operator (the single --api-key, or no key)
    weight: float = 1.0
    priority_min: int | None = 0  # None: unbounded
    priority_max: int | None = None
    max_in_flight: int | None = None
    tokens_per_minute: int | None = None
    admin: bool = False

    def clamp(self, priority: int) -> int:
        """The priority a request of this tenant gets when it asks for `priority`."""
        if self.priority_min is not None and priority < self.priority_min:
            return self.priority_min
        if self.priority_max is not None and priority > self.priority_max:
            return self.priority_max
        return priority


OPERATOR = Tenant(None, priority_min=None, admin=True)


class _TenantEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    keys: list[str] = []
    key_sha256: list[str] = []
    weight: float = Field(1.0, gt=0, allow_inf_nan=False)
    priority_min: int = 0
    priority_max: int | None = None
    max_in_flight: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    admin: bool = False


class _KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    tenants: dict[str, _TenantEntry]


def key_digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


@dataclass
class Keyring:
    """Who each key is. Keys are looked up by their SHA-256 digest, so the lookup's timing says
    nothing usable about the key."""

    by_digest: dict[bytes, Tenant] = field(default_factory=dict)
    tenants: tuple[Tenant, ...] = ()  # those of the --api-keys file, in its order

    @property
    def required(self) -> bool:
        return bool(self.by_digest)

    @property
    def tenant_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tenants if t.name is not None)

    def identify(self, key: bytes) -> Tenant | None:
        return self.by_digest.get(key_digest(key)) if key else None

    def tenant_weights(self) -> str | None:
        """SchedulerConfig.tenant_weights: the weights vtc divides each tenant's service by."""
        return ",".join(f"{t.name}={t.weight!r}" for t in self.tenants if t.weight != 1.0) or None


def load_keyring(path: str | None, api_key: str | None = None) -> Keyring:
    """The keys of `--api-keys path` and of the single `--api-key`; ValueError says what is wrong."""
    ring = Keyring()
    if api_key:
        ring.by_digest[key_digest(api_key.encode())] = OPERATOR
    if path is None:
        return ring
    try:
        raw = Path(path).read_bytes()
        data = json.loads(raw) if path.endswith(".json") else tomllib.loads(raw.decode())
        parsed = _KeysFile.model_validate(data)
    except (OSError, ValueError, tomllib.TOMLDecodeError) as e:  # ValidationError is a ValueError
        detail = _validation_summary(e) if isinstance(e, ValidationError) else str(e)
        raise ValueError(f"--api-keys {path}: {detail}") from None
    tenants = []
    for name, entry in parsed.tenants.items():
        where = f"--api-keys {path}: tenant {name!r}"
        if not TENANT_NAME.fullmatch(name):
            raise ValueError(f"{where}: a name is 1-64 letters, digits, '_', '.' or '-', starting with a letter "
                             "or digit")
        if entry.priority_max is not None and entry.priority_max < entry.priority_min:
            raise ValueError(f"{where}: priority_max {entry.priority_max} < priority_min {entry.priority_min}")
        digests = [key_digest(k.encode()) for k in entry.keys if k]
        if len(digests) != len(entry.keys):
            raise ValueError(f"{where}: an empty key")
        for h in entry.key_sha256:
            if not re.fullmatch(r"[0-9a-fA-F]{64}", h):
                raise ValueError(f"{where}: key_sha256 entries are 64 hex digits")
            digests.append(bytes.fromhex(h))
        if not digests:
            raise ValueError(f"{where}: no keys (keys or key_sha256)")
        tenant = Tenant(name, entry.weight, entry.priority_min, entry.priority_max, entry.max_in_flight,
                        entry.tokens_per_minute, entry.admin)
        for d in digests:
            if d in ring.by_digest:
                raise ValueError(f"{where}: a key that is also another tenant's or --api-key")
            ring.by_digest[d] = tenant
        tenants.append(tenant)
    ring.tenants = tuple(tenants)
    return ring


def _validation_summary(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())


class TenantLimitError(Exception):
    """A request over its tenant's limits (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: int | None, limit: str) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.limit = limit  # "max_in_flight" or "tokens_per_minute"


class TenantBook:
    """Per named tenant: its live engine requests (the ones it may see and re-prioritise; also
    its in-flight count) and the tokens charged to it in the last minute. The operator's requests
    are not kept: it sees everything and has no limits."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._live: dict[str, dict[str, RequestStream]] = {}
        self._pending: dict[str, int] = {}  # admitted, not yet accepted by the engine
        self._spent: dict[str, deque[tuple[float, int]]] = {}  # (time, tokens) in the window

    def _streams(self, name: str) -> dict[str, RequestStream]:
        """The tenant's live streams, finished ones dropped (a finished or aborted stream says so)."""
        live = self._live.setdefault(name, {})
        for rid in [rid for rid, s in live.items() if s.finished]:
            del live[rid]
        return live

    def owns(self, tenant: Tenant, request_id: str) -> bool:
        return tenant.name is not None and request_id in self._streams(tenant.name)

    def in_flight(self, tenant: Tenant) -> int:
        return 0 if tenant.name is None else len(self._streams(tenant.name)) + self._pending.get(tenant.name, 0)

    def tokens_spent(self, tenant: Tenant) -> int:
        spent = self._spent.get(tenant.name or "")
        if not spent:
            return 0
        horizon = self.clock() - TOKENS_WINDOW_S
        while spent and spent[0][0] <= horizon:
            spent.popleft()
        return sum(n for _, n in spent)

    def check(self, tenant: Tenant, requests: int, tokens: int) -> None:
        """Raise TenantLimitError if `requests` more engine requests costing `tokens` would pass
        the tenant's limits."""
        if tenant.max_in_flight is not None:
            live = self.in_flight(tenant)
            if live + requests > tenant.max_in_flight:
                raise TenantLimitError(
                    f"too many requests in flight for this API key: {live} running or waiting, this request "
                    f"adds {requests} (one per choice), the limit is {tenant.max_in_flight}; retry when one "
                    "finishes", 1, "max_in_flight")
        limit = tenant.tokens_per_minute
        if limit is None:
            return
        if tokens > limit:
            raise TenantLimitError(
                f"request too large for this API key's rate limit: it needs {tokens} tokens (prompt + max_tokens "
                f"x choices), the limit is {limit} tokens per minute; lower max_tokens or n", None,
                "tokens_per_minute")
        spent = self.tokens_spent(tenant)
        if spent + tokens > limit:
            raise TenantLimitError(
                f"rate limit reached for this API key: {spent} tokens used in the last minute, this request needs "
                f"{tokens} (prompt + max_tokens x choices), the limit is {limit} tokens per minute",
                self._retry_after(tenant.name or "", spent + tokens - limit), "tokens_per_minute")

    def _retry_after(self, name: str, excess: int) -> int:
        """Seconds until enough of the window's charges expire to leave room."""
        freed, now = 0, self.clock()
        for t, n in self._spent[name]:
            freed += n
            if freed >= excess:
                return max(1, math.ceil(t + TOKENS_WINDOW_S - now))
        return int(TOKENS_WINDOW_S)

    @contextmanager
    def admit(self, tenant: Tenant, requests: int, tokens: int) -> Iterator[Callable[[RequestStream], None]]:
        """Check the limits, charge the tokens and hold `requests` in-flight places while the
        caller submits them; the caller registers each accepted stream with the yielded function.
        Places not filled when the block ends (a refusal, an error) are given back."""
        self.check(tenant, requests, tokens)
        name = tenant.name
        if name is None:
            yield lambda stream: None
            return
        charge = (self.clock(), tokens)
        if tenant.tokens_per_minute is not None:
            self._spent.setdefault(name, deque()).append(charge)
        self._pending[name] = self._pending.get(name, 0) + requests
        held = requests

        def accepted(stream: RequestStream) -> None:
            nonlocal held
            self._streams(name)[stream.request_id] = stream
            held -= 1
            self._pending[name] -= 1

        try:
            yield accepted
        except BaseException:
            spent = self._spent.get(name, ())
            if held == requests and charge in spent:  # the engine took none of them: no charge
                spent.remove(charge)
            raise
        finally:
            self._pending[name] -= held


def tenant_of(state: Any) -> Tenant:
    """The tenant the API-key middleware found for a request (`request.state`); the operator
    when no key is configured."""
    return getattr(state, "tenant", OPERATOR)


__all__ = ["Tenant", "OPERATOR", "Keyring", "load_keyring", "TenantBook", "TenantLimitError", "tenant_of",
           "TOKENS_WINDOW_S"]
