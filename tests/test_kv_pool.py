"""The device KV pool (model/kv_pool.py) is sized by the command, not by the moment: a pure
function of the settings, the model and the device's total memory; --kv-cache-blocks wins, then
--kv-cache-memory, then --gpu-memory-utilization of total memory less the weights, then the
device's default, each capped by the configured batch's need; a pool that does not fit in what is
free now is an error naming the flag that lowers it. Two starts of a real engine get one pool."""
from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from tokenslice.cli import build_parser
from tokenslice.cli.args import engine_config_from_args
from tokenslice.config import CPU_KV_SHARE, GPU_MEMORY_UTILIZATION, CacheConfig, EngineConfig, ModelConfig
from tokenslice.engine.engine import Engine
from tokenslice.model.arch import ArchConfig
from tokenslice.model.kv_pool import KVPool, check_fits, size_kv_pool
from tokenslice.model.loader import load_arch

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260k"
GIB = 2**30
WEIGHTS = 1_000_000  # bytes of weights on the device, as the caller measures them


@pytest.fixture(scope="module")
def arch() -> ArchConfig:
    return load_arch(ModelConfig(model=str(STORIES)))


def _size(cache: CacheConfig, arch: ArchConfig, total: int = 16 * GIB, device: str = "cpu", batch: int = 64,
          ranks: int = 1) -> KVPool:
    return size_kv_pool(cache, arch, 4, WEIGHTS, total, device, 512, batch, ranks)


def test_block_bytes_come_from_the_architecture(arch: ArchConfig) -> None:
    pool = _size(CacheConfig(kv_cache_blocks=3), arch)
    # 5 layers x (K, V) x 4 KV heads x 8 dims x 4 bytes x 16 tokens.
    assert pool.block_bytes == 5 * 2 * 4 * 8 * 4 * 16 == 20480
    assert (pool.blocks, pool.tokens, pool.nbytes) == (3, 48, 3 * 20480)
    assert _size(CacheConfig(kv_cache_blocks=3), arch, ranks=2).block_bytes == 2 * 20480


def test_explicit_sizes_win_in_order(arch: ArchConfig) -> None:
    both = CacheConfig(kv_cache_blocks=7, kv_cache_memory=GIB, kv_memory_fraction=0.5)
    assert _size(both, arch).blocks == 7 and _size(both, arch).source == "--kv-cache-blocks"
    memory = _size(CacheConfig(kv_cache_memory=GIB, kv_memory_fraction=0.5), arch)
    # Bytes as given, not capped by the batch's need (extra blocks keep cached prefixes).
    assert memory.blocks == GIB // 20480 and memory.source == "--kv-cache-memory 1024 MiB"
    with pytest.raises(ValueError, match="less than one KV block"):
        _size(CacheConfig(kv_cache_memory=20479), arch)


def test_a_fraction_counts_weights_and_kv_of_total_memory_up_to_the_need(arch: ArchConfig) -> None:
    total = GIB
    big = _size(CacheConfig(kv_memory_fraction=0.5), arch, total=total, batch=100_000)
    assert big.blocks == (total // 2 - WEIGHTS) // 20480 and "--gpu-memory-utilization" in big.lower_with
    assert "0.5 of 1.0 GiB total RAM less 0.0 GiB of weights" in big.source
    capped = _size(CacheConfig(kv_memory_fraction=0.5), arch, total=total, batch=4)
    assert capped.blocks == 4 * (512 // 16) and capped.source.startswith("the batch's need (4 x 512 tokens)")
    with pytest.raises(ValueError, match="leaves no room for the KV cache"):
        _size(CacheConfig(kv_memory_fraction=0.0005), arch, total=total)


def test_defaults_differ_by_device(arch: ArchConfig) -> None:
    total = 8 * GIB
    cpu = _size(CacheConfig(), arch, total=total, batch=100_000)
    assert cpu.blocks == int(total * CPU_KV_SHARE) // 20480 and "the CPU default" in cpu.source
    cuda = _size(CacheConfig(), arch, total=total, device="cuda", batch=100_000)
    assert cuda.blocks == (int(total * GPU_MEMORY_UTILIZATION) - WEIGHTS) // 20480
    # A small batch takes only what it can use, on either device.
    assert _size(CacheConfig(), arch, total=total, batch=2).blocks == 64
    # Tensor-parallel ranks sharing the device split its budget (and each holds its weights).
    shared = _size(CacheConfig(kv_memory_fraction=0.5), arch, total=total, batch=100_000, ranks=2)
    assert shared.blocks == (total // 2 - 2 * WEIGHTS) // (2 * 20480)


def test_sizing_depends_on_nothing_but_its_arguments(arch: ArchConfig) -> None:
    caches = [CacheConfig(), CacheConfig(kv_memory_fraction=0.3), CacheConfig(kv_cache_memory=GIB)]
    assert [_size(c, arch, batch=100_000) for c in caches] == [_size(c, arch, batch=100_000) for c in caches]


def test_a_pool_past_what_is_free_is_an_error_naming_the_flag(arch: ArchConfig) -> None:
    pool = _size(CacheConfig(kv_memory_fraction=0.9), arch, total=GIB, batch=100_000)
    check_fits(pool, pool.nbytes, "cpu")
    with pytest.raises(ValueError) as e:
        check_fits(pool, pool.nbytes - 1, "cpu")
    msg = str(e.value)
    assert msg.startswith(f"the KV cache needs {pool.nbytes / 2**20:.0f} MiB ({pool.blocks} blocks of 16 tokens")
    assert "lower it with --gpu-memory-utilization" in msg


def test_cli_flags_reach_the_cache_config() -> None:
    parse = build_parser().parse_args
    c = engine_config_from_args(parse(["serve", "--kv-cache-memory-bytes", "512MiB", "--gpu-memory-utilization",
                                       "0.5"])).cache
    assert (c.kv_cache_memory, c.kv_memory_fraction) == (512 * 2**20, 0.5)
    assert engine_config_from_args(parse(["serve", "--kv-cache-memory", "2G"])).cache.kv_cache_memory == 2 * 10**9
    defaults = engine_config_from_args(parse(["serve"])).cache
    assert (defaults.kv_cache_memory, defaults.kv_memory_fraction) == (None, None)


def test_two_engine_starts_get_the_same_pool(caplog: pytest.LogCaptureFixture) -> None:
    """Memory-bound (a batch that could use more than the default share of RAM), with the memory
    free changed between the starts: the pool stays the same."""
    config = EngineConfig.from_options(model=str(STORIES), device="cpu", max_batch_size=20_000)
    lines, blocks = [], []
    ballast = None
    for _ in range(2):
        with caplog.at_level(logging.INFO, logger="tokenslice.model.runner"):
            engine = Engine.from_config(config)
        try:
            blocks.append(engine.runner.num_blocks)
            lines += [re.sub(r", in [0-9.]+ s$", "", r.getMessage()) for r in caplog.records
                      if r.getMessage().startswith("KV cache:")]
        finally:
            engine.close()
        caplog.clear()
        ballast = b"\x01" * (256 * 2**20)  # written: 256 MiB less available for the second start
    assert ballast is not None and blocks[0] == blocks[1] < 20_000 * 32
    assert len(lines) == 2 and lines[0] == lines[1] and "3% of" in lines[0] and "the CPU default" in lines[0]
