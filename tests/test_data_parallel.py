"""Data parallelism (engine/dp_client.py, engine/router.py): `serve --data-parallel-size 2` runs
two engine processes behind one API server; greedy outputs equal one engine's, requests spread
over both, and a replica killed with SIGKILL leaves the server serving on the other."""
from __future__ import annotations

import os
import signal
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import httpx
import pytest

from serverkit import HTTP_TIMEOUT_S, start_server, until
from tokenslice import LLM, SamplingParams
from tokenslice.config import EngineConfig
from tokenslice.engine.engine import Engine
from tokenslice.engine.router import Router
from tokenslice.request import EngineRequest

PROMPTS = ["Once upon a time", "The dog", "Lily liked", "A big red", "Tom and", "The sun"]


def _texts(srv) -> list[str]:
    out = []
    for p in PROMPTS:
        r = httpx.post(srv.url("/v1/completions"), timeout=HTTP_TIMEOUT_S,
                       json={"prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def _replicas(srv) -> list[dict]:
    return httpx.get(srv.url("/v1/state"), timeout=HTTP_TIMEOUT_S).json()["data_parallel"]["replicas"]


def test_two_replicas_answer_as_one_and_share_the_requests() -> None:
    with start_server("--kv-cache-blocks", "32") as one:
        expected = _texts(one)
    with start_server("--kv-cache-blocks", "32", "--data-parallel-size", "2", "--router", "round-robin") as srv:
        assert _texts(srv) == expected
        until(lambda: sum(r["routed"] for r in _replicas(srv)) == len(PROMPTS))
        replicas = _replicas(srv)
        assert [r["routed"] for r in replicas] == [3, 3] and all(r["alive"] for r in replicas)
        assert len({r["pid"] for r in replicas}) == 2
        metrics = httpx.get(srv.url("/metrics"), timeout=HTTP_TIMEOUT_S).text
        assert "tokenslice:num_requests_running" in metrics
        for i in (0, 1):
            assert f'tokenslice:dp_replica_alive{{model_name="builtin:tiny",replica="{i}"}} 1.0' in metrics


def test_a_killed_replica_leaves_the_server_serving_on_the_other() -> None:
    with start_server("--kv-cache-blocks", "32", "--data-parallel-size", "2", "--router", "least-work") as srv:
        victim = _replicas(srv)[1]["pid"]
        os.kill(victim, signal.SIGKILL)
        until(lambda: not _replicas(srv)[1]["alive"])
        assert len(_texts(srv)) == len(PROMPTS)  # every request goes to the live replica
        # /v1/state is the latest periodic snapshot: the next one counts them.
        until(lambda: _replicas(srv)[0]["routed"] >= len(PROMPTS))
        assert _replicas(srv)[0]["alive"]
        assert httpx.get(srv.url("/health"), timeout=HTTP_TIMEOUT_S).status_code == 200


def test_a_dead_replicas_unstarted_requests_run_on_another() -> None:
    """Replica 1 is stopped (SIGSTOP), so the two requests round-robin gives it never start;
    killed, it hands them to replica 0 on the streams their clients read: all four answer, as
    one engine would."""
    with start_server("--kv-cache-blocks", "32") as one:
        expected = _texts(one)[:4]
    with start_server("--kv-cache-blocks", "32", "--data-parallel-size", "2", "--router", "round-robin") as srv:
        victim = _replicas(srv)[1]["pid"]
        os.kill(victim, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(_text, srv, p) for p in PROMPTS[:4]]
                done, _ = wait(futures, timeout=HTTP_TIMEOUT_S, return_when=FIRST_COMPLETED)
                assert done  # replica 0's answers come while replica 1 is stopped
                os.kill(victim, signal.SIGKILL)
                answers = [f.result(timeout=HTTP_TIMEOUT_S) for f in futures]
        finally:
            os.kill(victim, signal.SIGCONT) if _alive(victim) else None
        assert answers == expected
        until(lambda: httpx.get(srv.url("/v1/state"), timeout=HTTP_TIMEOUT_S).json()["data_parallel"]["rerouted"] == 2)


def _text(srv, prompt: str) -> str:
    r = httpx.post(srv.url("/v1/completions"), timeout=HTTP_TIMEOUT_S,
                   json={"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_the_offline_api_runs_replicas_too() -> None:
    prompts = ["Once upon a time", "The dog", "Lily liked", "A big red"]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    with LLM("builtin:tiny", kv_cache_blocks=32) as one:
        expected = [(o.text, o.token_ids) for o in one.generate(prompts, sp)]
    with LLM("builtin:tiny", kv_cache_blocks=32, data_parallel_size=2, router="round-robin") as llm:
        outs = llm.generate(prompts, sp)
        assert [(o.text, o.token_ids) for o in outs] == expected
        assert all(o.finish_reason == "length" for o in outs)
        assert llm.replicas is not None and llm.replicas.client.router.routed == [2, 2]
    with pytest.raises(ValueError, match="an Engine is one replica"):
        Engine.from_config(EngineConfig.from_options(model="builtin:tiny", data_parallel_size=2))


def _req(rid: str, ids: list[int], max_tokens: int = 10) -> EngineRequest:
    return EngineRequest(rid, ids, SamplingParams(max_tokens=max_tokens))


def test_least_work_counts_outstanding_tokens() -> None:
    r = Router("least-work", 2)
    big = _req("a", list(range(100)), 100)
    r.place(big, r.choose(big))
    small = _req("b", [1, 2], 5)
    assert r.choose(small) == 1  # replica 0 holds 200 tokens of work
    r.place(small, 1)
    r.produced("a", 1)  # the prompt is done: 99 tokens of output left
    assert r.work == [99, 7]
    r.finished("a")
    assert r.work == [0, 7] and r.choose(_req("c", [1])) == 0


def test_least_work_puts_a_free_batch_slot_before_fewer_tokens() -> None:
    def loaded(slots: int | None) -> Router:
        r = Router("least-work", 2, slots=slots)
        for rid in ("s1", "s2"):  # replica 0: a full batch of two short requests
            r.place(_req(rid, [1], 2), 0)
        r.place(_req("long", list(range(50)), 500), 1)  # replica 1: one long request, a slot free
        return r
    r = loaded(2)
    assert r.work[0] < r.work[1] and r.choose(_req("new", [1])) == 1
    assert loaded(None).choose(_req("new", [1])) == 0  # no batch size known: tokens alone


def test_prefix_aware_sends_a_conversation_home_unless_it_is_far_busier() -> None:
    r = Router("prefix-aware", 2)
    turn1 = _req("t1", list(range(40)))
    r.place(turn1, 1)
    turn2 = _req("t2", list(range(40)) + [7] * 30)  # 70 tokens, 64 of them shared with turn 1's prefix
    assert r.choose(turn2) == 1  # home, although replica 0 is idle
    other = _req("x", list(range(500, 570)))
    assert r.choose(other) == 0  # no remembered prefix: least work
    r.place(_req("load", list(range(5000)), 5000), 1)
    assert r.choose(turn2) == 0  # home is far busier
    assert r.remove(1) == ["t1", "load"] and r.live_replicas == [0]
    with pytest.raises(RuntimeError):
        r.remove(0) or r.choose(turn2)


def test_the_simulator_runs_the_router_over_replicas() -> None:
    from tokenslice.bench.workloads import make_workload
    from tokenslice.config import SchedulerConfig
    from tokenslice.predict.cost import load_cost_model
    from tokenslice.sim.engine import simulated_engine
    from tokenslice.sim.replicas import ReplicaSet

    cost = load_cost_model("opt-13b@a100-40gb")
    work = make_workload("synthetic-zipf", num_requests=40, rate=20.0, cv=4.0, seed=0, max_len=256)
    done = {}
    for router in ("round-robin", "least-work"):
        engines = [simulated_engine(SchedulerConfig(max_batch_size=4), cost, kv_cache_blocks=512) for _ in range(2)]
        reqs, placed = ReplicaSet(engines, Router(router, 2)).replay(work)
        assert all(r.is_finished and r.num_output_tokens == w.output_len for r, w in zip(reqs, work, strict=True))
        assert all(e.scheduler.kv.device.num_free == 512 for e in engines)
        done[router] = placed
    assert done["round-robin"] == [i % 2 for i in range(40)]  # trace order is arrival order here
    assert sorted(set(done["least-work"])) == [0, 1]
