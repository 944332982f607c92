"""One rank: `RankWorker` holds its share of the model (model/tp.py; with pipeline parallelism
its stage's layers, model/pp.py), its KV partition on both tiers, and runs every StepPlan it
receives; `worker_main` is the process that exec/multiproc.py starts around it
(exec/ray_executor.py runs the same RankWorker in a Ray actor).

Messages are ZMQ multipart frames [kind, body] with msgspec bodies. StepPlan and StepResult are
encoded as the dataclasses they are, every field included, so fields added to them (or to
SeqSlice, BlockTransfer, SamplingParams) travel without change here. Each rank runs the whole
plan on its own partition: compute, sync swaps and async transfers alike (FastServe §4.3), and
answers with its StepResult; the executor merges them (exec/merge.py).

Pipeline stages (FastServe Fig. 10): every rank gets every plan, in submission order, and takes
plans up one at a time; a stage runs the plan's swaps for its own layers' KV as it takes the
plan up, before its activations arrive from the previous stage, so the swaps overlap the
upstream compute of the same batch. Ranks are stage-major (model/pp.py); the last stage's
tensor-parallel rank 0 answers with the sampled tokens.
"""
from __future__ import annotations

import functools
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import zmq

from tokenslice.config import CacheConfig, ModelConfig
from tokenslice.exec.parent_watch import exit_with_parent
from tokenslice.plan import StepPlan, StepResult

if TYPE_CHECKING:
    from tokenslice.model.loader import LoadedModel
    from tokenslice.model.pp import StagePipe

# Engine -> worker
INIT = b"init"  # Sizes: build the runner
STEP = b"step"  # StepPlan
STOP = b"stop"
# Worker -> engine: [rank, kind, body]
READY = b"ready"  # Capacity: the model is loaded
RESULT = b"result"  # StepResult (to INIT: an empty one)
ERROR = b"error"  # traceback text; the worker exits
# A result the engine does not take within this (it closed its socket: stopping, or failing) is
# dropped, and the worker exits, rather than wait for a reader that will not come.
RESULT_SEND_TIMEOUT_MS = 5000


@dataclass
class Capacity:
    """What one rank can hold, and what its partition of one block weighs."""

    kv_blocks: int
    host_blocks: int
    host_block_bytes: int  # one block's partition in the offload format


@dataclass
class Sizes:
    """The pool sizes every rank uses: the smallest rank's."""

    kv_blocks: int
    host_blocks: int


@dataclass
class RankSpec:
    """Everything a rank needs, whatever starts it."""

    model: ModelConfig
    cache: CacheConfig
    rank: int
    size: int  # the world: tensor-parallel size x pp_size
    max_model_len: int
    max_batch_size: int
    host_tier: bool  # the preemption mode swaps: allocate the host tier
    init_method: str  # torch.distributed rendezvous
    threads: int  # torch intra-op threads (CPU)
    gpu: int  # CUDA device index in this process (its rank, or 0 where Ray shows one GPU)
    pp_size: int = 1  # pipeline stages
    pp_layers: tuple[int, ...] | None = None  # layers per stage; None: equal counts

    @property
    def tp_size(self) -> int:
        return self.size // self.pp_size

    @property
    def answer_rank(self) -> int:
        """The rank whose sampled tokens are the answer: the last stage's first."""
        return self.size - self.tp_size


@dataclass
class WorkerSpec:
    """A rank run by worker_main: its spec and the ZMQ endpoints, passed to the spawned process."""

    rank: RankSpec
    plan_address: str  # this rank's ZMQ PULL endpoint
    result_address: str  # the executor's ZMQ PULL endpoint


def _rank_grammars(model: Any) -> Any:
    """model.grammar.Grammars of this rank's model (xgrammar loads with the first structured request)."""
    from tokenslice.model.grammar import model_grammars

    return model_grammars(model)


