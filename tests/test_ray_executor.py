"""The Ray executor (--executor ray): a `ray start --head` cluster on 127.0.0.1, started once for
the module and always stopped. -tp 2, -pp 2 and -tp 2 -pp 2 over Ray actors generate what one
process generates, in fp32, with swaps (two batches in flight with stages); `serve --executor ray
--ray-address -tp 2 -pp 2` answers over HTTP and survives a client that leaves mid-stream; a
killed actor fails the engine fast (WorkerError in process; over HTTP an error naming the dead
rank for the requests in flight and /health 503), never a hang; so does a lost node, a second
`ray start --address` node on this machine holding one pipeline stage."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from conftest import STORIES
from serverkit import start_server, until, wait_idle
from tokenslice import LLM, SamplingParams
from tokenslice.cli import build_parser
from tokenslice.cli.args import engine_config_from_args
from tokenslice.config import EngineConfig
from tokenslice.exec.base import WorkerError
from tokenslice.exec.ray_executor import RayExecutor
from waves import GREEDY, LONG, PRESSURE, check_plans_in_flight_come_back_in_order, count_in_flight, run_waves

pytestmark = pytest.mark.timeout(300)  # bounds every wait below: a hang fails, it never blocks CI

HEAD_START_S = 120.0  # failure deadline for a Ray node to come up
# Ray's health checks declare a lost node dead after period x threshold (3 s x 5 by default): faster here.
HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
HEAD = "node:__internal_head__"  # the resource Ray gives the head node only
SWAPS = dict(PRESSURE, preemption="reactive-swap")  # residents are swapped out and back in


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(c) for t in os.listdir(f"/proc/{p}/task")
                    for c in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
        except FileNotFoundError:
            continue
        out += kids
        todo += kids
    return out


def _rank_actor_pids(head_pid: int) -> set[int]:
    """The cluster's RankActor processes (Ray titles an actor's process ray::<class>)."""
    pids = set()
    for p in _descendants(head_pid):
        try:
            if Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"ray::RankActor"):
                pids.add(p)
        except FileNotFoundError:
            pass
    return pids


def _gone(pid: int) -> bool:
    """Exited (a zombie counts: its parent may be gone too)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@dataclass
class Head:
    address: str
    pid: int  # `ray start --head --block`: the cluster's processes descend from it
    tmp: str  # the cluster's temp dir, shared by the nodes started on this machine


@contextlib.contextmanager
def _ray_node(tmp: str, name: str, *args: str) -> Iterator[subprocess.Popen]:
    """`ray start --block *args` in its own process group, logging to tmp/name.log; yields it
    once Ray says it runs. Always stopped: SIGTERM (--block stops its node), then SIGKILL to
    whatever of its group is left."""
    log = open(Path(tmp) / f"{name}.log", "w+")
    cmd = [str(Path(sys.executable).parent / "ray"), "start", "--block", "--num-gpus=0", f"--temp-dir={tmp}",
           "--disable-usage-stats", *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **HEALTH_CHECKS, "RAY_AUTH_MODE": "disabled"})
    try:
        deadline = time.monotonic() + HEAD_START_S
        while "Ray runtime started" not in Path(log.name).read_text():
            assert proc.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()[-3000:]
            time.sleep(0.2)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)
        log.close()


