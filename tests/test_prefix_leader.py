"""Sibling samples of one prompt (n > 1) share its KV: each waits until the first has computed
the prompt, then starts from the prefix cache, recomputing only the partial last block."""
from __future__ import annotations

import random

from conftest import STORIES
from tokenslice import LLM, SamplingParams
from tokenslice.request import EngineRequest

_RNG = random.Random(3)
PROMPT = [1] + [_RNG.randrange(3, 500) for _ in range(50)]  # 3 full blocks of 16 + 3 tokens
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _run(llm: LLM, leaders: bool, abort_leader: bool = False) -> list:
    eng = llm.engine
    reqs = [eng.add(EngineRequest(f"s-{i}", PROMPT, GREEDY, prefix_leader="s-0" if leaders and i else None))
            for i in range(3)]
    if abort_leader:
        eng.abort_request("s-0")
    while eng.has_unfinished():
        eng.step()
    return reqs


def test_siblings_attach_the_leaders_prompt():
    with LLM(str(STORIES)) as llm:
        reqs = _run(llm, leaders=True)
        assert reqs[1].output_token_ids == reqs[2].output_token_ids == reqs[0].output_token_ids
        assert llm.engine.scheduler.stats.prefix_cache_device_hits == 2 * 48


def test_without_a_leader_all_compute_the_prompt_at_once():
    with LLM(str(STORIES)) as llm:
        _run(llm, leaders=False)
        assert llm.engine.scheduler.stats.prefix_cache_device_hits == 0


def test_siblings_of_an_aborted_leader_run_anyway():
    with LLM(str(STORIES)) as llm:
        reqs = _run(llm, leaders=True, abort_leader=True)
        assert [r.finish_reason for r in reqs] == ["abort", "length", "length"]
        kv = llm.engine.scheduler.kv
        assert kv.device.num_free == kv.device.num_blocks
