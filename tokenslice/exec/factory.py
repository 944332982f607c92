"""The model side of an engine, built from its config: the executor (in this process, one worker
process per rank, or one Ray actor per rank), the tokenizer, and the KV pool sizes it leaves
(docs/DESIGN.md, Executor)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tokenslice.config import EngineConfig
from tokenslice.exec.base import Executor

log = logging.getLogger(__name__)


@dataclass
class ModelSide:
    """The executor `start_model` built, and what the rest of the engine needs from it."""

    executor: Executor
    arch: Any  # model.arch.ArchConfig of the whole model
    tokenizer: Any
    name: str
    max_len: int
    blocks: int  # device KV blocks (on every rank)
    host_blocks: int
    swap_block_bytes: int  # one block on the host tier, whole model (all ranks)
    runner: Any = None  # model.runner.ModelRunner when the model runs in this process
    async_scheduling: bool = False  # the executor overlaps a step with the planning of the next

    @property
    def eos_token_ids(self) -> list[int]:
        from tokenslice.model.loader import eos_token_ids

        return eos_token_ids(self.tokenizer, self.arch)


def start_model(config: EngineConfig, host_tier: bool) -> ModelSide:
    """The model in this process, or in one worker (process or Ray actor) per rank; `host_tier`:
    the preemption strategy swaps, so size a host KV pool too."""
    if config.parallel.multiproc or config.parallel.executor == "ray":
        return _start_workers(config, host_tier)
    t0 = time.perf_counter()
    log.info("loading the model %s (code, weights, tokenizer)", config.model.model)
    from tokenslice.exec.local import LocalExecutor
    from tokenslice.model.loader import load_model, parameter_count
    from tokenslice.model.kv_pool import kv_pool
    from tokenslice.model.runner import ModelRunner, num_host_kv_blocks

    loaded = load_model(config.model)
    log.info("model loaded in %.1f s: %s, %.0f M parameters, %s on %s", time.perf_counter() - t0,
             loaded.arch.architecture, parameter_count(loaded.arch) / 1e6,
             str(loaded.dtype).removeprefix("torch."), loaded.device)
    limit = loaded.arch.max_position_embeddings
    max_len = min(config.model.max_model_len or limit, limit)
    pool = kv_pool(config.cache, loaded, max_len, config.scheduler.max_batch_size)
    blocks = pool.blocks
    host_blocks = num_host_kv_blocks(config.cache, loaded) if host_tier else 0
    runner = ModelRunner(loaded, blocks, config.cache.block_size, config.model.seed,
                         num_host_blocks=host_blocks, offload_dtype=config.cache.offload_dtype,
                         persistent_batch=config.model.persistent_batch, compile=bool(config.model.compile),
                         cuda_graphs=config.model.cuda_graphs, max_batch_size=config.scheduler.max_batch_size,
                         max_model_len=max_len, attention_backend=config.model.attention_backend,
                         compile_in_background=bool(config.model.compile_in_background), kv_source=pool.source)
    overlap = config.async_scheduling_on(loaded.device.type)
    return ModelSide(LocalExecutor(runner, overlap=overlap), loaded.arch, loaded.tokenizer, loaded.name, max_len,
                     blocks, host_blocks, runner.host_block_bytes, runner, overlap)


def _ranks_device(config: EngineConfig) -> str:
    """The ranks' device. auto is CUDA only when this machine has a GPU for every rank (each rank
    takes its own), else CPU (gloo); an explicit cuda with too few GPUs is an error here rather than
    a worker's crash. A Ray cluster's GPUs are not this machine's: left to the actors."""
    import torch

    par, device = config.parallel, config.model.device
    ranks = par.tensor_parallel_size * par.pipeline_parallel_size
    if par.executor == "ray" and par.ray_address is not None:
        return device
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto":
        if 0 < gpus < ranks:
            log.warning("%d ranks but %d GPU(s): the ranks run on CPU; pass --device cuda on a machine "
                        "with a GPU per rank", ranks, gpus)
        return "cuda" if gpus >= ranks else "cpu"
    if device.startswith("cuda") and gpus < ranks:
        raise ValueError(f"{ranks} ranks (tensor x pipeline parallel) need {ranks} GPUs, this machine has {gpus}")
    return device


def _start_workers(config: EngineConfig, host_tier: bool) -> ModelSide:
    """One worker per rank; the workers size their own KV pools and report them."""
    from tokenslice.model.loader import load_arch, model_tokenizer
    from tokenslice.model.pp import PPStage
    from tokenslice.model.tp import TPShard

    par = config.parallel
    config = replace(config, model=replace(config.model, device=_ranks_device(config)))
    arch = load_arch(config.model)
    TPShard(arch, 0, par.tensor_parallel_size)  # refuses a size the heads do not fit
    PPStage.of(arch, 0, par.pipeline_parallel_size, par.stage_layers)  # ... or more stages than layers
    limit = arch.max_position_embeddings
    max_len = min(config.model.max_model_len or limit, limit)
    tokenizer = model_tokenizer(config.model, arch)
    t0 = time.perf_counter()
    log.info("starting %d %s worker(s)", par.tensor_parallel_size * par.pipeline_parallel_size,
             "Ray" if par.executor == "ray" else "process")
    sizes = dict(max_model_len=max_len, max_batch_size=config.scheduler.max_batch_size, host_tier=host_tier,
                 pp_size=par.pipeline_parallel_size, pp_layers=par.stage_layers)
    if par.executor == "ray":
        from tokenslice.exec.ray_executor import RayExecutor

        ex: Any = RayExecutor(config.model, config.cache, par.tensor_parallel_size, address=par.ray_address,
                              dashboard=par.ray_dashboard, **sizes)
    else:
        from tokenslice.exec.multiproc import MultiprocExecutor

        ex = MultiprocExecutor(config.model, config.cache, par.tensor_parallel_size, **sizes)
    log.info("%d worker(s) ready in %.1f s", par.tensor_parallel_size * par.pipeline_parallel_size,
             time.perf_counter() - t0)
    device_type = "cuda" if config.model.device.startswith("cuda") else "cpu"
    return ModelSide(ex, arch, tokenizer, str(Path(config.model.model)), max_len, ex.num_blocks,
                     ex.num_host_blocks, ex.host_block_bytes, async_scheduling=config.async_scheduling_on(device_type))
