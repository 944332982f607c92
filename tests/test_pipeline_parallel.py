"""Pipeline parallelism over worker processes (CPU, gloo): -pp 2 and -tp 2 -pp 2 generate what
one process generates, in fp32, with two batches in flight, preemptions and swaps really
happening (each stage swapping its own layers' KV); a stage holds only its layers; the server
answers with -pp 2. Each -pp 2 engine starts once per module and runs several scenarios."""
from __future__ import annotations

import pytest

from conftest import STORIES
from test_tensor_parallel import (PRESSURE, _assert_all_free, _assert_mode_acted, _one_rank, _reschedule, _run_waves,
                                  kill_rank_raises_and_close_reaps)
from tokenslice import LLM, SamplingParams
from tokenslice.cli import build_parser
from tokenslice.cli.args import engine_config_from_args
from tokenslice.config import PREEMPTION_MODES, EngineConfig, ModelConfig
from tokenslice.exec.multiproc import MultiprocExecutor
from tokenslice.model.arch import ModelLoadError
from tokenslice.model.loader import load_arch, load_model
from tokenslice.model.pp import PPStage, balanced_counts
from waves import count_in_flight

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def stories_pp2():
    with LLM(str(STORIES), pipeline_parallel_size=2, preemption="reactive-swap", **PRESSURE) as llm:
        assert isinstance(llm.engine.executor, MultiprocExecutor) and llm.engine.max_in_flight == 2
        yield llm


def test_cli_and_config():
    args = build_parser().parse_args(["generate", "--prompt", "x", "-pp", "2", "-tp", "2"])
    cfg = engine_config_from_args(args)
    assert cfg.parallel.pipeline_parallel_size == 2 and cfg.parallel.world_size == 4 and cfg.parallel.multiproc
    assert EngineConfig.from_options(pipeline_parallel_size=2).parallel.multiproc
    with pytest.raises(ValueError, match="executor uni"):
        EngineConfig.from_options(pipeline_parallel_size=2, executor="uni").validate()
    with pytest.raises(ValueError, match="pipeline_parallel_size must be >= 1"):
        EngineConfig.from_options(pipeline_parallel_size=0).validate()
    with pytest.raises(ModelLoadError, match="pipeline_parallel_size 6 exceeds the model's 5 layers"):
        LLM(str(STORIES), pipeline_parallel_size=6)  # refused before any worker starts


