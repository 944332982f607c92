"""KV memory: int8 offload (ALISE §3.2) against full precision on the real engine.

stories260k, 200 Alpaca instructions (prompts cut to 96 tokens), greedy, 64 new tokens each,
skip-join-mlfq with reactive-swap on a device pool too small for the load (so most requests are
swapped out and back, their host copy in int8 or in fp32), host 4x the device pool. Reports the
share of generated tokens equal at the same position, and of requests equal in full.

    .venv/bin/python benchmarks/kv/kv_int8_offload.py
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from tokenslice import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # benchmarks/common: shared helpers
from sched_common import SHARED, code_version, log, machine_line, write_json  # noqa: E402

N = 200
MAX_PROMPT = 96
PARAMS = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
DEVICE_BLOCKS = 24
COMMON = dict(policy="skip-join-mlfq", preemption="reactive-swap", kv_cache_blocks=DEVICE_BLOCKS,
              host_kv_blocks=4 * DEVICE_BLOCKS, max_batch_size=16, starvation_limit_s=0.05)


def run(offload_dtype: str, prompts: list[list[int]]) -> tuple[list[list[int]], dict[str, float]]:
    with LLM(str(SHARED / "models" / "stories260k"), offload_dtype=offload_dtype, **COMMON) as llm:
        eng = llm.engine
        t0 = time.perf_counter()
        reqs = [eng.add_request(p, PARAMS) for p in prompts]
        while eng.has_unfinished():
            eng.step()
        s = eng.scheduler.stats
        stats = {"wall_s": time.perf_counter() - t0, "swap_out_bytes": s.swap_out_bytes,
                 "swap_in_bytes": s.swap_in_bytes, "swapped_requests": sum(1 for r in reqs if r.metrics.swaps),
                 "recomputed_tokens": s.recomputed_tokens}
        return [r.output_token_ids for r in reqs], stats


def main() -> None:
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(SHARED / "models" / "stories260k"))
    data = json.loads((SHARED / "data" / "alpaca_4500.json").read_text())[:N]
    prompts = [tok((d.get("instruction", "") + " " + d.get("input", "")).strip())["input_ids"][:MAX_PROMPT]
               for d in data]
    full, s_full = run("auto", prompts)
    q, s_q = run("int8", prompts)
    same_tokens = sum(a == b for x, y in zip(full, q) for a, b in zip(x, y))
    total = sum(len(x) for x in full)
    same_requests = sum(x == y for x, y in zip(full, q))
    result = {"n": N, "token_match": same_tokens / total, "request_match": same_requests / N,
              "full": s_full, "int8": s_q, "machine": machine_line(), "code": code_version()}
    write_json("kv_int8_offload.json", result)
    log(f"requests swapped: full {s_full['swapped_requests']}, int8 {s_q['swapped_requests']} of {N}")
    print("| offload | swapped requests | swap-out bytes | token match vs full | requests identical |")
    print("|---|---|---|---|---|")
    print(f"| fp32 | {s_full['swapped_requests']} | {s_full['swap_out_bytes']:,} | - | - |")
    print(f"| int8 | {s_q['swapped_requests']} | {s_q['swap_out_bytes']:,} | {same_tokens / total:.1%} "
          f"| {same_requests / N:.1%} |")


if __name__ == "__main__":
    main()
