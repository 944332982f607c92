"""The private folder that holds the API server <-> engine-core ipc sockets, and its removal
however the processes end: by the API server on a clean stop, by the core when its API server
died (even by SIGKILL), and, for folders whose every owner was killed, by the next server that
starts (the folder's name carries the pid of the server that made it).

Not Linux's abstract socket namespace: those sockets have no file permissions, so any local
user could connect to the core's input and submit requests past the API keys.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

PREFIX = "tokenslice-core-"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-[A-Za-z0-9_]+")  # tokenslice-core-<pid>-<mkdtemp's suffix>


def make_socket_dir(parent: str | None = None) -> str:
    """A new private (0700) folder named after this process's pid, in `parent` (the temp folder)."""
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent)


def owner_pid(name: str) -> int | None:
    """The pid in a socket folder's name; None for any other name."""
    m = _NAME.fullmatch(name)
    return int(m.group(1)) if m else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_socket_dir_of(address: str) -> None:
    """Remove the socket folder of an `ipc://` address, if it is one of ours."""
    folder = Path(address.removeprefix("ipc://")).parent
    if owner_pid(folder.name) is not None:
        shutil.rmtree(folder, ignore_errors=True)


def remove_stale_socket_dirs(parent: str | None = None) -> list[str]:
    """Remove this user's socket folders in `parent` (the temp folder) whose server is gone;
    returns their paths. A folder whose pid is alive (its server, or a process that reused
    the pid) is left."""
    removed = []
    try:
        entries = list(os.scandir(parent or tempfile.gettempdir()))
    except OSError:
        return removed
    for entry in entries:
        pid = owner_pid(entry.name)
        try:
            mine = entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_uid == os.getuid()
        except OSError:
            continue
        if pid is not None and mine and not pid_alive(pid):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


__all__ = ["make_socket_dir", "remove_socket_dir_of", "remove_stale_socket_dirs", "owner_pid"]
