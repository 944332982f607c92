"""Tensor parallelism over worker processes (CPU, gloo): -tp 2 generates what -tp 1 generates, in
fp32, for every supported architecture and memory mode, with swaps and preemptions really
happening; a killed worker makes the engine raise instead of hanging. Each -tp 2 engine starts
once per module and runs several scenarios (each start spawns two workers)."""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from conftest import STORIES, build_tiny_checkpoint
from tokenslice import LLM, SamplingParams
from tokenslice.cli import build_parser
from tokenslice.cli.args import engine_config_from_args
from tokenslice.config import PREEMPTION_MODES, EngineConfig, SchedulerConfig
from tokenslice.engine.engine import Engine
from tokenslice.sim.executor import SimulatedExecutor
from tokenslice.exec.multiproc import MultiprocExecutor, WorkerError
from tokenslice.kv.manager import KVManager
from tokenslice.model.arch import ModelLoadError, parse_config
from tokenslice.model.tp import TPShard
from tokenslice.plan import SeqSlice, StepPlan
from tokenslice.request import StructuredOutput
from tokenslice.predict.cost import load_cost_model
from tokenslice.sched.policy import PolicyContext
from tokenslice.sched.registry import PREEMPTION_STRATEGIES, make_policy
from tokenslice.sched.scheduler import Scheduler
from tokenslice.sched.stats import SchedulerStats
from waves import GREEDY, LONG, PRESSURE, SHORT, check_plans_in_flight_come_back_in_order
from waves import run_waves as _run_waves

pytestmark = pytest.mark.timeout(240)

def _one_rank(path: str, **settings) -> tuple[list[list[int]], Scheduler]:
    with LLM(path, **{**PRESSURE, **settings}) as one:
        return _run_waves(one.engine), one.engine.scheduler


def _reschedule(engine: Engine, preemption: str) -> None:
    """A fresh scheduler in another memory mode over the same workers (their KV pools stay)."""
    old = engine.scheduler
    cfg = SchedulerConfig(policy="fixed-priority", preemption=preemption, max_batch_size=4, eviction_amortization=0.0,
                          stall_guard="off")
    swapping = PREEMPTION_STRATEGIES[preemption].uses_host_tier
    kv = KVManager(old.kv.block_size, old.kv.device.num_blocks, engine.executor.num_host_blocks if swapping else 0,
                   contiguous=swapping)
    ctx = PolicyContext(cfg)
    engine.scheduler = Scheduler(cfg, make_policy(cfg.policy, ctx), kv, ctx,
                                 swap_block_bytes=old.preemption.swap_block_bytes)


def _assert_mode_acted(stats: SchedulerStats, preemption: str) -> None:
    """The memory mode really preempted, recomputed or swapped (every swap-out came back)."""
    if preemption != "defer":
        assert stats.preemptions > 0
    if preemption == "recompute":
        assert stats.recomputed_tokens > 0
    if PREEMPTION_STRATEGIES[preemption].uses_host_tier:
        assert stats.swap_out_bytes > 0 and stats.swap_in_bytes == stats.swap_out_bytes


def _assert_all_free(sched: Scheduler) -> None:
    kv = sched.kv
    kv.check()
    assert kv.device.num_free == kv.device.num_blocks and kv.host.num_free == kv.host.num_blocks
    assert kv.num_in_flight == 0


@pytest.fixture(scope="module")
def stories_tp2():
    with LLM(str(STORIES), tensor_parallel_size=2, preemption="reactive-swap", **PRESSURE) as llm:
        assert isinstance(llm.engine.executor, MultiprocExecutor)
        yield llm


def test_cli_and_config():
    args = build_parser().parse_args(["generate", "--prompt", "x", "-tp", "2"])
    cfg = engine_config_from_args(args)
    assert cfg.parallel.tensor_parallel_size == 2 and cfg.parallel.executor == "auto" and cfg.parallel.multiproc
    assert EngineConfig.from_options(executor="mp").parallel.multiproc
    assert not EngineConfig.from_options().parallel.multiproc
    with pytest.raises(ValueError, match="executor uni"):
        EngineConfig.from_options(tensor_parallel_size=2, executor="uni").validate()
    with pytest.raises(ModelLoadError, match="tensor_parallel_size 3 must divide the 8 attention heads"):
        LLM(str(STORIES), tensor_parallel_size=3)  # refused before any worker starts


