"""RayExecutor: the ranks (tensor-parallel inside each pipeline stage) as Ray actors, on one
node or several (FastServe §4.3: Ray actors as GPU workers, tensor parallelism inside a node,
pipeline stages across nodes).

Ray does placement, start-up, plan delivery and failure detection; the tensors go through
torch.distributed between the actors (gloo on CPU, NCCL on CUDA), rendezvous at rank 0's node
address on a port it picks (on the private cluster: a file in its private directory). Each actor runs exec/worker.py's RankWorker, the code a
multiproc worker process runs. Plans travel as actor calls carrying the msgspec bytes the
multiproc executor sends over ZMQ: Ray already connects every node and reports a dead actor
or node through the very call that waits for its answer, so no socket crosses nodes outside
it. A sync actor runs its calls in submission order, so several plans may be in flight.

Placement: one placement group per pipeline stage, STRICT_PACK, one bundle per rank ({GPU: 1}
on CUDA, {CPU: 1} otherwise), so a stage's ranks share a node (NVLink for the all-reduces)
and stages go wherever the cluster has room; activations cross between stages through
torch.distributed point-to-point (model/pp.py).

Failure: every wait polls with a timeout; a dead actor or node (RayActorError, NodeDiedError)
or a rank's exception raises WorkerError naming the rank, its stage and its node, the surviving
actors are killed (they may be stuck in a collective) and later calls raise it again. A lost
node's actors fail their calls once their processes are gone, or at the latest once Ray's health
checks declare the node dead. An idle engine calls `check_alive`, which keeps one ping per actor
in flight, so a death between requests ends the engine too.

The private cluster (no address given) is one node on 127.0.0.1: Ray's processes (GCS, raylet,
workers, agents) and torch.distributed's sockets listen on loopback only, its dashboard runs
only when asked (`--ray-dashboard`, on 127.0.0.1), and its files live in a directory only this
user can enter (Ray makes its session folders mode 0777).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgspec
import ray
import ray._private.ray_constants
import ray.exceptions
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tokenslice.config import CacheConfig, ModelConfig
from tokenslice.exec.base import WorkerError
from tokenslice.exec.merge import RankMerger
from tokenslice.exec.worker import Capacity, RankSpec, RankWorker, Sizes
from tokenslice.plan import StepPlan, StepResult

# Ray's errors for a call whose actor, worker process or node is gone.
_GONE = (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError, ray.exceptions.WorkerCrashedError,
         ray.exceptions.ObjectLostError)


class RankActor:
    """One rank in a Ray actor: a RankWorker, fed msgspec-encoded plans."""

    def __init__(self) -> None:
        self.worker: RankWorker | None = None
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode_plan = msgspec.msgpack.Decoder(StepPlan).decode

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def rendezvous_address(self) -> str:
        """torch.distributed's meeting point: this node's address and a port free on it."""
        host = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        return f"tcp://{host}:{port}"

    def start(self, spec: RankSpec) -> bytes:
        self.worker = RankWorker(spec)
        return self._encode(self.worker.capacity)

    def init_kv(self, sizes: bytes) -> None:
        assert self.worker is not None
        self.worker.init_kv(msgspec.msgpack.decode(sizes, type=Sizes))

    def execute(self, plan: bytes) -> bytes:
        assert self.worker is not None
        return self._encode(self.worker.execute(self._decode_plan(plan)))

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None


class RayExecutor:
    """`tp_size` x `pp_size` Ray actors; results come back from `poll` in submission order. With
    pipeline stages several plans are in flight, each stage on a different one (FastServe §4.3);
    `stage_busy_s` / `stage_wait_s` as in exec/merge.py."""

    def __init__(self, model: ModelConfig, cache: CacheConfig, tp_size: int, *, max_model_len: int,
                 max_batch_size: int, host_tier: bool, pp_size: int = 1, pp_layers: tuple[int, ...] | None = None,
                 address: str | None = None, dashboard: bool = False, poll_interval_s: float = 0.2,
                 death_wait_s: float = 5.0, placement_timeout_s: float = 120.0, stop_timeout_s: float = 10.0) -> None:
        self.size = tp_size * pp_size
        self.tp_size, self.pp_size = tp_size, pp_size
        self.poll_interval_s = poll_interval_s
        self.death_wait_s = death_wait_s
        self.stop_timeout_s = stop_timeout_s
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode_result = msgspec.msgpack.Decoder(StepResult).decode
        self._merger = RankMerger(tp_size, pp_size)
        # Per-stage work and waits over all plans, summed by the merger (exec/merge.py).
        self.stage_busy_s, self.stage_wait_s = self._merger.stage_busy_s, self._merger.stage_wait_s
        self._in_flight: deque[list[ray.ObjectRef]] = deque()
        self._broken: str | None = None
        self._closed = False
        self.actors: list[Any] = []  # Ray actor handles, by rank
        self.nodes: list[str] = []  # the Ray node id each rank runs on, by rank
        self._groups: list[PlacementGroup] = []
        self._pings: list[ray.ObjectRef] = []  # check_alive's outstanding call per actor, by rank
        self._private_dir: str | None = None  # the private cluster's files (None: joined a cluster)
        self._owns_ray = False
        try:
            self._owns_ray, self._private_dir = _connect(address, self.size, dashboard)
            gpu = _uses_gpu(model)
            self._groups = _place([tp_size] * pp_size, gpu, placement_timeout_s)
            self.actors = _start_actors(self._groups, gpu, loopback=self._private_dir is not None)
            self.nodes = self._gather([a.node_id.remote() for a in self.actors])
            if self._private_dir is not None:  # one node: no TCP store, nothing listens
                init_method = f"file://{self._private_dir}/rendezvous"
            else:
                init_method = self._gather([self.actors[0].rendezvous_address.remote()])[0]
            threads = max(1, torch.get_num_threads() // self.size)  # one node's cores shared by its ranks
            specs = [RankSpec(model, cache, rank, self.size, max_model_len, max_batch_size, host_tier,
                              init_method, threads, gpu=0, pp_size=pp_size,
                              pp_layers=pp_layers)  # Ray shows an actor its own GPU only
                     for rank in range(self.size)]
            caps = [msgspec.msgpack.decode(b, type=Capacity)
                    for b in self._gather([a.start.remote(s) for a, s in zip(self.actors, specs)])]
            # Every rank holds the same blocks (only heads and layers differ), as many as the smallest can.
            self.num_blocks = min(c.kv_blocks for c in caps)
            self.num_host_blocks = min(c.host_blocks for c in caps)
            # The whole model's block, summed over partitions: swap statistics compare with one rank.
            self.host_block_bytes = sum(c.host_block_bytes for c in caps)
            sizes = self._encode(Sizes(self.num_blocks, self.num_host_blocks))
            self._gather([a.init_kv.remote(sizes) for a in self.actors])
        except BaseException:
            self.close()
            raise

    # ---- Executor interface ---------------------------------------------------------------------
    def submit(self, plan: StepPlan) -> None:
        self._check_usable()
        body = self._encode(plan)
        self._in_flight.append([a.execute.remote(body) for a in self.actors])

    def poll(self) -> StepResult:
        """The oldest submitted plan's result, merged over ranks; WorkerError if a rank died."""
        self._check_usable()
        if not self._in_flight:
            raise RuntimeError("poll() with no plan submitted")
        answers = self._gather(self._in_flight.popleft())
        return self._merger.merge([self._decode_result(b) for b in answers])

    def execute(self, plan: StepPlan) -> StepResult:
        self.submit(plan)
        return self.poll()

    def check_alive(self) -> None:
        """WorkerError once an actor is gone (the idle engine calls it between requests): each
        actor has one ping call in flight, collected here without waiting and then renewed."""
        self._check_usable()
        if not self._pings:
            self._pings = [a.pid.remote() for a in self.actors]
        ready, _ = ray.wait(self._pings, num_returns=len(self._pings), timeout=0)
        for ref in ready:
            rank = self._pings.index(ref)
            try:
                ray.get(ref)
            except _GONE as e:
                self._fail(f"{self._describe(rank)} died: {type(e).__name__}: {e}")
            self._pings[rank] = self.actors[rank].pid.remote()

    def worker_pids(self) -> list[int]:
        """Each rank's actor process id (on its node)."""
        return self._gather([a.pid.remote() for a in self.actors])

    def close(self) -> None:
        """Stop the actors (kill those that do not stop within stop_timeout_s), free their
        placement, and leave the cluster this executor started or joined. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.actors and self._broken is None:
            stops = [a.stop.remote() for a in self.actors]
            ray.wait(stops, num_returns=len(stops), timeout=self.stop_timeout_s)
        self._kill_actors()
        for group in self._groups:
            remove_placement_group(group)
        self._groups = []
        self._pings = []
        if self._owns_ray:
            ray.shutdown()
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)

    # ---- internals ------------------------------------------------------------------------------
    def _gather(self, refs: list[ray.ObjectRef]) -> list[Any]:
        """Every rank's answer, in rank order; between tries, wait at most poll_interval_s. A dead
        actor's or node's call fails at once, so a death raises WorkerError within that time; a
        rank's failure, within death_wait_s more when no peer's death explains it."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        answers: list[Any] = [None] * len(refs)
        dead: list[str] = []
        failed: list[str] = []

        def collect(ready: list[ray.ObjectRef]) -> None:
            for ref in ready:
                rank = rank_of[ref]
                try:
                    answers[rank] = ray.get(ref)
                except _GONE as e:
                    dead.append(f"{self._describe(rank)} died: {type(e).__name__}: {e}")
                except ray.exceptions.RayTaskError as e:
                    failed.append(f"{self._describe(rank)} failed:\n{e}")

        pending = list(refs)
        while pending and not (dead or failed):
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=self.poll_interval_s)
            collect(ready)
        deadline = time.monotonic() + self.death_wait_s
        while failed and not dead and pending and (left := deadline - time.monotonic()) > 0:
            # A peer's death makes the survivors' collectives fail first (a lost node's actors may
            # take a second to be reported dead): wait for it a while, so that the dead rank is named first.
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=min(self.poll_interval_s, left))
            collect(ready)
        if dead or failed:
            self._fail("; ".join(dead + failed))
        return answers

    def _describe(self, rank: int) -> str:
        where = f" on node {self.nodes[rank]}" if rank < len(self.nodes) else ""
        return (f"worker rank {rank} (pipeline stage {rank // self.tp_size}, tensor-parallel rank "
                f"{rank % self.tp_size}; Ray actor{where})")

    def _kill_actors(self) -> None:
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except ray.exceptions.RayError:
                pass  # already gone
        self.actors = []

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise WorkerError(self._broken)
        if self._closed:
            raise WorkerError("the executor is closed")

    def _fail(self, message: str) -> None:
        self._broken = message
        self._kill_actors()  # the survivors may be stuck in a collective with the dead one
        raise WorkerError(message)


