"""The CPU split between the API server and the engine core (engine/cpus.py): the plan, and a real
`tokenslice serve` whose two processes end up bound to disjoint CPUs."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import STORIES
from tokenslice.config import CpuConfig, ModelConfig
from tokenslice.model.loader import load_arch
from tokenslice.engine.cpus import available_cpus, plan_cpus

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 120.0  # failure deadline, not a performance check


def test_two_cpus_one_each(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    plan = plan_cpus(CpuConfig(), [0, 1])
    assert (plan.api_cpus, plan.engine_cpus, plan.engine_threads) == ((0,), (1,), 1)
    assert plan.disjoint and not plan.pin  # pinned only when asked, on 2 CPUs
    assert plan_cpus(CpuConfig(pin_cpus=True), [0, 1]).pin == hasattr(os, "sched_setaffinity")


def test_a_large_model_gets_a_thread_on_every_cpu_where_nothing_is_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    smollm2, stories = 134_479_872, 259_328  # ArchConfig.matmul_params of the two real models
    assert load_arch(ModelConfig(model=str(STORIES))).matmul_params == stories
    plan = plan_cpus(CpuConfig(), [0, 1])
    assert (plan.threads_for(smollm2), plan.threads_for(stories)) == (2, 1)
    for kept in (CpuConfig(pin_cpus=True), CpuConfig(engine_threads=1)):  # pinned, or chosen: as asked
        assert plan_cpus(kept, [0, 1]).threads_for(smollm2) == 1 or not hasattr(os, "sched_setaffinity")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert plan_cpus(CpuConfig(), [0, 1]).threads_for(smollm2) == 1


def test_many_cpus_engine_gets_all_but_the_api_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    plan = plan_cpus(CpuConfig(api_server_cpus=2), list(range(8)))
    assert (plan.api_cpus, plan.engine_cpus, plan.engine_threads) == ((0, 1), tuple(range(2, 8)), 6)
    assert plan.pin == hasattr(os, "sched_setaffinity")
    assert plan_cpus(CpuConfig(engine_threads=3), list(range(8))).engine_threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert plan_cpus(CpuConfig(), list(range(8))).engine_threads == 2


def test_no_split_shares_every_cpu_unpinned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for plan in (plan_cpus(CpuConfig(), [3]), plan_cpus(CpuConfig(api_server_cpus=0), [0, 1, 2])):
        assert plan.api_cpus == plan.engine_cpus and not plan.pin and not plan.disjoint
    assert plan_cpus(CpuConfig(api_server_cpus=0), [0, 1, 2]).engine_threads == 3
    assert not plan_cpus(CpuConfig(pin_cpus=False), [0, 1]).pin
    with pytest.raises(ValueError, match="api_server_cpus"):
        plan_cpus(CpuConfig(api_server_cpus=-1), [0, 1])


def _allowed(pid: int) -> set[int]:
    """The CPUs any thread of the process may run on."""
    return set().union(*(os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{pid}/task")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(available_cpus()) < 2,
                    reason="needs Linux CPU affinity and 2 CPUs")
def test_serve_binds_api_server_and_core_to_disjoint_cpus() -> None:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokenslice.cli", "--log-level", "WARNING", "serve", "--model",
                             "builtin:tiny", "--port", str(port), "--kv-cache-blocks", "32", "--pin-cpus",
                             "--no-compile"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        children = [int(c) for c in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        core = next(c for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text())
        plan = plan_cpus(CpuConfig(pin_cpus=True))
        api, engine = _allowed(proc.pid), _allowed(core)
        assert api == set(plan.api_cpus) and engine == set(plan.engine_cpus) and not api & engine
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"model": "builtin:tiny", "prompt": "hi", "max_tokens": 4, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