def test_shard_arithmetic():
    arch = parse_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 259, "hidden_size": 64,
                         "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 2,
                         "intermediate_size": 171})
    shards = [TPShard(arch, r, 4) for r in range(4)]
    assert [s.query_heads for s in shards] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1), (1, 1), (1, 1)]  # each KV head on two ranks
    assert [s.mlp_rows for s in shards] == [(0, 42), (42, 85), (85, 128), (128, 171)]  # uneven is exact
    assert [s.vocab_rows for s in shards] == [(0, 65), (65, 130), (130, 195), (195, 259)]
    assert shards[3].local_arch.vocab_size == 65  # padded; the padding's logits are cut off
    full = torch.arange(259 * 2, dtype=torch.float32).view(259, 2)
    part = shards[3].read("model.embed_tokens.weight", full, (65, 2))
    assert torch.equal(part[:64], full[195:]) and not part[64:].any()
    bias = torch.ones(64)
    assert shards[0].read("model.layers.0.mlp.down_proj.bias", bias, (64,)).sum() == 64
    assert shards[1].read("model.layers.0.mlp.down_proj.bias", bias, (64,)).sum() == 0  # added once
    with pytest.raises(ModelLoadError, match="attention heads"):
        TPShard(arch, 0, 3)
    with pytest.raises(ModelLoadError, match="KV heads"):
        TPShard(dataclasses.replace(arch, num_kv_heads=3, num_heads=6), 0, 2)


@pytest.mark.parametrize("preemption", PREEMPTION_MODES)
def test_stories_every_memory_mode_matches_one_rank(stories_tp2, preemption):
    want, one = _one_rank(str(STORIES), preemption=preemption)
    engine = stories_tp2.engine
    _reschedule(engine, preemption)
    assert _run_waves(engine) == want
    stats, one_stats = engine.scheduler.stats, one.stats
    _assert_mode_acted(stats, preemption)
    if preemption != "proactive-swap":  # no background copies: the same schedule, step for step
        assert (stats.preemptions, stats.recomputed_tokens, stats.swap_out_bytes, stats.swap_ops) == (
            one_stats.preemptions, one_stats.recomputed_tokens, one_stats.swap_out_bytes, one_stats.swap_ops)
    _assert_all_free(engine.scheduler)


def test_seeded_sampling_and_penalties_match_one_rank(stories_tp2):
    # Every field of SamplingParams crosses to the workers (logit_bias: a dict with int keys).
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7),
              SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3, frequency_penalty=0.5,
                             logit_bias={13: 5.0}, ignore_eos=True)]
    prompts = [LONG[0][:20], SHORT[1]]
    with LLM(str(STORIES), dtype="float32") as one:
        want = [o.token_ids for o in one.generate(prompts, params)]
    _reschedule(stories_tp2.engine, "recompute")
    assert [o.token_ids for o in stories_tp2.generate(prompts, params)] == want


def test_structured_outputs_match_one_rank(stories_tp2):
    """Each rank compiles the request's grammar itself and masks as one process does."""
    params = SamplingParams(max_tokens=12, temperature=0,
                            structured=StructuredOutput("regex", "[a-z]+( [a-z]+)*"))
    prompts = [LONG[0][:20], SHORT[1]]
    with LLM(str(STORIES), dtype="float32") as one:
        want = [o.token_ids for o in one.generate(prompts, params)]
    _reschedule(stories_tp2.engine, "recompute")
    assert [o.token_ids for o in stories_tp2.generate(prompts, params)] == want


def test_immediate_executors_queue_results_in_order():
    sim = SimulatedExecutor(load_cost_model("opt-13b@a100-40gb"))
    plans = [StepPlan(decode=[SeqSlice(f"r{i}", [0], 10 * i, [0], True, GREEDY, 0)]) for i in (1, 2)]
    for plan in plans:
        sim.submit(plan)
    assert [list(sim.poll().sampled) for _ in plans] == [["r1"], ["r2"]]
    with pytest.raises(RuntimeError, match="no plan submitted"):
        sim.poll()
    assert list(sim.execute(plans[0]).sampled) == ["r1"]


def test_plans_in_flight_come_back_in_order(stories_tp2):
    check_plans_in_flight_come_back_in_order(stories_tp2.engine.executor)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen2-1kv", "opt"])
def test_architectures_match_one_rank_with_swaps(kind, tiny_checkpoints, tmp_path):
    # llama: GQA 4 query / 2 KV heads, untied head; qwen2: qkv bias, tied; qwen2-1kv: more ranks
    # than KV heads (replicated), with int8 host KV (lossy: compared with one rank's int8); opt.
    path = str(tiny_checkpoints[kind] if kind in tiny_checkpoints else build_tiny_checkpoint(kind, tmp_path / kind))
    settings = dict(preemption="reactive-swap", offload_dtype="int8" if kind == "qwen2-1kv" else "auto")
    want, one = _one_rank(path, **settings)
    with LLM(path, tensor_parallel_size=2, **PRESSURE, **settings) as llm:
        assert _run_waves(llm.engine) == want
        stats = llm.engine.scheduler.stats
        # Swap bytes are the whole model's, summed over ranks: the one KV head, replicated on
        # both ranks, really moves twice.
        assert stats.swap_out_bytes == one.stats.swap_out_bytes * (2 if kind == "qwen2-1kv" else 1) > 0
        _assert_all_free(llm.engine.scheduler)


