"""Compiled decode (model/compiled_decode.py): greedy tokens equal eager ones, with preemption
(recompute on a 3-block pool), and logprobs agree to float32 rounding; CUDA graphs likewise
where a GPU is present. On CPU everything compiles at start-up: a request whose context and batch
grow later compiles nothing more; behind `tokenslice serve` (engine core in its own process, the
steps built in the background) the compiled server streams the eager server's greedy tokens."""
from __future__ import annotations

import time

import httpx
import numpy as np
import openai
import pytest
import torch
from torch._dynamo.utils import counters

from conftest import STORIES
from serverkit import serve_app
from tokenslice import LLM, SamplingParams
from tokenslice.cli import build_parser
from tokenslice.cli.args import engine_config_from_args
from tokenslice.cli.serve import serve_app_from_args, serve_engine_config
from tokenslice.model.compiled_decode import _pad, buckets
from tokenslice.model.input_batch import DecodeInputs

PROMPTS = [[1, 45, 300, 17], [1, 9, 88, 250], [1, 400, 3, 61]]
# 4 + 20 tokens: context buckets 16 and 32; batches of 1 and 2: few compilations.
SP = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)


def test_buckets_and_padding():
    assert buckets(5) == [1, 2, 4, 8] and buckets(33, 16) == [16, 32, 64] and buckets(1) == [1]
    dec = DecodeInputs(np.array([7, 8]), np.array([20, 3]), np.array([[4, 5], [6, 0]]))
    p = _pad(dec, 4, 3)
    np.testing.assert_array_equal(p.token_ids, [7, 8, 7, 7])
    np.testing.assert_array_equal(p.positions, [20, 3, 20, 20])
    np.testing.assert_array_equal(p.tables, [[4, 5, 0], [6, 0, 0], [4, 5, 0], [4, 5, 0]])


def _generate(**options) -> tuple[list[list[int]], list[list[float]], int]:
    with LLM(str(STORIES), max_batch_size=2, kv_cache_blocks=3, preemption="recompute", **options) as llm:
        outs = llm.generate(PROMPTS, SP)
        return ([o.token_ids for o in outs], [o.logprobs.logprobs for o in outs],
                llm.engine.scheduler.stats.preemptions)


def _check_equal_to_eager(**options) -> None:
    eager_tokens, eager_lps, _ = _generate(**{**options, "compile": False, "cuda_graphs": False})
    tokens, lps, preemptions = _generate(**options)
    assert preemptions > 0
    assert tokens == eager_tokens
    # Padded shapes may sum in another order: equal up to float32 rounding, not bit for bit.
    np.testing.assert_allclose(np.array(lps), np.array(eager_lps), rtol=1e-4, atol=1e-4)


def test_compiled_decode_on_cpu_gives_the_eager_tokens():
    _check_equal_to_eager(compile=True, device="cpu")


def test_cpu_compiles_at_start_up_only():
    with LLM(str(STORIES), max_batch_size=4, kv_cache_blocks=64, compile=True, device="cpu") as llm:
        frames = counters["frames"]["ok"]
        # Contexts from 4 to 200 keys (13 blocks), batches of 1 to 4 rows.
        llm.generate([[1, 45, 300, 17]], SamplingParams(max_tokens=196, temperature=0, ignore_eos=True))
        llm.generate(PROMPTS + [[1, 2, 3]], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        assert counters["frames"]["ok"] == frames


def test_steps_run_with_another_thread_count_run_eager_instead_of_failing():
    """Graphs are guarded on the torch thread count they were built with; a step run with another
    count (an engine core that changed it after the build began) runs eager, same tokens."""
    one = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    threads = torch.get_num_threads()
    with LLM(str(STORIES), kv_cache_blocks=16, compile=True, device="cpu") as llm:
        inductor = llm.engine.executor.runner.compiled.inductor
        expected = llm.generate([PROMPTS[0]], one)[0].token_ids
        steps = inductor.steps
        assert steps > 0
        torch.set_num_threads(threads + 1)
        try:
            assert llm.generate([PROMPTS[0]], one)[0].token_ids == expected
            assert inductor.steps == steps
        finally:
            torch.set_num_threads(threads)
        assert llm.generate([PROMPTS[0]], one)[0].token_ids == expected and inductor.steps > steps


def test_packed_linear_models_compile_only_one_row_steps():
    """builtin:tiny's fused MLP weight is oneDNN-packed: its multi-row steps run eager."""
    def run(compile: bool) -> tuple[list[list[int]], object]:
        with LLM("builtin:tiny", max_batch_size=2, kv_cache_blocks=16, compile=compile, device="cpu") as llm:
            tokens = [o.token_ids for o in llm.generate([[1, 45, 30, 17], [1, 9, 88, 250], [5, 6, 7, 8, 9]], SP)]
            return tokens, llm.engine.executor.runner.compiled
    tokens, compiled = run(True)
    assert compiled is not None and compiled.multi_row is False
    assert tokens == run(False)[0]


def _served_texts(*flags: str) -> list[str]:
    args = build_parser().parse_args(["serve", "--model", str(STORIES), "--dtype", "float32",
                                      "--max-batch-size", "4", "--kv-cache-blocks", "64", *flags])
    with serve_app(serve_app_from_args(args)) as srv:
        # Compiled steps are built in the background (seconds, minutes on a loaded machine): the
        # requests go once they serve. A failure deadline, not a performance check.
        deadline = time.monotonic() + 900.0
        while httpx.get(srv.url("/v1/state")).json()["compiled_decode"]["state"] not in ("ready", "off"):
            assert time.monotonic() < deadline, "compiled decode not built"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=srv.url("/v1"), api_key="x", max_retries=0, timeout=120.0)
        out = client.completions.create(model=srv.info.model_name, prompt=["Once upon a time", "The dog", "Lily"],
                                        max_tokens=60, temperature=0, extra_body={"ignore_eos": True})
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]


def test_served_compiled_decode_gives_the_eager_tokens():
    assert _served_texts() == _served_texts("--no-compile")  # serve compiles by default


def test_serve_compiles_by_default_and_the_python_api_does_not():
    parse = build_parser().parse_args
    assert serve_engine_config(parse(["serve"])).model.compile is True
    assert serve_engine_config(parse(["serve", "--no-compile"])).model.compile is False
    assert not engine_config_from_args(parse(["generate", "--prompt", "x"])).model.compile
    with LLM(str(STORIES), kv_cache_blocks=8) as llm:
        assert llm.engine.executor.runner.compiled is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graphs_give_the_eager_tokens():
    _check_equal_to_eager(cuda_graphs=True, device="cuda", dtype="float32")