def test_stage_arithmetic_and_a_stage_holds_only_its_layers():
    arch = load_arch(ModelConfig(str(STORIES)))  # 5 layers, head tied to the embedding
    first, last = PPStage.of(arch, 0, 2), PPStage.of(arch, 1, 2)
    assert (first.layers, last.layers) == ((0, 2), (2, 5))  # uneven: the later stage takes the extra
    assert first.local_name("model.layers.1.mlp.up_proj.weight") == "model.layers.1.mlp.up_proj.weight"
    assert first.local_name("model.layers.2.mlp.up_proj.weight") is None
    assert last.local_name("model.layers.2.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert last.global_name("model.layers.0.mlp.up_proj.weight") == "model.layers.2.mlp.up_proj.weight"
    assert (first.local_name("model.norm.weight"), last.local_name("model.norm.weight")) == (None, "model.norm.weight")
    assert last.local_name("model.embed_tokens.weight") == "lm_head.weight"  # the tied head's tensor
    whole = load_model(ModelConfig(str(STORIES), dtype="float32"), with_tokenizer=False).model
    parts = [load_model(ModelConfig(str(STORIES), dtype="float32"), with_tokenizer=False, stage=s)
             for s in (first, last)]
    assert [p.arch.num_layers for p in parts] == [2, 3]  # and so each stage's KV pool
    m0, m1 = parts[0].model, parts[1].model
    assert m0.lm_head is None and m0.model.norm is None and m1.model.embed_tokens is None
    assert (m1.model.layers[0].mlp.down_proj.weight_t == whole.model.layers[2].mlp.down_proj.weight_t).all()
    assert (m1.lm_head.weight == whole.model.embed_tokens.weight).all()


def test_layer_counts_set_the_split():
    arch = load_arch(ModelConfig(str(STORIES)))  # 5 layers
    assert [PPStage.of(arch, i, 2, (4, 1)).layers for i in range(2)] == [(0, 4), (4, 5)]
    assert [PPStage.of(arch, i, 3, (1, 3, 1)).layers for i in range(3)] == [(0, 1), (1, 4), (4, 5)]
    for bad in ((5, 0), (2, 2), (1, 1, 3)):
        with pytest.raises(ModelLoadError, match="pipeline layers"):
            PPStage.of(arch, 0, 2, bad)
    assert EngineConfig.from_options(pipeline_parallel_size=2, pipeline_layers="4,1").parallel.stage_layers == (4, 1)
    for text in ("4", "4,x"):
        with pytest.raises(ValueError, match="pipeline_layers"):
            EngineConfig.from_options(pipeline_parallel_size=2, pipeline_layers=text).validate()
    # Measured times: a layer 6 ms, the LM head 11 ms; 8 layers over 2 stages.
    assert balanced_counts(6.0, 11.0, 8, 2) == (5, 3)  # 30 / 29 ms, against 24 / 35 for 4 + 4
    assert balanced_counts(1.0, 0.0, 8, 2) == (4, 4) and balanced_counts(1.0, 0.0, 5, 2) == (2, 3)
    assert balanced_counts(1.0, 100.0, 5, 3) == (2, 2, 1)  # the head alone outweighs the rest


def test_an_uneven_split_matches_one_process_with_swaps():
    want, one = _one_rank(str(STORIES), preemption="reactive-swap")
    with LLM(str(STORIES), pipeline_parallel_size=2, pipeline_layers="4,1", preemption="reactive-swap",
             **PRESSURE) as llm:
        assert _run_waves(llm.engine) == want
        assert llm.engine.scheduler.stats.swap_out_bytes > 0
        assert llm.engine.scheduler.preemption.swap_block_bytes == one.preemption.swap_block_bytes
        _assert_all_free(llm.engine.scheduler)


@pytest.mark.parametrize("preemption", PREEMPTION_MODES)
def test_stories_every_memory_mode_matches_one_process(stories_pp2, preemption):
    want, one = _one_rank(str(STORIES), preemption=preemption)
    engine = stories_pp2.engine
    _reschedule(engine, preemption)
    in_flight = count_in_flight(engine)
    assert _run_waves(engine) == want
    assert max(in_flight) == 2  # two batches were in the pipe at once
    _assert_mode_acted(engine.scheduler.stats, preemption)
    # The whole model's block: swap byte counts compare with one process.
    assert engine.scheduler.preemption.swap_block_bytes == one.preemption.swap_block_bytes
    _assert_all_free(engine.scheduler)
    ex = engine.executor
    assert all(s > 0 for s in ex.stage_busy_s) and all(w >= 0 for w in ex.stage_wait_s)


def test_seeded_sampling_matches_one_process(stories_pp2):
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7),
              SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3, logprobs=2, ignore_eos=True)]
    prompts = [[1, 72, 101, 108], [1, 33, 44, 55, 66]]
    with LLM(str(STORIES), dtype="float32") as one:
        want = one.generate(prompts, params)
    _reschedule(stories_pp2.engine, "recompute")
    got = stories_pp2.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[1].logprobs.logprobs == pytest.approx(want[1].logprobs.logprobs, abs=1e-4)


def test_a_killed_stage_raises_and_close_reaps(stories_pp2):
    # Last user of the module's engine: it breaks it. The first stage's worker dies while the
    # other waits for its activations: the engine raises instead of hanging.
    kill_rank_raises_and_close_reaps(stories_pp2, 0)


def test_tp2_pp2_matches_one_process_with_swaps():
    want, one = _one_rank(str(STORIES), preemption="reactive-swap")
    with LLM(str(STORIES), tensor_parallel_size=2, pipeline_parallel_size=2, preemption="reactive-swap",
             **PRESSURE) as llm:
        assert llm.engine.executor.size == 4
        assert _run_waves(llm.engine) == want
        stats = llm.engine.scheduler.stats
        assert stats.preemptions > 0 and stats.swap_out_bytes > 0
        assert llm.engine.scheduler.preemption.swap_block_bytes == one.preemption.swap_block_bytes
        _assert_all_free(llm.engine.scheduler)


@pytest.mark.parametrize("kind", ["llama", "opt"])
def test_tiny_checkpoints_match_one_process_with_swaps(kind, tiny_checkpoints):
    # Two layers: one per stage. llama: GQA, untied head; opt: positions and projections on stage 0.
    path = str(tiny_checkpoints[kind])
    want, _ = _one_rank(path, preemption="reactive-swap")
    with LLM(path, pipeline_parallel_size=2, preemption="reactive-swap", **PRESSURE) as llm:
        assert _run_waves(llm.engine) == want
        assert llm.engine.scheduler.stats.swap_out_bytes > 0
        _assert_all_free(llm.engine.scheduler)


def test_server_with_two_stages_answers_like_one():
    import openai

    from serverkit import start_server

    prompts = [[1, 72, 101, 108, 108, 111], [1, 87, 111]]
    with LLM("builtin:tiny") as one:
        want = [o.text for o in one.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))]
    with start_server("-pp", "2") as srv:
        client = openai.OpenAI(base_url=srv.url("/v1"), api_key="none")
        for prompt, text in zip(prompts, want, strict=True):
            r = client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.choices[0].text == text and r.usage.completion_tokens == 10
