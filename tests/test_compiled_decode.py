"""Compiled decode (model/compiled_decode.py): greedy tokens equal eager ones, with preemption
(recompute on a 3-block pool), and logprobs agree to float32 rounding; CUDA graphs likewise
where a GPU is present."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import STORIES
from tokenslice import LLM, SamplingParams
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graphs_give_the_eager_tokens():
    _check_equal_to_eager(cuda_graphs=True, device="cuda", dtype="float32")
