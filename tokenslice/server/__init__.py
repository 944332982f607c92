"""OpenAI-compatible HTTP server: `create_app(engine_client, ServerSettings(...))` (docs/DESIGN.md, server/).

Names load on first use (PEP 562), so reading `tokenslice.server.settings` does not import FastAPI."""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ServerSettings", "create_app"]
_MODULE_OF = {"ServerSettings": "tokenslice.server.settings", "create_app": "tokenslice.server.app"}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenslice.server' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
