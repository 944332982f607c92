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

from waves import PRESSURE, run_waves

GREEDY = dict(max_tokens=8, temperature=0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[1] + [rng.randrange(3, 500) for _ in range(n)] for n in (3, 17, 40, 70)]


def _run(path: str, backend: str, device: str, **options: object) -> list[list[int]]:
    """Greedy output ids of the prompts, then of a second turn whose prompts start with the first
    turn's (their prefix comes from the cache: an extend)."""
    from tokenslice import LLM, SamplingParams

    prompts = _prompts()
    with LLM(path, attention_backend=backend, device=device, dtype="float32", **options) as llm:
        assert llm.engine.runner.attention_backend == backend
        out = [o.token_ids for o in llm.generate(prompts, SamplingParams(**GREEDY))]
        turn2 = [p + o + [5, 6, 7] for p, o in zip(prompts[:2], out[:2])]
        return out + [o.token_ids for o in llm.generate(turn2, SamplingParams(**GREEDY))]


def _run_swapped(path: str, backend: str, device: str) -> tuple[list[list[int]], int]:
    """Long prompts in chunks of 24 tokens, then short ones that outrank them while memory binds:
    residents are swapped out and back. Output ids and the bytes swapped out."""
    from tokenslice import LLM

    with LLM(path, attention_backend=backend, device=device, preemption="reactive-swap", max_tokens_per_step=24,
             cuda_graphs=backend == "triton", **PRESSURE) as llm:
        return run_waves(llm.engine), llm.engine.scheduler.stats.swap_out_bytes


def compare(path: str, device: str) -> dict[str, bool]:
    """Per case: the triton backend's tokens equal sdpa's (and KV really moved where it should)."""
    swapped, swapped_bytes = _run_swapped(path, "triton", device)
    return {"prefill-decode-extend": _run(path, "triton", device) == _run(path, "sdpa", device, cuda_graphs=False),
            "chunked-swapped": swapped == _run_swapped(path, "sdpa", device)[0] and swapped_bytes > 0}


def test_triton_backend_gives_the_sdpa_tokens(tiny_checkpoints):
    path = str(tiny_checkpoints["llama"])  # GQA (4 query / 2 KV heads), head size 16
    if torch.cuda.is_available():
        assert all(compare(path, "cuda").values())
        return
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run([sys.executable, __file__, path], env=env, capture_output=True, text=True, timeout=240,
                           cwd=Path(__file__).parent)
    assert child.returncode == 0, child.stderr[-3000:]
    assert json.loads(child.stdout.splitlines()[-1]) == {"prefill-decode-extend": True, "chunked-swapped": True}


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