class RankWorker:
    """One rank, apart from how plans reach it: joins the process group, loads its shard (and
    stage) and reports its `capacity`; `init_kv` builds the runner with the agreed sizes."""

    def __init__(self, spec: RankSpec) -> None:
        import torch.distributed as dist

        from tokenslice.model.loader import rank_device
        from tokenslice.model.kv_pool import kv_pool
        from tokenslice.model.runner import host_block_bytes, num_host_kv_blocks

        self.spec = spec
        self.runner = None  # model.runner.ModelRunner once the sizes are known
        device = rank_device(spec.model.device, spec.gpu)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(spec.threads)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=spec.init_method,
                                rank=spec.rank, world_size=spec.size)
        try:
            self.loaded, self.pipe = _load_stage(spec)
            # On CPU every rank's KV partition shares the one memory; on CUDA each has its GPU.
            sharing = spec.size if self.loaded.device.type == "cpu" else 1
            self.pool = kv_pool(spec.cache, self.loaded, spec.max_model_len, spec.max_batch_size, sharing)
            self.capacity = Capacity(
                kv_blocks=self.pool.blocks,
                host_blocks=num_host_kv_blocks(spec.cache, self.loaded, spec.size) if spec.host_tier else 0,
                host_block_bytes=host_block_bytes(self.loaded.arch, spec.cache.block_size, self.loaded.dtype,
                                                  spec.cache.offload_dtype))
        except BaseException:
            dist.destroy_process_group()
            raise

    def init_kv(self, sizes: Sizes) -> None:
        from tokenslice.model.runner import ModelRunner

        spec = self.spec
        self.runner = ModelRunner(self.loaded, sizes.kv_blocks, spec.cache.block_size, spec.model.seed,
                                  num_host_blocks=sizes.host_blocks, offload_dtype=spec.cache.offload_dtype,
                                  pipe=self.pipe, persistent_batch=spec.model.persistent_batch,
                                  # Ranks run decode eager: collectives inside compiled code and
                                  # graphs are untested here.
                                  compile=bool(spec.model.compile) and spec.size == 1,
                                  cuda_graphs=spec.model.cuda_graphs and spec.size == 1,
                                  max_batch_size=spec.max_batch_size, max_model_len=spec.max_model_len,
                                  attention_backend=spec.model.attention_backend,
                                  kv_source=self.pool.source if sizes.kv_blocks == self.pool.blocks
                                  else "the smallest rank's pool")
        # Structured outputs: this rank samples too, from grammars it compiles itself.
        self.runner.sampler.grammar_source = functools.partial(_rank_grammars, spec.model)

    def execute(self, plan: StepPlan) -> StepResult:
        if self.runner is None:
            raise RuntimeError(f"rank {self.spec.rank}: a plan arrived before the KV sizes")
        result = self.runner.execute(plan)
        if self.spec.rank != self.spec.answer_rank:
            result.sampled = {}  # the last stage's ranks sample the same tokens; one answers
        return result

    def close(self) -> None:
        import torch.distributed as dist

        if self.runner is not None:
            self.runner.close()
            self.runner = None
        if dist.is_initialized():
            dist.destroy_process_group()


def worker_main(spec: WorkerSpec) -> None:
    """The process's entry point: rendezvous, load, serve plans until STOP or the engine is gone."""
    # Ctrl-C and a SIGTERM to the whole process group are the engine's to handle; it stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    exit_with_parent(f"tokenslice rank {spec.rank.rank}")  # an engine killed without stopping us
    ctx = zmq.Context()
    results = ctx.socket(zmq.PUSH)
    results.setsockopt(zmq.LINGER, RESULT_SEND_TIMEOUT_MS)
    results.setsockopt(zmq.SNDTIMEO, RESULT_SEND_TIMEOUT_MS)
    results.connect(spec.result_address)
    plans = ctx.socket(zmq.PULL)
    plans.setsockopt(zmq.LINGER, 0)
    plans.connect(spec.plan_address)
    rank = str(spec.rank.rank).encode()
    code = 0
    try:
        _serve(spec, plans, results, rank)
    except BaseException:  # noqa: BLE001 - reported to the engine, which raises it
        text = traceback.format_exc()
        sys.stderr.write(f"tokenslice tensor-parallel rank {spec.rank.rank}:\n{text}")
        try:
            results.send_multipart([rank, ERROR, text.encode()])
        except zmq.Again:
            pass  # the engine is not reading: it stops or kills us anyway
        code = 1
    finally:
        plans.close()
        results.close()
        ctx.term()
    # All is closed: skip the interpreter's teardown, where torch.distributed's destructors
    # take seconds (measured: 3.5 s per worker on CPU), so that close() returns promptly.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve(spec: WorkerSpec, plans: zmq.Socket, results: zmq.Socket, rank: bytes) -> None:
    encode = msgspec.msgpack.Encoder().encode
    worker = RankWorker(spec.rank)
    try:
        results.send_multipart([rank, READY, encode(worker.capacity)])
        decode_plan = msgspec.msgpack.Decoder(StepPlan).decode
        while True:
            # As long as the next plan takes: if the engine dies meanwhile, the parent watch ends us.
            kind, body = plans.recv_multipart()
            if kind == STOP:
                return
            if kind == INIT:
                worker.init_kv(msgspec.msgpack.decode(body, type=Sizes))
                results.send_multipart([rank, RESULT, encode(StepResult())])
                continue
            results.send_multipart([rank, RESULT, encode(worker.execute(decode_plan(body)))])
    finally:
        worker.close()


def _load_stage(spec: RankSpec) -> tuple[LoadedModel, StagePipe | None]:
    """This rank's model and, with pipeline stages, its StagePipe. Every rank
    creates every stage's tensor-parallel group, in the same order (torch.distributed asks it)."""
    import torch.distributed as dist

    from tokenslice.model.loader import load_arch, load_model
    from tokenslice.model.pp import PPStage, StagePipe

    tp = spec.tp_size
    if spec.pp_size == 1:
        return load_model(spec.model, spec.rank, tp, with_tokenizer=False, gpu=spec.gpu), None
    index, tp_rank = divmod(spec.rank, tp)
    group = None
    if tp > 1:
        for s in range(spec.pp_size):
            g = dist.new_group(list(range(s * tp, (s + 1) * tp)))
            group = g if s == index else group
    stage = PPStage.of(load_arch(spec.model), index, spec.pp_size, spec.pp_layers)
    loaded = load_model(spec.model, tp_rank, tp, with_tokenizer=False, stage=stage, group=group, gpu=spec.gpu)
    pipe = StagePipe(stage, spec.rank, tp, loaded.arch.hidden_size, loaded.dtype, loaded.device)
    return loaded, pipe