@pytest.fixture(scope="module")
def ray_head() -> Iterator[Head]:
    """`ray start --head` on 127.0.0.1 with 4 CPUs (a CPU per rank actor, whatever the machine
    has) in a private temp dir. Without token authentication (Ray's default for `ray start`): a
    driver that names an address does not send the token unless RAY_AUTH_MODE=token, read when
    ray is imported, which neither this process nor the engine core sets."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tmp = tempfile.mkdtemp(prefix="tsray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    try:
        with _ray_node(tmp, "head", "--head", f"--port={port}", "--num-cpus=4", "--include-dashboard=false") as proc:
            yield Head(f"127.0.0.1:{port}", proc.pid, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def one_rank() -> list[list[int]]:
    with LLM(str(STORIES), **SWAPS) as one:
        return run_waves(one.engine)


@pytest.fixture(scope="module")
def ray_tp2(ray_head):
    with LLM(str(STORIES), tensor_parallel_size=2, executor="ray", ray_address=ray_head.address, **SWAPS) as llm:
        yield llm


def test_cli_and_config():
    args = build_parser().parse_args(["serve", "--model", "m", "--executor", "ray", "--ray-address", "auto", "-tp", "2"])
    cfg = engine_config_from_args(args)
    assert (cfg.parallel.executor, cfg.parallel.ray_address, cfg.parallel.tensor_parallel_size) == ("ray", "auto", 2)
    assert not cfg.parallel.multiproc
    with pytest.raises(ValueError, match="needs executor ray"):
        EngineConfig.from_options(ray_address="auto").validate()


def test_two_actors_match_one_process_with_swaps(ray_tp2, one_rank):
    assert isinstance(ray_tp2.engine.executor, RayExecutor)
    assert run_waves(ray_tp2.engine) == one_rank
    stats = ray_tp2.engine.scheduler.stats
    assert stats.preemptions > 0 and stats.swap_out_bytes > 0 and stats.swap_in_bytes == stats.swap_out_bytes
    kv = ray_tp2.engine.scheduler.kv
    kv.check()
    assert kv.device.num_free == kv.device.num_blocks and kv.num_in_flight == 0


def test_plans_in_flight_come_back_in_order(ray_tp2):
    check_plans_in_flight_come_back_in_order(ray_tp2.engine.executor)


def test_killed_actor_raises_and_close_cleans_up(ray_tp2, ray_head):
    # Last user of ray_tp2: it breaks the shared engine.
    engine, ex = ray_tp2.engine, ray_tp2.engine.executor
    pids = ex.worker_pids()
    engine.add_request(LONG[0], GREEDY)
    engine.step()
    ray.kill(ex.actors[1])
    with pytest.raises(WorkerError, match="rank 1"):  # not a hang: the module's timeout bounds it
        while engine.has_unfinished():
            engine.step()
    with pytest.raises(WorkerError, match="rank 1"):
        engine.step()
    ray_tp2.close()
    assert not ray.is_initialized()  # the executor joined the cluster, and left it
    until(lambda: not (_rank_actor_pids(ray_head.pid) & set(pids)), timeout=60)


@pytest.mark.parametrize("tp", [1, 2])
def test_pipeline_stages_match_one_process_with_swaps(ray_head, one_rank, tp):
    # After the -tp 2 engine has closed: -tp 2 -pp 2 takes the head's 4 CPUs, one per actor.
    with LLM(str(STORIES), tensor_parallel_size=tp, pipeline_parallel_size=2, executor="ray",
             ray_address=ray_head.address, **SWAPS) as llm:
        engine, ex = llm.engine, llm.engine.executor
        assert isinstance(ex, RayExecutor) and ex.size == 2 * tp and engine.max_in_flight == 2
        in_flight = count_in_flight(engine)
        assert run_waves(engine) == one_rank
        assert max(in_flight) == 2  # two batches were in the pipe at once
        stats = engine.scheduler.stats
        assert stats.preemptions > 0 and stats.swap_out_bytes > 0 and stats.swap_in_bytes == stats.swap_out_bytes
        kv = engine.scheduler.kv
        kv.check()
        assert kv.device.num_free == kv.device.num_blocks and kv.num_in_flight == 0
        assert all(s > 0 for s in ex.stage_busy_s) and all(w >= 0 for w in ex.stage_wait_s)


def test_serve_over_ray_cluster(ray_head, caplog):
    """`serve --executor ray -tp 2 -pp 2` over the head's 4 CPUs, with the openai client."""
    before = _rank_actor_pids(ray_head.pid)
    with LLM(str(STORIES), dtype="float32") as one:
        want = one.generate([LONG[1]], GREEDY)[0].text
    with start_server("--model", str(STORIES), "--dtype", "float32", "--executor", "ray", "-tp", "2", "-pp", "2",
                      "--ray-address", ray_head.address, "--kv-cache-blocks", "64") as srv:
        actors = sorted(_rank_actor_pids(ray_head.pid) - before)
        assert len(actors) == 4  # the engine core's four rank actors (pid order, not rank order)
        client = openai.OpenAI(base_url=srv.url("/v1"), api_key="x", max_retries=0, timeout=120)
        r = client.completions.create(model=str(STORIES), prompt=LONG[1], max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want and r.usage.completion_tokens == 16
        # A client that leaves mid-stream: the request is aborted, its KV freed, the engine goes on.
        stream = client.completions.create(model=str(STORIES), prompt="Once upon a time", max_tokens=400,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        next(chunks)
        stream.close()
        assert wait_idle(srv)["tokenslice:kv_cache_usage_perc"] == 0
        r = client.completions.create(model=str(STORIES), prompt=LONG[1], max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want
        # An actor's process killed mid-stream: the stream ends with an error event that names the
        # dead rank and its stage (so does the server's log), and /health turns 503.
        stream = client.completions.create(model=str(STORIES), prompt="in flight", max_tokens=400,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        os.kill(actors[1], signal.SIGKILL)
        with pytest.raises(openai.APIError) as err:
            for _ in chunks:
                pass
        dead = r"worker rank [0-3] \(pipeline stage [01], tensor-parallel rank [01]; Ray actor on node \w+\) died"
        assert re.search(rf"the engine stopped: .*WorkerError: {dead}.*\(request id cmpl-", str(err.value))
        until(lambda: httpx.get(srv.url("/health"), timeout=60).status_code == 503, timeout=60)
        deaths = [r.getMessage() for r in caplog.records if "engine core failed" in r.getMessage()]
        assert deaths and re.search(f"WorkerError: {dead}", deaths[0])
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=str(STORIES), prompt="anyone?", max_tokens=4)
        assert refused.value.status_code == 503
    until(lambda: not (_rank_actor_pids(ray_head.pid) - before), timeout=60)  # the core's actors are gone


def test_lost_node_fails_requests_in_flight(ray_head):
    """A second node (`ray start --address`: its own raylet, on this machine) holds one pipeline
    stage of -tp 2 -pp 2, since this test holds 2 of the head's 4 CPUs. Its process group killed
    while a request is in flight: the engine raises WorkerError naming a rank of that stage and
    the node, Ray declares the node dead, and neither the node's processes nor the engine's actors
    are left."""
    before = _rank_actor_pids(ray_head.pid)
    ray.init(address=ray_head.address, logging_level="warning")  # the engine joins this connection
    try:
        with _ray_node(ray_head.tmp, "node2", f"--address={ray_head.address}", "--num-cpus=2") as node:
            until(lambda: sum(n["Alive"] for n in ray.nodes()) == 2, timeout=HEAD_START_S)
            node_id = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and HEAD not in n["Resources"])
            held = placement_group([{"CPU": 2.0, HEAD: 0.001}], strategy="STRICT_PACK")
            ray.get(held.ready(), timeout=HEAD_START_S)
            with LLM(str(STORIES), tensor_parallel_size=2, pipeline_parallel_size=2, executor="ray",
                     ray_address=ray_head.address) as llm:
                engine, ex = llm.engine, llm.engine.executor
                lost = [rank for rank, n in enumerate(ex.nodes) if n == node_id]
                assert lost in ([0, 1], [2, 3])  # a stage's ranks share a node
                stage = lost[0] // 2
                doomed = _descendants(node.pid)
                engine.add_request(LONG[0], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
                engine.step()
                os.killpg(node.pid, signal.SIGKILL)
                dead = rf"worker rank [{lost[0]}{lost[1]}] \(pipeline stage {stage}, .* on node {node_id}\) died"
                with pytest.raises(WorkerError, match=dead):  # not a hang: the module's timeout bounds it
                    while engine.has_unfinished():
                        engine.step()
            until(lambda: not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == node_id), timeout=60)
            until(lambda: all(_gone(p) for p in doomed), timeout=60)
            until(lambda: not (_rank_actor_pids(ray_head.pid) - before), timeout=60)  # the head's stage too
            remove_placement_group(held)
    finally:
        ray.shutdown()


def test_private_cluster_when_no_address_is_given(monkeypatch):
    """No --ray-address and no $RAY_ADDRESS: the engine starts a one-node cluster of its own and
    stops it on close; the process keeps its SIGTERM handler (ray.init installs one)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)  # ray.init sets it for its own cluster; restored after
    prompt = [1, 72, 101, 108, 108, 111]
    with LLM("builtin:tiny") as one:
        want = one.generate([prompt], GREEDY)[0].token_ids
    handler = signal.getsignal(signal.SIGTERM)
    assert not ray.is_initialized()
    with LLM("builtin:tiny", tensor_parallel_size=2, executor="ray") as llm:
        assert ray.is_initialized() and ray.cluster_resources()["CPU"] >= 2
        assert signal.getsignal(signal.SIGTERM) is handler
        assert llm.generate([prompt], GREEDY)[0].token_ids == want
    assert not ray.is_initialized()
