"""Processes that must not outlive the process that started them (the engine core under the API
server, rank workers under the engine, the private Ray cluster's processes under the engine).

`exit_with_parent`: a daemon thread waits on multiprocessing's parent sentinel, a pipe whose
write end only the parent holds, and as soon as it reads end-of-file kills this process's own
descendants and exits, whatever the main thread is doing (a step, a collective, a model load).
Not prctl(PR_SET_PDEATHSIG): Linux sends that signal when the *thread* that spawned the child
exits, not the process, so an engine built on a short-lived thread would lose its workers.

`kill_process_tree`: SIGKILL to a process and everything below it, for a process that does not
stop when asked (its descendants are found first: once it is dead they are no longer its own).
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
from collections.abc import Callable

PARENT_GONE_EXIT_CODE = 1


def exit_with_parent(name: str, cleanup: Callable[[], None] | None = None) -> threading.Thread | None:
    """Start the watch in this process (spawned by multiprocessing); None when it has no parent
    sentinel (not started by multiprocessing). The process exits without other cleanup than
    `cleanup` (files its parent would have removed): what it held is its parent's to free, and
    its parent is gone."""
    parent = multiprocessing.parent_process()
    sentinel = None if parent is None else parent.sentinel
    if parent is None or sentinel is None:
        return None

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])  # readable only at end-of-file: the parent exited
        sys.stderr.write(f"{name} (pid {os.getpid()}): its parent process {parent.pid} is gone; exiting\n")
        sys.stderr.flush()
        # Ray's processes leave only seconds after their raylet; rank workers would go by themselves.
        kill_process_tree(os.getpid(), include_root=False)
        if cleanup is not None:
            try:
                cleanup()
            except Exception as e:  # noqa: BLE001 - exiting regardless
                sys.stderr.write(f"{name}: cleanup after its parent failed: {e}\n")
        os._exit(PARENT_GONE_EXIT_CODE)

    thread = threading.Thread(target=watch, name="tokenslice-parent-watch", daemon=True)
    thread.start()
    return thread


def descendants(pid: int) -> list[int]:
    """The live processes below `pid`, children first (from /proc; none where there is no /proc)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # exited meanwhile
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(0), [])
        out += kids
        todo += kids
    return out


def kill_process_tree(pid: int, include_root: bool = True) -> None:
    """SIGKILL `pid` (unless not `include_root`) and every process below it."""
    for p in ([pid] if include_root else []) + descendants(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