def _connect(address: str | None, workers: int, dashboard: bool) -> tuple[bool, str | None]:
    """Join (address, or $RAY_ADDRESS) or start a Ray cluster unless this process already is in
    one. Returns (whether this executor must leave it on close, the private cluster's directory)."""
    if ray.is_initialized():
        return False, None
    address = address or os.environ.get("RAY_ADDRESS")
    # ray.init sets a SIGTERM handler that exits; the engine core ignores SIGTERM (its server
    # stops it), so keep whatever this process had.
    handler = signal.getsignal(signal.SIGTERM)
    private_dir = None
    if address:
        ray.init(address=address, logging_level="warning")
    else:
        private_dir = _start_private_cluster(workers, dashboard)
    if handler is not None and signal.getsignal(signal.SIGTERM) is not handler:
        signal.signal(signal.SIGTERM, handler)
    return True, private_dir


def _start_private_cluster(workers: int, dashboard: bool) -> str:
    """A one-node cluster on 127.0.0.1 with a CPU for every rank; returns its directory (0700:
    Ray's own folders inside are 0777, and its unix sockets live there)."""
    private_dir = tempfile.mkdtemp(prefix="tsray-")  # short: Ray's socket paths have a length limit
    # Ray takes the node's address from the network unless it thinks it runs on a laptop (this
    # switch, read by get_node_ip_address only); with 127.0.0.1 its gRPC servers bind loopback.
    clusters = ray._private.ray_constants.ENABLE_RAY_CLUSTER
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, workers), include_dashboard=dashboard,
                 dashboard_host="127.0.0.1", logging_level="warning", _temp_dir=f"{private_dir}/ray")
    except BaseException:
        shutil.rmtree(private_dir, ignore_errors=True)
        raise
    finally:
        ray._private.ray_constants.ENABLE_RAY_CLUSTER = clusters
    return private_dir


