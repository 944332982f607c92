"""Offline API: LLM(model=...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

from typing import Any

from tokenslice.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenslice.engine.engine import Engine
from tokenslice.request import CompletionOutput, SamplingParams


class LLM:
    def __init__(self, model: str = "builtin:tiny", *, dtype: str = "auto", device: str = "auto",
                 policy: str = "fcfs", preemption: str = "recompute", max_batch_size: int = 64,
                 max_tokens_per_step: int = 2048, kv_cache_blocks: int | None = None, block_size: int = 16,
                 max_model_len: int | None = None, tokenizer: str | None = None, seed: int = 0,
                 profile: str | None = None, swap_space_gb: float = 4.0, host_kv_blocks: int | None = None,
                 offload_dtype: str = "auto", **scheduler_options: Any) -> None:
        self.config = EngineConfig(
            model=ModelConfig(model=model, tokenizer=tokenizer, dtype=dtype, device=device,
                              max_model_len=max_model_len, seed=seed),
            cache=CacheConfig(block_size=block_size, kv_cache_blocks=kv_cache_blocks, swap_space_gb=swap_space_gb,
                              host_kv_blocks=host_kv_blocks, offload_dtype=offload_dtype),
            scheduler=SchedulerConfig(policy=policy, preemption=preemption, max_batch_size=max_batch_size,
                                      max_tokens_per_step=max_tokens_per_step, **scheduler_options),
            profile=profile)
        self.engine = Engine.from_config(self.config)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[CompletionOutput]:
        return self.engine.generate(prompts, params)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
