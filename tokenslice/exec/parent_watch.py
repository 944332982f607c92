"""A spawned process that must not outlive its parent (the engine core under the API server, a
rank worker under the engine): a daemon thread waits on multiprocessing's parent sentinel, a
pipe whose write end only the parent holds, and ends this process as soon as it reads
end-of-file, whatever the main thread is doing (a step, a collective, a model load).

Not prctl(PR_SET_PDEATHSIG): Linux sends that signal when the *thread* that spawned the child
exits, not the process, so an engine built on a short-lived thread would lose its workers.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import sys
import threading

PARENT_GONE_EXIT_CODE = 1


def exit_with_parent(name: str) -> threading.Thread | None:
    """Start the watch in this process (spawned by multiprocessing); None when it has no parent
    sentinel (not started by multiprocessing). The process exits without cleanup: its own
    children watch it the same way, and what it held is its parent's to free, which is gone."""
    parent = multiprocessing.parent_process()
    sentinel = None if parent is None else parent.sentinel
    if parent is None or sentinel is None:
        return None

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])  # readable only at end-of-file: the parent exited
        sys.stderr.write(f"{name} (pid {os.getpid()}): its parent process {parent.pid} is gone; exiting\n")
        sys.stderr.flush()
        os._exit(PARENT_GONE_EXIT_CODE)

    thread = threading.Thread(target=watch, name="tokenslice-parent-watch", daemon=True)
    thread.start()
    return thread