def _uses_gpu(model: ModelConfig) -> bool:
    """CUDA ranks ask Ray for a GPU each; "auto" uses them when the cluster has some."""
    if model.device == "auto":
        return ray.cluster_resources().get("GPU", 0) > 0
    return model.device.startswith("cuda")


def _place(stage_sizes: list[int], gpu: bool, timeout_s: float) -> list[PlacementGroup]:
    """One STRICT_PACK placement group per pipeline stage: a stage's ranks on one node."""
    bundle = {"GPU": 1.0} if gpu else {"CPU": 1.0}
    groups = [placement_group([dict(bundle) for _ in range(n)], strategy="STRICT_PACK", name=f"tokenslice-stage{i}")
              for i, n in enumerate(stage_sizes)]
    deadline = time.monotonic() + timeout_s
    for i, group in enumerate(groups):
        ready, _ = ray.wait([group.ready()], timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            for g in groups:
                remove_placement_group(g)
            raise WorkerError(f"the Ray cluster cannot place pipeline stage {i}: {stage_sizes[i]} x {bundle} on one "
                              f"node within {timeout_s:.0f} s (cluster has {ray.cluster_resources()})")
    return groups


def _start_actors(groups: list[PlacementGroup], gpu: bool, loopback: bool) -> list[Any]:
    """An actor per bundle, rank order = stage order, then bundle order. The actors import the
    engine's own tokenslice (a source checkout is not on the Ray workers' path by itself); with
    `loopback` (the private cluster, one node) gloo's and NCCL's sockets use the loopback interface."""
    root = str(Path(__file__).resolve().parents[2])  # the directory that holds this tokenslice
    env = {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    if loopback and sys.platform == "linux":
        env.update({k: os.environ.get(k, "lo") for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")})
    actor_class = ray.remote(RankActor)
    actors = []
    for group in groups:
        for index in range(group.bundle_count):
            actors.append(actor_class.options(
                num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0, max_restarts=0, max_task_retries=0,
                runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
            ).remote())
    return actors
