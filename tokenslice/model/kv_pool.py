"""How many device KV blocks an engine gets (docs/DESIGN.md, "The KV pool"): a pure function of the
settings, the model and the device's total memory, so the same command on the same machine gets
the same pool at every start. What is free at the moment only decides whether it fits: a pool
that does not is an error naming what it needs and the flag that lowers it (as vLLM's is).

In order: `kv_cache_blocks` as given; `kv_cache_memory` bytes as given; `kv_memory_fraction`
(vLLM's --gpu-memory-utilization) of total memory for weights and KV together, less the
weights; unset, GPU_MEMORY_UTILIZATION of device memory on CUDA and on CPU CPU_KV_SHARE of total
RAM for the KV alone (config.py). Fractions are capped by what the configured batch can use (max_batch_size
requests of max_model_len tokens)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from tokenslice.config import CPU_KV_SHARE, GPU_MEMORY_UTILIZATION, CacheConfig
from tokenslice.model.arch import ArchConfig
from tokenslice.model.loader import LoadedModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVPool:
    """A device KV pool's size and what sized it (for the start-up line and errors)."""

    blocks: int
    block_size: int
    block_bytes: int  # one block, the partitions of all ranks sharing the device together
    source: str  # what sized it, in words
    lower_with: str  # the flags that make it smaller

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block_bytes


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def size_kv_pool(cache: CacheConfig, arch: ArchConfig, dtype_bytes: int, model_bytes: int, total_bytes: int,
                 device_type: str, max_model_len: int, max_batch_size: int, ranks: int = 1) -> KVPool:
    """The device pool from the settings, the model (its arch, KV element size and weight bytes
    on this device) and the device's total memory. `ranks`: tensor-parallel ranks whose KV
    partitions (`arch` and `model_bytes` are one's) share the device. ValueError when a fraction
    leaves no room for one block."""
    bs = cache.block_size
    block_bytes = bs * arch.kv_bytes_per_token // 4 * dtype_bytes * ranks  # arch counts 4-byte values
    if cache.kv_cache_blocks is not None:
        return KVPool(cache.kv_cache_blocks, bs, block_bytes, "--kv-cache-blocks", "--kv-cache-blocks")
    if cache.kv_cache_memory is not None:
        blocks = cache.kv_cache_memory // block_bytes
        if blocks < 1:
            raise ValueError(f"--kv-cache-memory {cache.kv_cache_memory} bytes is less than one KV block "
                             f"({block_bytes} bytes)")
        return KVPool(blocks, bs, block_bytes, f"--kv-cache-memory {_mib(cache.kv_cache_memory)}",
                      "--kv-cache-memory")
    need = max_batch_size * -(-max_model_len // bs)  # a full batch of full-length requests
    weights = model_bytes * ranks
    fraction = cache.kv_memory_fraction
    if fraction is None and device_type == "cpu":
        budget = int(total_bytes * CPU_KV_SHARE)
        what = f"{CPU_KV_SHARE:.0%} of {_gib(total_bytes)} total RAM (the CPU default)"
    else:
        share = GPU_MEMORY_UTILIZATION if fraction is None else fraction
        budget = int(total_bytes * share) - weights
        what = (f"{share:g} of {_gib(total_bytes)} total {'RAM' if device_type == 'cpu' else 'device memory'} "
                f"less {_gib(weights)} of weights ({'the default ' if fraction is None else ''}"
                f"--gpu-memory-utilization)")
        if budget < block_bytes:
            raise ValueError(f"--gpu-memory-utilization {share:g} of {_gib(total_bytes)} leaves no room for the "
                             f"KV cache after {_gib(weights)} of weights; raise it, or set --kv-cache-memory")
    by_memory = budget // block_bytes
    if need <= by_memory:
        return KVPool(need, bs, block_bytes,
                      f"the batch's need ({max_batch_size} x {max_model_len} tokens), within {what}",
                      "--max-num-seqs or --max-model-len (or set --kv-cache-memory)")
    return KVPool(max(1, by_memory), bs, block_bytes, what,
                  "--kv-cache-memory" if fraction is None else "--gpu-memory-utilization (or set --kv-cache-memory)")


def total_memory_bytes(device: torch.device) -> int:
    """The device's total memory (all of the GPU's, or the machine's RAM), fixed while it runs."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def available_memory_bytes(device: torch.device) -> int:
    """What could be allocated now: free device memory, or the kernel's MemAvailable (free pages
    plus reclaimable cache; plain free pages where /proc/meminfo is missing)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def model_bytes(model: nn.Module) -> int:
    """Bytes of the module's weights and buffers (a tied weight once)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def check_fits(pool: KVPool, available: int, device: str) -> None:
    """ValueError when the pool is more than the `available` bytes free on `device` now."""
    if pool.nbytes > available:
        raise ValueError(f"the KV cache needs {_mib(pool.nbytes)} ({pool.blocks} blocks of {pool.block_size} tokens, "
                         f"sized by {pool.source}) but {device} has {_mib(available)} available now; lower it "
                         f"with {pool.lower_with}, or free memory")


def kv_pool(cache: CacheConfig, loaded: LoadedModel, max_model_len: int, max_batch_size: int,
            ranks: int = 1) -> KVPool:
    """The loaded model's device pool (`size_kv_pool` on this device), checked against what is
    free now. `ranks`: tensor-parallel ranks whose KV partitions (`loaded` is one) share the device."""
    pool = size_kv_pool(cache, loaded.arch, torch.finfo(loaded.dtype).bits // 8, model_bytes(loaded.model),
                        total_memory_bytes(loaded.device), loaded.device.type, max_model_len, max_batch_size,
                        ranks)
    check_fits(pool, available_memory_bytes(loaded.device), str(loaded.device))
    if pool.tokens < max_model_len:
        log.warning("the KV pool holds %d tokens, less than one request of max_model_len %d: longer requests "
                    "are refused (the pool is sized by %s)", pool.tokens, max_model_len, pool.source)
    return pool
