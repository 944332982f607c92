"""Step traces (--step-trace): every real engine step leaves one record whose batch, swap and
recompute counts agree with the engine's own counters, in-process and in the engine core process."""
from __future__ import annotations

import openai
import pytest

from conftest import STORIES
from serverkit import start_server, wait_idle
from test_kv_swap_engine import LONG, SHORT, _run_waves
from tokenslice import LLM
from tokenslice.cli import main
from tokenslice.engine.step_trace import load_step_trace


@pytest.mark.parametrize("preemption", ["recompute", "reactive-swap"])
def test_trace_round_trips_and_matches_the_engine(tmp_path, preemption):
    path = tmp_path / "steps.jsonl"
    # 14 blocks for 12 requests: short prompts arriving later outrank (fixed-priority) the long
    # residents, which must be evicted (dropped or swapped).
    with LLM(str(STORIES), policy="fixed-priority", preemption=preemption, kv_cache_blocks=14, max_batch_size=4,
             host_kv_blocks=64, eviction_amortization=0.0, enable_prefix_caching=False,
             step_trace=str(path)) as llm:
        outputs = _run_waves(llm)
        stats, steps = llm.engine.scheduler.stats, llm.engine.num_steps
    records = load_step_trace(path)
    assert [r.step for r in records] == list(range(1, steps + 1))
    assert all(b.start >= a.start for a, b in zip(records, records[1:]))
    assert sum(r.sampled for r in records) == sum(map(len, outputs)) == 12 * 24
    # Every output token comes from a decode slice but each request's first and the one a
    # recomputed request's prefill samples on resuming.
    assert sum(len(r.decode) for r in records) == 12 * 23 - sum(r.dropped for r in records)
    # Prompt tokens, plus what recompute computes again: the dropped KV and, per dropped request,
    # its last sampled token (not yet in the cache).
    prefilled = sum(chunk for r in records for chunk, _ in r.prefill)
    dropped = sum(r.dropped for r in records)
    assert prefilled == sum(len(p) for p in LONG + SHORT) + stats.recomputed_tokens + dropped
    assert all(r.schedule_s >= 0 and r.execute_s > 0 and r.step_seconds > 0 for r in records)
    swapped_out = sum(r.swap_out_blocks + r.async_blocks for r in records)
    if preemption == "recompute":
        assert sum(r.dropped for r in records) > 0 and stats.recomputed_tokens > 0
        assert swapped_out == 0
    else:
        assert sum(r.dropped for r in records) == 0 and stats.swap_out_bytes > 0
        block_bytes = stats.swap_out_bytes // swapped_out
        assert sum(r.swap_in_blocks for r in records) * block_bytes == stats.swap_in_bytes
        assert sum(r.swap_out_runs + r.swap_in_runs for r in records) == stats.swap_ops
    assert any(r.preempted for r in records) and any(r.waiting for r in records)
    # Each prefill slice names its request: all 12 requests' prompts, each started once from 0.
    assert all(len(r.prefill_ids) == len(r.prefill) for r in records)
    fresh = [rid for r in records for rid, (_, past) in zip(r.prefill_ids, r.prefill) if past == 0]
    assert len(set(fresh)) == 12


@pytest.mark.parametrize("process", ["--engine-process", "--no-engine-process"])
def test_serve_writes_a_trace(tmp_path, process):
    path = tmp_path / "serve.jsonl"
    with start_server("--model", str(STORIES), "--kv-cache-blocks", "32", process, "--step-trace", str(path)) as srv:
        client = openai.OpenAI(base_url=srv.url("/v1"), api_key="none", max_retries=0, timeout=60)
        for prompt in ("Once upon a time", "The cat"):
            out = client.completions.create(model=str(STORIES), prompt=prompt, max_tokens=5, temperature=0)
            assert out.usage.completion_tokens == 5
        wait_idle(srv)
    records = load_step_trace(path)
    assert sum(r.sampled for r in records) == 10
    assert sum(len(r.prefill) for r in records) == 2
    assert [r.step for r in records] == list(range(1, len(records) + 1))


def test_generate_writes_a_trace(tmp_path, capsys):
    path = tmp_path / "generate.jsonl"
    assert main(["--log-level", "WARNING", "generate", "--model", str(STORIES), "--prompt", "Once upon a time",
                 "--prompt", "The cat", "--max-tokens", "6", "--ignore-eos", "--step-trace", str(path)]) == 0
    records = load_step_trace(path)
    assert sum(r.sampled for r in records) == 12
    assert [len(r.prefill) for r in records][0] == 2  # both prompts in the first step
