"""The live view's page: /dashboard and its static assets from `tokenslice serve` (open under
--api-key: the page holds no data and asks for the key), and `tokenslice view` serving a
`simulate --record-state` recording to the same page in replay mode."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from serverkit import start_server, until
from tokenslice.cli import main

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 60.0  # failure deadlines, not performance checks


def test_page_is_open_under_the_key_and_holds_no_data() -> None:
    with start_server("--api-key", "sekrit") as srv:
        page = httpx.get(srv.url("/dashboard"), timeout=DEADLINE_S)
        assert page.status_code == 200 and 'id="key-prompt"' in page.text and "sekrit" not in page.text
        assert httpx.get(srv.url("/dashboard/static/dashboard.js"), timeout=DEADLINE_S).status_code == 200
        assert httpx.get(srv.url("/v1/state"), timeout=DEADLINE_S).status_code == 401


def test_dashboard_and_its_assets_are_served() -> None:
    with start_server("--no-engine-process") as srv:
        page = httpx.get(srv.url("/dashboard"), timeout=DEADLINE_S)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert 'data-mode="live"' in page.text
        for element in ("count-running", "count-waiting", "count-preempted", "count-swapped", "lanes",
                        "device-map", "host-map", "swap-sparkline", "latency"):
            assert f'id="{element}"' in page.text
        for asset in ("dashboard.js", "dashboard.css"):
            assert f"/dashboard/static/{asset}" in page.text
            r = httpx.get(srv.url(f"/dashboard/static/{asset}"), timeout=DEADLINE_S)
            assert r.status_code == 200 and len(r.content) > 100
        script = httpx.get(srv.url("/dashboard/static/dashboard.js"), timeout=DEADLINE_S).text
        assert "https://" not in script and "//cdn" not in script  # nothing fetched from elsewhere


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def recording(tmp_path: Path) -> Path:
    path = tmp_path / "state.jsonl"
    assert main(["simulate", "--profile", "opt-13b@a100-40gb", "--workload", "synthetic-fixed",
                 "--policy", "skip-join-mlfq", "--rates", "8",
                 "--num-requests", "30", "--kv-cache-blocks", "60", "--record-state", str(path), "--quiet"]) == 0
    return path


def test_view_serves_a_recording(recording: Path) -> None:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokenslice.cli", "view", str(recording), "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        base = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(base + "/dashboard", timeout=5).status_code == 200
            except httpx.TransportError:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                return False

        until(up)
        page = httpx.get(base + "/dashboard", timeout=DEADLINE_S)
        assert 'data-mode="replay"' in page.text and 'id="replay-slider"' in page.text
        lines = httpx.get(base + "/v1/replay", timeout=DEADLINE_S).text.splitlines()
        assert lines == recording.read_text().splitlines() and len(lines) > 2
        assert json.loads(lines[0])["run"]["policy"] == "skip-join-mlfq"
        assert httpx.get(base + "/dashboard/static/dashboard.js", timeout=DEADLINE_S).status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_view_serves_a_recording_page_by_page(tmp_path: Path) -> None:
    """The index lists each run with its snapshots' times; a page by index or by simulated time is
    exactly those lines of the file, and the page never needs the whole file."""
    from fastapi.testclient import TestClient

    from tokenslice.server.replay import create_replay_app

    path = tmp_path / "two-runs.jsonl"
    assert main(["simulate", "--profile", "opt-13b@a100-40gb", "--workload", "synthetic-fixed",
                 "--policy", "fcfs,skip-join-mlfq", "--rates", "8", "--num-requests", "30",
                 "--kv-cache-blocks", "60", "--record-state", str(path), "--quiet"]) == 0
    lines = path.read_bytes().splitlines(keepends=True)
    by_run: dict[str, list[bytes]] = {}
    for line in lines:
        by_run.setdefault(json.loads(line)["run"]["policy"], []).append(line)
    client = TestClient(create_replay_app(path))
    runs = client.get("/v1/replay/index").json()["runs"]
    assert [r["labels"]["policy"] for r in runs] == ["fcfs", "skip-join-mlfq"] and [r["id"] for r in runs] == [0, 1]
    for run in runs:
        mine = by_run[run["labels"]["policy"]]
        snaps = [json.loads(line) for line in mine]
        assert run["snapshots"] == len(mine) > 4 and run["bytes"] == sum(map(len, mine))
        assert run["t"] == [s["t"] for s in snaps] and run["host_used"] == [s["kv"]["host"]["used"] for s in snaps]
        page = client.get("/v1/replay", params={"run": run["id"], "start": 2, "stop": 4})
        assert page.status_code == 200 and page.content == b"".join(mine[2:4])
        assert page.headers["x-snapshots"] == f"2-4/{len(mine)}"
        t0, t1 = run["t"][1], run["t"][3]
        assert client.get("/v1/replay", params={"run": run["id"], "from": t0, "to": t1}).content == b"".join(mine[1:4])
        assert client.get("/v1/replay", params={"run": run["id"], "start": len(mine) - 1, "stop": 10**6}).content == mine[-1]
        assert client.get("/v1/replay", params={"run": run["id"], "start": 10**6}).content == b""
    assert client.get("/v1/replay").content == path.read_bytes()  # the whole file, as before
    assert client.get("/v1/replay", params={"run": 2}).status_code == 404
    assert client.get("/v1/replay", params={"start": 1}).status_code == 400
    assert client.get("/v1/replay", params={"run": 0, "start": 1, "from": 0.0}).status_code == 400
    assert client.get("/v1/replay", params={"run": 0, "start": -1}).status_code == 422
