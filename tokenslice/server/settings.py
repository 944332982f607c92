"""The server's own settings (the engine's are in tokenslice/config.py); `serve` flags are their
kebab-case field names. Imports nothing heavy, so the CLI can read the defaults cheaply."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    api_keys: str | None = None  # --api-keys FILE: tenants and their keys (server/identity.py)
    metrics_require_key: bool = False  # /metrics needs an admin key (or the single --api-key)
    max_waiting: int = 1024  # requests admitted but without a first token; more get 429
    max_body_bytes: int = 4 * 1024 * 1024
    retry_after_s: int = 1
    # Run the engine in a process of its own (engine/core.py), so HTTP work never holds its
    # interpreter lock; off: on a thread of the server process (AsyncEngine).
    engine_process: bool = True
