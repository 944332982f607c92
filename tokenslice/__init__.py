"""tokenslice: an LLM inference server that schedules at token granularity."""
from __future__ import annotations

from tokenslice.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tokenslice.llm import LLM
from tokenslice.request import CompletionOutput, InvalidRequestError, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "ModelConfig", "CacheConfig", "SchedulerConfig",
           "ParallelConfig", "CompletionOutput", "RequestOutput", "InvalidRequestError"]
