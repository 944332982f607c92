"""OpenAI-compatible HTTP server: `create_app(engine, ServerSettings(...))` (DESIGN.md, server/)."""
from __future__ import annotations

from tokenslice.server.app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app"]
