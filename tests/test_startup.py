"""Start-up (model/inductor_decode.py): compiled decode built on a thread while steps run eager.
Requests are served before compilation ends, and the greedy tokens are the eager ones before and
after the compiled steps are swapped in. Compilation is held back deterministically by holding
dynamo's compile lock (the compile thread needs it for its first graph), never by timing; each
test first drops the graphs that earlier tests left in this process (torch._dynamo.reset), which
would otherwise serve at once."""
from __future__ import annotations

import threading

import httpx
import openai
import torch
from torch._dynamo.convert_frame import compile_lock

from conftest import STORIES
from serverkit import serve_app
from tokenslice import LLM, SamplingParams
from tokenslice.cli import build_parser
from tokenslice.cli.serve import serve_app_from_args
from tokenslice.model.inductor_decode import inductor_cache_dir

PROMPTS = [[1, 45, 300, 17], [1, 9, 88, 250]]
SP = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
BUILD_TIMEOUT_S = 900.0  # a failure deadline for a cold compilation on a loaded machine


def _one_by_one(llm: LLM) -> list[list[int]]:
    return [llm.generate([p], SP)[0].token_ids for p in PROMPTS]


def test_background_compile_serves_eager_then_compiled_with_the_eager_tokens() -> None:
    # One row per step (max_batch_size=1): the graphs a fresh server meets first (one layer's,
    # then, stories260k being tiny, the whole model's).
    with LLM(str(STORIES), max_batch_size=1, kv_cache_blocks=16) as llm:
        eager = _one_by_one(llm)
    torch._dynamo.reset()
    with compile_lock:  # the build cannot compile its first graph until this is released
        llm = LLM(str(STORIES), max_batch_size=1, kv_cache_blocks=16, compile=True, compile_in_background=True)
        runner = llm.engine.executor.runner
        before = _one_by_one(llm)
        status = runner.compile_status()
        assert (status.state, status.buckets_ready, status.steps) == ("pending", 0, 0)
    try:
        assert runner.compiled.wait(BUILD_TIMEOUT_S)
        after = _one_by_one(llm)
        status = runner.compile_status()
        assert status.state == "ready" and status.buckets_ready == status.buckets
        assert status.steps >= len(PROMPTS) * (SP.max_tokens - 1)  # every decode step ran compiled
    finally:
        llm.close()
    assert before == eager and after == eager


def test_server_answers_while_decode_compiles() -> None:
    args = build_parser().parse_args(["serve", "--model", str(STORIES), "--max-batch-size", "1",
                                      "--kv-cache-blocks", "16", "--no-engine-process"])
    held = threading.Event()
    release = threading.Event()

    def hold_compilation() -> None:
        with compile_lock:
            held.set()
            release.wait()

    torch._dynamo.reset()
    holder = threading.Thread(target=hold_compilation)
    holder.start()
    held.wait()
    try:
        with serve_app(serve_app_from_args(args)) as srv:
            assert httpx.get(srv.url("/health")).status_code == 200
            client = openai.OpenAI(base_url=srv.url("/v1"), api_key="x", max_retries=0, timeout=120.0)
            out = client.completions.create(model=srv.info.model_name, prompt="Once upon a time", max_tokens=8,
                                            temperature=0)
            assert out.choices[0].finish_reason == "length"
            runner = srv.engine.runner
            status = runner.compile_status()
            assert (status.state, status.buckets_ready, status.steps) == ("pending", 0, 0)
    finally:
        release.set()
        holder.join()
    assert runner.compiled.wait(BUILD_TIMEOUT_S)  # stopped after its one bucket: no thread outlives the test


def test_inductor_cache_dir_is_a_user_cache_dir(monkeypatch) -> None:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere/cache")
    for unset_or_inductors_default in (None, default_cache_dir()):
        if unset_or_inductors_default is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", unset_or_inductors_default)
        assert str(inductor_cache_dir()) == "/somewhere/cache/tokenslice/inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/mine")
    assert str(inductor_cache_dir()) == "/mine"
