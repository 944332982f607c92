"""The engine core's socket folder is removed however `serve` ends: by the core when its API
server is killed with SIGKILL, and, for a folder whose server and core were both killed, by the
next server that starts (engine/socket_dir.py). Real processes, reaped; every wait is a failure
deadline, not a performance check."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from faultkit import alive, start_serve
from serverkit import until
from tokenslice.engine.socket_dir import PREFIX, make_socket_dir, owner_pid, remove_stale_socket_dirs

DEADLINE_S = 60.0


def socket_dirs(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith(PREFIX))


def test_killed_server_leaves_no_socket_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the child's temp folder, inherited
    srv = start_serve()
    try:
        core = [p for p in srv.tree() if p != srv.proc.pid]
        assert core and len(socket_dirs(tmp_path)) == 1
        assert owner_pid(socket_dirs(tmp_path)[0]) == srv.proc.pid
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(DEADLINE_S)
        until(lambda: not any(alive(p) for p in core), timeout=DEADLINE_S)
        assert socket_dirs(tmp_path) == []
    finally:
        srv.reap()


def test_stale_folders_of_dead_servers_are_removed(tmp_path: Path) -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()  # a pid that was a process of ours and is gone now
    dead = tmp_path / f"{PREFIX}{proc.pid}-abc_123"
    dead.mkdir()
    (dead / "input").write_text("")
    ours = Path(make_socket_dir(str(tmp_path)))  # this process's own: alive
    other = tmp_path / f"{PREFIX}notapid"
    other.mkdir()
    plain = tmp_path / f"{PREFIX}{proc.pid}-file"
    plain.write_text("")  # not a folder
    assert remove_stale_socket_dirs(str(tmp_path)) == [str(dead)]
    assert socket_dirs(tmp_path) == sorted([ours.name, other.name, plain.name])
