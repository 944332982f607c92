"""The persistent decode batch (model/input_batch.py): at every step of real engine runs, in
every memory mode under preemption, its arrays equal those built from the plan alone; tokens
and logprobs equal those of the rebuild path; tables are written whole only when a request
joins the decode batch."""
from __future__ import annotations

import random

import numpy as np
import pytest

from conftest import STORIES
from tokenslice import LLM, SamplingParams
from tokenslice.config import PREEMPTION_MODES
from tokenslice.model.input_batch import DecodeBatch, DecodeInputs, decode_inputs
from tokenslice.plan import SeqSlice
from tokenslice.request import SamplingParams as Params


class CheckedBatch(DecodeBatch):
    """The real DecodeBatch, comparing each update with the arrays rebuilt from the plan."""

    def __init__(self) -> None:
        super().__init__(rows=2, width=1)  # small, so rows and columns grow during the run
        self.steps = 0

    def update(self, decode: list[SeqSlice], kv_moved: bool = False) -> DecodeInputs:
        got, want = super().update(decode, kv_moved), decode_inputs(decode)
        np.testing.assert_array_equal(got.token_ids, want.token_ids)
        np.testing.assert_array_equal(got.positions, want.positions)
        np.testing.assert_array_equal(got.tables, want.tables)
        self.steps += bool(decode)
        return got


def _slice(rid: str, pos: int, table: list[int]) -> SeqSlice:
    return SeqSlice(rid, [7], pos, table, True, Params(), 0)


def test_rows_persist_grow_and_are_rewritten_after_a_gap():
    b = DecodeBatch(rows=1, width=1)
    b.update([_slice("a", 3, [4]), _slice("b", 17, [9, 2])])
    assert b.rows_written == 2
    out = b.update([_slice("b", 18, [9, 2]), _slice("a", 16, [4, 5])])  # order changes, a grows
    np.testing.assert_array_equal(out.tables, [[9, 2], [4, 5]])
    assert (b.rows_written, b.rows_grown) == (2, 1)
    b.update([_slice("b", 19, [9, 2])])  # a left (preempted): its row is freed
    assert len(b) == 1
    out = b.update([_slice("a", 16, [1, 3]), _slice("b", 20, [9, 2])])  # a's KV moved meanwhile
    np.testing.assert_array_equal(out.tables, [[1, 3], [9, 2]])
    assert b.rows_written == 3
    b.update([_slice("a", 17, [1, 3]), _slice("b", 21, [6, 2])], kv_moved=True)  # b reloaded elsewhere
    assert b.rows_written == 5
    with pytest.raises(ValueError):
        b.update([_slice("a", 17, [1, 3]), _slice("a", 17, [1, 3])])


PROMPT_RNG = random.Random(3)
PROMPTS = [[1] + [PROMPT_RNG.randrange(3, 500) for _ in range(PROMPT_RNG.randrange(2, 60))] for _ in range(10)]


def _run(persistent: bool, logprobs: int | None = None, **options) -> tuple[list[list[int]], list, LLM]:
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=logprobs)
    llm = LLM(str(STORIES), persistent_batch=persistent, **options)
    if persistent:
        llm.engine.runner.batch = CheckedBatch()
    reqs = [llm.engine.add_request(p, sp, expected_output_tokens=24) for p in PROMPTS]
    lps: list = []
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            if out.logprobs:
                lps.append((out.request_id, out.logprobs))
    return [r.output_token_ids for r in reqs], lps, llm


MODES = [dict(preemption=m) for m in PREEMPTION_MODES] + [
    # int8 offload is lossy, so tokens depend on when evictions happen: fcfs evicts at the same
    # steps in every run (no wall-clock starvation limit).
    dict(preemption="reactive-swap", offload_dtype="int8", policy="fcfs"),
    dict(preemption="recompute", enable_prefix_caching=False, max_tokens_per_step=24)]  # chunked prefill


@pytest.fixture(scope="module")
def unpressured() -> list[list[int]]:
    """Tokens of the rebuild path with memory to spare (no preemption)."""
    tokens, _, llm = _run(False, max_batch_size=4)
    llm.close()
    return tokens


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(str(v) for v in m.values()))
def test_tokens_equal_to_the_rebuild_path_under_preemption(mode, unpressured):
    # 12 blocks of 16 tokens for 10 requests of up to 84 tokens: memory binds; skip-join-mlfq
    # with a short starvation limit pauses and evicts (the test of tests/test_kv_swap_engine.py).
    options = dict(kv_cache_blocks=12, max_batch_size=4, host_kv_blocks=64, starvation_limit_s=0.01,
                   eviction_amortization=0.0, **{"policy": "skip-join-mlfq", **mode})
    ref = unpressured
    if mode.get("offload_dtype") == "int8":  # lossy: the same evictions on the rebuild path
        ref, _, llm_ref = _run(False, **options)
        llm_ref.close()
    got, _, llm = _run(True, **options)
    try:
        assert got == ref
        batch = llm.engine.runner.batch
        assert batch.steps > 0 and batch.rows_grown > 0
        if mode["preemption"] != "defer":
            assert llm.engine.scheduler.stats.preemptions > 0
    finally:
        llm.close()


def test_logprobs_equal_to_the_rebuild_path():
    ref_tokens, ref, llm_ref = _run(False, logprobs=3, max_batch_size=4)
    llm_ref.close()
    tokens, got, llm = _run(True, logprobs=3, max_batch_size=4)
    llm.close()
    assert tokens == ref_tokens and got == ref and len(got) == 10 * 24
