"""Offline API: LLM(model=...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

from typing import Any

from tokenslice.config import EngineConfig, ModelConfig
from tokenslice.engine.dp_llm import DataParallelLLM
from tokenslice.engine.engine import Engine
from tokenslice.request import CompletionOutput, SamplingParams


class LLM:
    """An engine in this process.

    LLM(model="builtin:tiny", **options): `model` is a local Hugging Face directory, a .gguf file,
    a known model's name (smollm2-135m-instruct) or builtin:tiny; each keyword option is a field of one of the config dataclasses (tokenslice/
    config.py, where every default is written), the same settings as the CLI's engine flags:

    - model: tokenizer, dtype, device, max_model_len, seed, quantization, attention_backend;
    - cache: block_size, kv_cache_blocks, kv_cache_memory, kv_memory_fraction, swap_space_gb, host_kv_blocks,
      offload_dtype;
    - scheduler: policy, preemption, max_batch_size, max_tokens_per_step, mlfq_quantum_ratio,
      mlfq_num_queues, starvation_limit_s, slo_normalized_latency, burst_reserve_jobs,
      burst_reserve_queues, eviction_amortization, srpt_aging, length_predictor;
    - parallel: tensor_parallel_size, pipeline_parallel_size, executor (auto | uni | mp),
      data_parallel_size and router (N engine processes, as `serve -dp N`; `engine` is then absent);
    - profile: the policies' cost model (model@hardware or a `tokenslice profile` JSON).

    An unknown keyword raises TypeError.
    """

    def __init__(self, model: str = ModelConfig.model, **options: Any) -> None:
        try:
            self.config = EngineConfig.from_options(model=model, **options)
        except TypeError as e:
            raise TypeError(f"LLM(): {e}") from None
        self.replicas: DataParallelLLM | None = None
        if self.config.parallel.data_parallel_size > 1:  # engine processes, as `serve -dp N` runs them
            self.replicas = DataParallelLLM(self.config)
        else:
            self.engine = Engine.from_config(self.config)

    @property
    def tokenizer(self) -> Any:
        return self.replicas.tokenizer if self.replicas is not None else self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[CompletionOutput]:
        if self.replicas is not None:
            return self.replicas.generate(prompts, params)
        return self.engine.generate(prompts, params)

    def close(self) -> None:
        if self.replicas is not None:
            self.replicas.close()
        else:
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
