"""MultiprocExecutor: the model split over worker processes (docs/DESIGN.md, Data flow; FastServe
§4.3), one per rank: tensor-parallel ranks inside each pipeline stage, joined by
torch.distributed (gloo on CPU, NCCL on CUDA).

The scheduler runs once, in the engine's process; every plan goes to every rank (ZMQ, msgspec:
exec/worker.py), each runs it on its shard and its KV partition, and the ranks' StepResults
merge into one (exec/merge.py).

Workers are spawned (CUDA forbids fork) and non-daemonic, so the engine itself may run in a
child process; `close` reaps them (stop, then kill), and so does interpreter
exit; a worker whose engine died without closing it exits by itself (exec/parent_watch.py).
Waiting on a worker never hangs: every wait polls with a timeout and checks that all workers
are alive, so a dead one raises WorkerError within `poll_interval_s`.
"""
from __future__ import annotations

import multiprocessing.util
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch
import torch.multiprocessing
import zmq

from tokenslice.config import CacheConfig, ModelConfig
from tokenslice.exec.base import WorkerError
from tokenslice.exec.merge import RankMerger
from tokenslice.exec.worker import (ERROR, INIT, READY, RESULT, STEP, STOP, Capacity, RankSpec, Sizes, WorkerSpec,
                                    worker_main)
from tokenslice.plan import StepPlan, StepResult


