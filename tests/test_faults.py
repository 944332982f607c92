"""Faults (real `tokenslice serve` processes, SIGKILL): whichever process dies, the engine core,
one rank worker of -tp 2 (with a request in flight, and idle), one Ray actor, the server exits
non-zero and leaves no process behind; killing the server alone takes its core and workers
(or its private Ray cluster) with it. The private Ray cluster listens on loopback only, runs no dashboard and keeps its
files in a folder only its user can enter. Inputs that the engine's wire cannot carry (a lone
surrogate, a token id beyond 64 bits) are 400s naming the field.

The deadlines here are failure deadlines (a hang fails, it never blocks); the bounds the issue
sets (exit within 5 s, no process left 2 s later) are measured, 10 runs per kind, by
benchmarks/faults/kill_loop.py."""
from __future__ import annotations

import os
import re
import stat

import httpx
import pytest

from faultkit import FLAGS, Serve, cmdline, is_loopback, kill_and_watch, kills_server, listeners, start_serve
from serverkit import start_server

pytestmark = pytest.mark.timeout(300)
DEADLINE_S = 60.0  # failure deadline for an exit, not a performance check


def _check(srv: Serve, kind: str, in_flight: bool, index: int = 0) -> None:
    try:
        out = kill_and_watch(srv, kind, index, in_flight=in_flight, cap_s=DEADLINE_S, orphan_after_s=DEADLINE_S / 2)
    finally:
        left = srv.reap()
    assert out.exit_s is not None, f"serve did not exit after its {kind} was killed:\n{srv.output[-3000:]}"
    if kills_server(kind):
        assert out.exit_code == -9
    else:
        assert out.exit_code == 1, srv.output[-3000:]
        assert "the engine died" in srv.output
    assert out.gone_s is not None and not out.orphans and not left, (out, left)


@pytest.mark.parametrize(("kind", "in_flight"), [("core", False), ("worker", True), ("worker", False),
                                                 ("server", True), ("ray_server", False)])
def test_a_killed_process_ends_serve_and_leaves_nothing(kind: str, in_flight: bool) -> None:
    # The worker killed while idle: the core notices between requests, not only at its next step.
    # The server killed over a private Ray cluster: its core takes Ray's processes down with it.
    _check(start_serve(*FLAGS[kind]), kind, in_flight, index=1)


def test_private_ray_cluster_is_loopback_only_and_a_killed_actor_ends_serve() -> None:
    srv = start_serve(*FLAGS["ray_actor"])
    try:
        tree = srv.tree()
        names = {p: cmdline(p) for p in tree}
        assert any(c.startswith("ray::RankActor") for c in names.values()), names
        found = listeners([srv.proc.pid, *tree])
        assert any(name == "gcs_server" for _, _, name in found), found  # Ray's processes were seen
        assert [f for f in found if not is_loopback(f[0])] == []
        # No dashboard unless asked: Ray's head process runs without its web frontend, nothing on its port.
        assert all("--disable-frontend" in c for c in names.values() if "dashboard/dashboard.py" in c)
        assert not any(addr.endswith(":8265") for addr, _, _ in found)
        dirs = {m.group(1) for c in names.values() for m in [re.search(r"(/\S*/tsray-[^/\s]+)/", c)] if m}
        assert len(dirs) == 1, names
        mode = os.stat(dirs.pop()).st_mode
        assert stat.S_IMODE(mode) & 0o077 == 0  # Ray's 0777 folders inside are out of other users' reach
    except BaseException:
        srv.reap()
        raise
    _check(srv, "ray_actor", in_flight=True)


def test_inputs_the_wire_cannot_carry_are_400_naming_the_field() -> None:
    """A lone surrogate in `user` and a token id beyond 64 bits used to reach the engine core's
    encoder (msgpack) and answer 500."""
    chat = '"messages": [{"role": "user", "content": "hi"}]'
    cases = [("/v1/completions", "user", '{"prompt": "hi", "max_tokens": 2, "user": "\\ud800"}'),
             ("/v1/chat/completions", "user", '{%s, "max_tokens": 2, "user": "\\ud800"}' % chat),
             ("/v1/completions", "prompt", '{"prompt": [1, %d], "max_tokens": 2}' % (2**64 + 1)),
             ("/v1/completions", "prompt", '{"prompt": [[1, %d]], "max_tokens": 2}' % -(2**63 + 1)),
             ("/v1/chat/completions", "stop_token_ids", '{%s, "max_tokens": 2, "stop_token_ids": [%d]}' % (chat, 2**64)),
             ("/v1/completions", "stop", '{"prompt": "hi", "max_tokens": 2, "stop": ["\\udfff"]}')]
    with start_server("--kv-cache-blocks", "32") as srv:
        for route, param, body in cases:
            r = httpx.post(srv.url(route), content=body.encode(), headers={"content-type": "application/json"},
                           timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (route, body, r.text)
        ok = httpx.post(srv.url("/v1/completions"), json={"prompt": "hi", "max_tokens": 2, "user": "\u00e9\U0001f600"},
                        timeout=60)
        assert ok.status_code == 200  # real non-ASCII text still passes
        assert httpx.get(srv.url("/health")).status_code == 200


def test_ray_dashboard_flag() -> None:
    from tokenslice.cli import build_parser
    from tokenslice.cli.args import engine_config_from_args
    from tokenslice.config import EngineConfig

    args = build_parser().parse_args(["serve", "--model", "m", "--executor", "ray", "--ray-dashboard"])
    assert engine_config_from_args(args).parallel.ray_dashboard
    assert not EngineConfig.from_options(executor="ray").parallel.ray_dashboard  # off unless asked
    with pytest.raises(ValueError, match="private cluster"):  # a joined cluster runs its own
        EngineConfig.from_options(executor="ray", ray_address="auto", ray_dashboard=True).validate()
