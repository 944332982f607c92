"""tokenslice: an LLM inference server that schedules at token granularity.

The public names are loaded on first use (PEP 562), so importing a low module such as
`tokenslice.kv.groups` or `tokenslice.sched.policy` does not pull in the engine.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenslice.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
    from tokenslice.llm import LLM
    from tokenslice.request import CompletionOutput, InvalidRequestError, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "ModelConfig", "CacheConfig", "SchedulerConfig",
           "ParallelConfig", "CompletionOutput", "RequestOutput", "InvalidRequestError"]

_MODULE_OF = {
    "LLM": "tokenslice.llm",
    "SamplingParams": "tokenslice.request",
    "CompletionOutput": "tokenslice.request",
    "RequestOutput": "tokenslice.request",
    "InvalidRequestError": "tokenslice.request",
    "EngineConfig": "tokenslice.config",
    "ModelConfig": "tokenslice.config",
    "CacheConfig": "tokenslice.config",
    "SchedulerConfig": "tokenslice.config",
    "ParallelConfig": "tokenslice.config",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenslice' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