@dataclass
class _Workers:
    """The processes and sockets, apart from the executor so that an exit hook can reap them."""

    procs: list = field(default_factory=list)  # torch.multiprocessing spawn-context Processes, by rank
    ctx: zmq.Context = field(default_factory=zmq.Context)
    plans: list[zmq.Socket] = field(default_factory=list)  # PUSH to each rank
    results: zmq.Socket | None = None  # PULL from all ranks
    tmpdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="tokenslice-tp-"))
    stop_timeout_s: float = 10.0
    closed: bool = False

    def close(self) -> None:
        """Ask each worker to stop; kill those still running after `stop_timeout_s` (workers
        ignore SIGTERM, see exec/worker.py). Idempotent."""
        if self.closed:
            return
        self.closed = True
        for sock in self.plans:
            try:
                sock.send_multipart([STOP, b""], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # that worker is gone or stuck: killed below
        deadline = time.monotonic() + self.stop_timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()
        for sock in [*self.plans, self.results]:
            if sock is not None:
                sock.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


class MultiprocExecutor:
    """`tp_size` x `pp_size` worker processes; results come back from `poll` in submission order.

    With pipeline stages several plans may be in flight (`submit` does not wait): each stage
    works on a different one (FastServe §4.3). A plan's merged `step_seconds` is its time
    through the pipe: the sum over stages of the slowest rank's work, waits for neighbours left
    out; `stage_busy_s` / `stage_wait_s` sum each stage's work and waits over all plans (the
    pipeline's bubbles, for benchmarks and the simulator's cost model)."""

    def __init__(self, model: ModelConfig, cache: CacheConfig, tp_size: int, *, max_model_len: int,
                 max_batch_size: int, host_tier: bool, poll_interval_s: float = 0.2, pp_size: int = 1,
                 pp_layers: tuple[int, ...] | None = None) -> None:
        self.size = tp_size * pp_size
        self.tp_size, self.pp_size = tp_size, pp_size
        self.poll_interval_s = poll_interval_s
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode_result = msgspec.msgpack.Decoder(StepResult).decode
        self._inbox: list[deque[bytes]] = [deque() for _ in range(self.size)]
        self._in_flight = 0
        self._broken: str | None = None
        self._merger = RankMerger(tp_size, pp_size)
        # Per-stage work and waits over all plans, summed by the merger (exec/merge.py).
        self.stage_busy_s, self.stage_wait_s = self._merger.stage_busy_s, self._merger.stage_wait_s
        w = self._workers = _Workers()
        self._finalizer = multiprocessing.util.Finalize(self, w.close, exitpriority=10)
        self._results = w.results = w.ctx.socket(zmq.PULL)
        self._results.bind(f"ipc://{w.tmpdir}/results")
        threads = max(1, torch.get_num_threads() // self.size)  # CPU ranks share this process's cores
        mp = torch.multiprocessing.get_context("spawn")
        try:
            for rank in range(self.size):
                sock = w.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDTIMEO, int(poll_interval_s * 1000))
                sock.bind(f"ipc://{w.tmpdir}/plans-{rank}")
                w.plans.append(sock)
                spec = WorkerSpec(RankSpec(model, cache, rank, self.size, max_model_len, max_batch_size, host_tier,
                                           f"file://{w.tmpdir}/rendezvous", threads, gpu=rank, pp_size=pp_size,
                                           pp_layers=pp_layers),
                                  f"ipc://{w.tmpdir}/plans-{rank}", f"ipc://{w.tmpdir}/results")
                proc = mp.Process(target=worker_main, args=(spec,), name=f"tokenslice-tp{rank}", daemon=False)
                proc.start()
                w.procs.append(proc)
            caps = [msgspec.msgpack.decode(b, type=Capacity) for b in self._gather(READY)]
            # Every rank holds the same blocks (only heads and layers differ), as many as the smallest can.
            self.num_blocks = min(c.kv_blocks for c in caps)
            self.num_host_blocks = min(c.host_blocks for c in caps)
            # The whole model's block, summed over partitions: swap statistics compare with one rank.
            self.host_block_bytes = sum(c.host_block_bytes for c in caps)
            self._send(INIT, self._encode(Sizes(self.num_blocks, self.num_host_blocks)))
            self._gather(RESULT)
        except BaseException:
            self.close()
            raise

    # ---- Executor interface ---------------------------------------------------------------------
    def submit(self, plan: StepPlan) -> None:
        self._check_usable()
        self._send(STEP, self._encode(plan))
        self._in_flight += 1

    def poll(self) -> StepResult:
        """The oldest submitted plan's result, merged over ranks; WorkerError if a worker died."""
        self._check_usable()
        if not self._in_flight:
            raise RuntimeError("poll() with no plan submitted")
        results = [self._decode_result(b) for b in self._gather(RESULT)]
        self._in_flight -= 1
        return self._merger.merge(results)

    def execute(self, plan: StepPlan) -> StepResult:
        self.submit(plan)
        return self.poll()

    def check_alive(self) -> None:
        """WorkerError if a worker has died (the idle engine calls it between requests)."""
        self._check_usable()
        self._check_alive()

    def close(self) -> None:
        """Stop and reap every worker. Idempotent."""
        self._finalizer()

    # ---- internals ------------------------------------------------------------------------------
    def _send(self, kind: bytes, body: bytes) -> None:
        for sock in self._workers.plans:
            self._wait(lambda s=sock: _try_send(s, [kind, body]))

    def _gather(self, kind: bytes) -> list[bytes]:
        """The next message from every rank, which must be of `kind`."""
        def arrived() -> bool:
            while self._results.poll(0):
                rank_b, got, body = self._results.recv_multipart()
                rank = int(rank_b)
                if got == ERROR:  # a peer's death makes the survivors' collectives fail: name it first
                    self._fail("".join(f"{d}; " for d in self._dead()) +
                               f"tensor-parallel worker rank {rank} failed:\n{body.decode(errors='replace')}")
                if got != kind:
                    self._fail(f"tensor-parallel worker rank {rank} sent {got!r}, expected {kind!r}")
                self._inbox[rank].append(body)
            return all(self._inbox)
        self._wait(arrived)
        return [q.popleft() for q in self._inbox]

    def _wait(self, ready: Callable[[], bool]) -> None:
        """Until ready() holds; between tries, wait for a message at most poll_interval_s and
        check that every worker is alive."""
        while not ready():
            self._check_alive()
            self._results.poll(int(self.poll_interval_s * 1000))

    def _check_alive(self) -> None:
        dead = self._dead()
        if dead:
            self._fail("; ".join(dead))

    def _dead(self) -> list[str]:
        return [f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                for rank, p in enumerate(self._workers.procs) if not p.is_alive()]

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise WorkerError(self._broken)
        if self._workers.closed:
            raise WorkerError("the executor is closed")

    def _fail(self, message: str) -> None:
        self._broken = message
        self._workers.stop_timeout_s = 0.0  # the survivors may be stuck in a collective: kill them
        raise WorkerError(message)


def _try_send(sock: zmq.Socket, frames: list[bytes]) -> bool:
    try:
        sock.send_multipart(frames)
    except zmq.Again:  # the worker is not taking messages (SNDTIMEO): check it is alive, retry
        return False
    return True
