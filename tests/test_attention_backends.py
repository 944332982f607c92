"""The engine with the triton attention backend gives the sdpa backend's greedy tokens: decode,
whole and chunked prefill, a prefix found in the cache (extend), preemption with KV swapped out
and back. On CPU the kernels run in Triton's interpreter in a child process (TRITON_INTERPRET=1
must be set before triton is imported, and must not leak into other tests); with a GPU the same
checks run natively on CUDA, CUDA graphs on. Backend choice and its errors are checked here too."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

GREEDY = dict(max_tokens=8, temperature=0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[1] + [rng.randrange(3, 500) for _ in range(n)] for n in (3, 17, 40, 70)]


def _run(path: str, backend: str, device: str, **options: object) -> tuple[list[list[int]], int]:
    """Greedy output ids of the prompts and of a second turn, and the bytes swapped out."""
    from tokenslice import LLM, SamplingParams

    prompts = _prompts()
    with LLM(path, attention_backend=backend, device=device, dtype="float32", **options) as llm:
        assert llm.engine.runner.attention_backend == backend
        out = [o.token_ids for o in llm.generate(prompts, SamplingParams(**GREEDY))]
        # A second turn whose prompt starts with the first: its prefix comes from the cache.
        turn2 = [p + o + [5, 6, 7] for p, o in zip(prompts[:2], out[:2])]
        out += [o.token_ids for o in llm.generate(turn2, SamplingParams(**GREEDY))]
        return out, llm.engine.scheduler.stats.swap_out_bytes


CASES = {
    "whole-prefill": {},
    # Prompts in chunks of at most 24 tokens, and 10 blocks of 16 tokens for up to 4 requests of
    # up to 79: memory binds, KV is swapped out and back.
    "chunked-swapped": dict(max_tokens_per_step=24, policy="fixed-priority", preemption="reactive-swap",
                            kv_cache_blocks=10, max_batch_size=4, host_kv_blocks=64, eviction_amortization=0.0),
}


def compare(path: str, device: str) -> dict[str, bool]:
    """Per case: same tokens as sdpa, and KV really swapped where memory binds."""
    reference, _ = _run(path, "sdpa", device, cuda_graphs=False)
    result = {}
    for name, opts in CASES.items():
        tokens, swapped = _run(path, "triton", device, **opts)
        result[name] = tokens == reference and (swapped > 0) == ("swapped" in name)
    return result


def test_triton_backend_gives_the_sdpa_tokens(tiny_checkpoints):
    path = str(tiny_checkpoints["llama"])  # GQA (4 query / 2 KV heads), head size 16
    if torch.cuda.is_available():
        assert all(compare(path, "cuda").values())
        return
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run([sys.executable, __file__, path], env=env, capture_output=True, text=True, timeout=240,
                           cwd=Path(__file__).parent)
    assert child.returncode == 0, child.stderr[-3000:]
    assert json.loads(child.stdout.splitlines()[-1]) == {name: True for name in CASES}


def test_backend_choice_and_errors(tiny_checkpoints):
    from tokenslice import LLM
    from tokenslice.model.attention import resolve_attention_backend

    assert resolve_attention_backend("auto", torch.device("cpu"), 64) == "sdpa"  # the CPU keeps its kernels
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        LLM("builtin:tiny", attention_backend="flash")
    if torch.cuda.is_available():
        assert resolve_attention_backend("auto", torch.device("cuda"), 64) == "triton"
        assert resolve_attention_backend("auto", torch.device("cuda"), 8) == "sdpa"  # stories260k's head size
        with pytest.raises(ValueError, match="power of two"):
            resolve_attention_backend("triton", torch.device("cuda"), 8)
        return
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        LLM(str(tiny_checkpoints["llama"]), attention_backend="triton")
    # Under the interpreter: a head size the kernels do not take is refused by name.
    code = ("import torch; from tokenslice.model.attention import resolve_attention_backend as r; "
            "r('triton', torch.device('cpu'), 8)")
    child = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                           capture_output=True, text=True, timeout=120)
    assert child.returncode != 0 and "power of two >= 16, this model's is 8" in child.stderr


if __name__ == "__main__":  # the child: the interpreter is on in this process
    print(json.dumps(compare(sys.argv[1], "cpu")))