def kill_rank_raises_and_close_reaps(llm: LLM, rank: int) -> None:
    """Kill worker `rank` mid-generation: the engine raises WorkerError naming it (not a hang:
    the module's timeout bounds it), again on the next step, and close reaps every worker."""
    engine, ex = llm.engine, llm.engine.executor
    procs = list(ex._workers.procs)
    engine.add_request(LONG[0], GREEDY)
    engine.step()
    os.kill(procs[rank].pid, signal.SIGKILL)
    with pytest.raises(WorkerError, match=f"rank {rank}"):
        while engine.has_unfinished():
            engine.step()
    with pytest.raises(WorkerError):
        engine.step()
    llm.close()
    assert all(not p.is_alive() for p in procs)


def test_killed_worker_raises_and_close_reaps(stories_tp2):
    # Last in this module: it breaks the shared engine.
    kill_rank_raises_and_close_reaps(stories_tp2, 1)


def test_workers_leave_when_the_engine_process_dies():
    # An engine process killed without closing anything: its idle workers notice and exit.
    code = ("import os, sys\n"
            "from tokenslice import LLM\n"
            "if __name__ == '__main__':\n"
            "    llm = LLM('builtin:tiny', tensor_parallel_size=2)\n"
            "    workers = llm.engine.executor._workers\n"
            "    print(workers.tmpdir, *[p.pid for p in workers.procs], flush=True)\n"
            "    os._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    tmpdir, *pids = out.stdout.split()
    shutil.rmtree(tmpdir)  # its sockets' directory, which nobody closed
    pids = [int(p) for p in pids]
    assert len(pids) == 2
    deadline = time.monotonic() + 30  # a failure deadline: they check every second
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def test_sigterm_to_the_process_group_stops_the_tp_server_cleanly() -> None:
    """A SIGTERM to the whole group (timeout, systemd) must not kill the rank workers under the
    engine (an engine fault): the server stops cleanly and reaps the core and both workers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free_port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "tokenslice.cli", "serve", "--model", "builtin:tiny", "-tp", "2",
           "--port", str(free_port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{free_port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        # The core is the child that started the rank workers (another child: multiprocessing's
        # resource tracker).
        tree = {c: _children(c) for c in _children(proc.pid)}
        core, workers = max(tree.items(), key=lambda kv: len(kv[1]))
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode in (0, -signal.SIGTERM), out[-2000:]
    assert "engine failed" not in out and "engine died" not in out and "WorkerError" not in out, out[-2000:]
    assert len(workers) >= 2
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in [core, *workers]):
        time.sleep(0.1)
    assert not any(_alive(p) for p in [core, *workers])


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _alive(pid: int) -> bool:
    """Running (not a zombie that no init has reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_server_with_two_ranks_answers_like_one():
    import openai

    from serverkit import start_server

    prompt = [1, 72, 101, 108, 108, 111]
    with LLM("builtin:tiny") as one:  # 259-token vocabulary: an uneven split of the head
        want = one.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].text
    with start_server("-tp", "2", "--api-key", "k") as srv:
        # The engine core runs in its own process and starts the two rank workers.
        core = srv.core_pid
        workers = [int(c) for c in Path(f"/proc/{core}/task/{core}/children").read_text().split()]
        assert len(workers) >= 2
        client = openai.OpenAI(base_url=srv.url("/v1"), api_key="k")
        r = client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want and r.usage.completion_tokens == 12
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in [core, *workers]):
        time.sleep(0.1)
    assert not any(_alive(p) for p in [core, *workers])  # the server's shutdown closed the engine


def test_async_scheduling_over_ranks_matches_one_rank():
    # Each rank fills the pending tokens of a plan made ahead from its own last samples.
    want, _ = _one_rank(str(STORIES), preemption="recompute")
    with LLM(str(STORIES), tensor_parallel_size=2, preemption="recompute", async_scheduling=True, **PRESSURE) as llm:
        assert llm.engine.async_scheduling and llm.engine.max_in_flight == 2
        assert _run_waves(llm.engine) == want
        _assert_all_free(llm.engine.scheduler)
        assert not llm.engine.scheduler._unsettled
