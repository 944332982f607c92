"""ModelRunner: owns the model and the KV tensors; turns a StepPlan into one forward pass."""
from __future__ import annotations

import os
import time

import torch

from tokenslice.config import CacheConfig
from tokenslice.model.attention import build_metadata
from tokenslice.model.loader import LoadedModel
from tokenslice.model.sampler import Sampler
from tokenslice.plan import StepPlan, StepResult


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def num_kv_blocks(cache: CacheConfig, loaded: LoadedModel, max_model_len: int, max_batch_size: int) -> int:
    """Explicit --kv-cache-blocks wins; otherwise a fraction of free memory, but never more than
    a full batch of full-length requests could use."""
    if cache.kv_cache_blocks is not None:
        return cache.kv_cache_blocks
    elem = torch.finfo(loaded.dtype).bits // 8
    block_bytes = cache.block_size * loaded.arch.kv_bytes_per_token // 4 * elem
    by_memory = int(available_memory_bytes(loaded.device) * cache.kv_memory_fraction) // block_bytes
    by_need = max_batch_size * -(-max_model_len // cache.block_size)
    return max(1, min(by_memory, by_need))


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, seed: int = 0) -> None:
        a = loaded.arch
        self.model = loaded.model
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Zeroed: padded attention slots read unwritten blocks and must not hold NaNs.
        self.kv = torch.zeros(a.num_layers, 2, num_blocks, block_size, a.num_kv_heads, a.head_dim,
                              dtype=self.dtype, device=self.device)
        self.sampler = Sampler(self.device, seed)
        self.prep_seconds = 0.0  # summed time turning plans into tensors (overhead accounting)

    @property
    def block_bytes(self) -> int:
        return self.kv[:, :, 0].numel() * self.kv.element_size()

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        self.sampler.forget(plan.finished)
        if plan.is_empty:
            return StepResult(step_seconds=time.perf_counter() - t0)
        slices = plan.decode + plan.prefill
        ids: list[int] = []
        for s in slices:
            ids.extend(s.token_ids)
        input_ids = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
        meta = build_metadata(plan.decode, plan.prefill, self.block_size, self.device)
        self.prep_seconds += time.perf_counter() - t0
        hidden = self.model(input_ids, meta, self.kv)
        # Logits only for the last token of each slice that samples.
        last, sampling = [], []
        end = 0
        for s in slices:
            end += s.num_tokens
            if s.sample:
                last.append(end - 1)
                sampling.append(s)
        sampled: dict[str, int] = {}
        if sampling:
            logits = self.model.compute_logits(hidden[torch.tensor(last, device=self.device)]).float()
            for s, tok in zip(sampling, self.sampler.sample(logits, sampling), strict=True):
                sampled[s.request_id] = tok
        return StepResult(sampled=sampled, step_seconds=time.perf_counter() - t0)

    @torch.inference_mode()
    def prompt_logits(self, plan: StepPlan) -> torch.Tensor:
        """Logits at every position of a prefill-only plan (for checks against a reference)."""
        slices = plan.decode + plan.prefill
        ids = [t for s in slices for t in s.token_ids]
        meta = build_metadata(plan.decode, plan.prefill, self.block_size, self.device)
        hidden = self.model(torch.tensor(ids, device=self.device), meta, self.kv)
        return self.model.compute_logits(hidden).float()
