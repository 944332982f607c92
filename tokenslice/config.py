"""Engine configuration: plain dataclasses, one per concern (docs/DESIGN.md, "Layout").

These dataclasses are the one place engine defaults are written: the CLI's flags (kebab-case
field names), `LLM(...)`'s keywords and the simulator's sweeps read them from here. A field with
a fixed set of values lists it in its metadata ("choices"), which validation and the CLI share.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from tokenslice.delivery import DEFAULT_DELIVERY_RATE

PREEMPTION_MODES = ("defer", "recompute", "reactive-swap", "proactive-swap")
# When a swap-in is copied (FastSwitch §3.2): as its mode does, always before the step's compute,
# always overlapping it, or chosen per copy from measured swap statistics.
SWAP_IN_MODES = ("mode", "sync", "async", "adaptive")
STALL_GUARD_MODES = ("on", "off")
DTYPES = ("auto", "float32", "bfloat16", "float16")  # model weights and device KV
OFFLOAD_DTYPES = ("auto", "int8")
# Weight-only quantized linears (model/quant.py): auto keeps a GGUF file's precision where a kernel
# exists (Q4_x as int4, Q8_0 as int8) and leaves other checkpoints as they are.
QUANTIZATIONS = ("auto", "none", "int8", "int4")
# Paged attention: auto is triton on CUDA (kernels reading K/V in place through the block tables,
# model/triton_attention.py) and sdpa (gathered context, PyTorch SDPA) elsewhere.
ATTENTION_BACKENDS = ("auto", "triton", "sdpa")  # host KV: as on device, or per-channel int8 (ALISE §3.2)
EMBED_DTYPES = ("auto", "float32", "bfloat16")  # the length predictor's encoder weights
# Where the model runs: auto (uni for one rank, mp for several), uni (in the engine's process),
# mp (one worker process per rank, tensor- and pipeline-parallel, exec/multiproc.py), ray (one
# Ray actor per rank, on one node or several, exec/ray_executor.py).
EXECUTORS = ("auto", "uni", "mp", "ray")
# How the API server places a request on one of --data-parallel-size engines (engine/router.py).
ROUTERS = ("round-robin", "least-work", "prefix-aware")
# The KV pool without a size (model/kv_pool.py): on CUDA this share of device memory for weights
# and KV (vLLM's --gpu-memory-utilization default); on CPU this share of total RAM for the KV alone,
# as a CPU decodes tens of streams, not thousands, in RAM shared with everything else.
GPU_MEMORY_UTILIZATION = 0.9
CPU_KV_SHARE = 0.03


def field_from(cls: type, name: str, **changes: Any) -> Any:
    """A dataclass field declared like `cls`'s field `name` (its default and metadata), for
    classes that carry a config setting of their own (bench.simulate.SweepSpec); `changes`
    override, e.g. a deliberately different default."""
    f = next(f for f in fields(cls) if f.name == name)
    kw: dict[str, Any] = {"metadata": f.metadata}
    if "default" not in changes and "default_factory" not in changes:
        kw.update(default=f.default, default_factory=f.default_factory)
    return field(**{**kw, **changes})


def parse_vtc_weights(text: str | None, setting: str = "vtc_weights") -> dict[str, float]:
    """`--vtc-weights "alice=2,bob=0.5"` -> {"alice": 2.0, "bob": 0.5}; users not listed weigh 1.
    Also reads `tenant_weights` (`setting` names it in errors). ValueError names the bad entry."""
    out: dict[str, float] = {}
    for entry in (text or "").split(","):
        if not entry.strip():
            continue
        user, sep, value = entry.partition("=")
        user = user.strip()
        try:
            weight = float(value)
        except ValueError:
            weight = float("nan")
        if not sep or not user or not (0.0 < weight < float("inf")):
            raise ValueError(f"{setting}: expected NAME=WEIGHT with a positive finite weight, got {entry.strip()!r}")
        if user in out:
            raise ValueError(f"{setting}: {user!r} is listed twice")
        out[user] = weight
    return out


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


@dataclass
class ModelConfig:
    model: str = "builtin:tiny"
    tokenizer: str | None = None  # defaults to the model directory
    dtype: str = field(default="auto", metadata={"choices": DTYPES})
    device: str = "auto"  # auto | cpu | cuda (or cuda:N)
    max_model_len: int | None = None  # defaults to the checkpoint's context length
    seed: int = 0  # for requests that sample without a seed of their own
    # Keep the decode rows' block tables between steps and update what changed (vLLM v1's
    # persistent batch, model/input_batch.py); off: rebuild them from every plan (the reference).
    persistent_batch: bool = True
    # Decode-only steps as compiled code (model/compiled_decode.py). CPU: torch.compile (inductor)
    # of one decoder layer, a minute or more cold on 2 cores, seconds warm (its cache in
    # ~/.cache/tokenslice); None: on for `tokenslice serve` (a long-lived server gets 2-3x faster
    # small-model steps), off for the Python API and one-off commands.
    # CUDA: graphs per batch and context bucket, captured at start-up; cuda_graphs has no effect
    # on CPU, compile none on CUDA.
    compile: bool | None = None
    # CPU: build the compiled steps on a thread while steps run eager, so a server answers within
    # seconds; off: before the first step. None: on for `tokenslice serve`, off otherwise.
    compile_in_background: bool | None = None
    cuda_graphs: bool = True
    quantization: str = field(default="auto", metadata={"choices": QUANTIZATIONS})
    attention_backend: str = field(default="auto", metadata={"choices": ATTENTION_BACKENDS})

    def validate(self) -> None:
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("quantization", self.quantization, QUANTIZATIONS)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)


@dataclass
class CacheConfig:
    block_size: int = 16
    # Device KV pool (model/kv_pool.py): blocks, else bytes, else a fraction of total memory for
    # weights and KV (vLLM's --gpu-memory-utilization); None: GPU_MEMORY_UTILIZATION / CPU_KV_SHARE.
    kv_cache_blocks: int | None = None
    kv_cache_memory: int | None = None
    kv_memory_fraction: float | None = None
    # Host tier for swapped-out KV (allocated only in the swap preemption modes); an explicit
    # host_kv_blocks wins over the size in GiB.
    swap_space_gb: float = 4.0
    host_kv_blocks: int | None = None
    offload_dtype: str = field(default="auto", metadata={"choices": OFFLOAD_DTYPES})
    # Reuse the KV of full blocks whose leading tokens match (vLLM automatic prefix caching,
    # FastSwitch §3.3 multi-turn reuse): kept on device, and on host in the swap modes.
    enable_prefix_caching: bool = True
    # Block groups (FastSwitch §3.1): in the swap modes a request's KV sits in few contiguous
    # runs, so a swap is few large copies. Off: blocks from a plain free list, one copy per block
    # as vLLM (the baseline of FastSwitch's ablation).
    block_groups: bool = True

    def validate(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_blocks is not None and self.kv_cache_blocks < 1:
            raise ValueError(f"kv_cache_blocks must be >= 1, got {self.kv_cache_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be >= 1 byte, got {self.kv_cache_memory}")
        if self.kv_memory_fraction is not None and not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.swap_space_gb < 0:
            raise ValueError(f"swap_space_gb must be >= 0, got {self.swap_space_gb}")
        if self.host_kv_blocks is not None and self.host_kv_blocks < 0:
            raise ValueError(f"host_kv_blocks must be >= 0, got {self.host_kv_blocks}")
        _check_choice("offload_dtype", self.offload_dtype, OFFLOAD_DTYPES)


@dataclass
class SchedulerConfig:
    policy: str = "fcfs"
    preemption: str = field(default="recompute", metadata={"choices": PREEMPTION_MODES})
    max_batch_size: int = 64
    max_tokens_per_step: int = 2048
    # Skip-join MLFQ (FastServe §4.1): quantum of queue i is q1 * ratio**i, q1 from the cost model.
    mlfq_quantum_ratio: float = 2.0
    mlfq_num_queues: int = 16
    # Jobs that wait longer than this are promoted to the top queue; None derives it from the
    # latency SLO (see sched/mlfq.py).
    starvation_limit_s: float | None = None
    slo_normalized_latency: float | None = None  # s/token; informs the starvation default
    # proactive-swap burst reserve (FastServe §4.2): keep free device blocks for
    # max(K new jobs, jobs of the top K' queues not on device).
    burst_reserve_jobs: int = 2  # K
    burst_reserve_queues: int = 1  # K'
    # Anti-thrashing: a job whose KV was just loaded cannot be evicted by another load until its
    # share of service reached this many times its load time (0: off), so loads cost at most
    # 1/16 of useful work: below the 5% slack of a system at rho = 0.95. See Scheduler._protect.
    eviction_amortization: float = 16.0
    # Swap-ins in the swap modes (a preempted request's KV, a new request's prefix found on host),
    # FastSwitch §3.2: "mode" keeps each mode's own (reactive-swap: sync, in the step's critical
    # path; proactive-swap: async, overlapping compute, the request runs next step); "sync" /
    # "async" force one; "adaptive" goes async when the copy's expected time exceeds
    # swap_in_async_fraction x the expected step time, both moving averages of measured copies
    # and steps (the cost model, else the mode's own choice, before any measurement). A sync
    # copy stalls every request of the batch; an async one delays one request by a step, so
    # with batches of ~10 requests async pays once a copy costs a tenth of a step.
    swap_in: str = field(default="mode", metadata={"choices": SWAP_IN_MODES})
    swap_in_async_fraction: float = 0.1
    # srpt-predicted virtual aging (ALISE §3.1): a job's priority is its estimated remaining
    # execution time minus srpt_aging x its time in the system, so each second waited cancels
    # srpt_aging seconds of predicted work. 0 is pure SRPT (long jobs may starve); large values
    # approach FCFS. A job waits at most ~T_rem / srpt_aging behind later arrivals: 0.01 bounds
    # that slowdown at 100x, ten times the paper SLO's pace (10x a decode step), so aging is a
    # starvation guard rather than a second ordering. With the real predictors (docs/benchmarks/scheduling-simulated.md,
    # speculative scheduling), 0.1 cost 50-90% of the mean and of p95 normalized latency under
    # Gamma CV 4 bursts (0.01: within 2% of pure SRPT) and bought lower latency only for the
    # longest jobs; under Poisson and CV 2 the two differ by <= 3% on the mean.
    srpt_aging: float = 0.01
    # Output-length predictor directory (`tokenslice predictor build`; ALISE §3.1) that
    # srpt-predicted consults on arrival. Its files choose the kind (predict/online.py): an
    # embedding predictor, a self length head on the model's own hidden states (`predictor
    # build-self`, refined while decoding), or both. "auto": for srpt-predicted, the served
    # model's own self head in the state directory, from the package's head for a known model,
    # else learning online from empty (predict/online.py auto_predictor_dir). None or "none": none.
    length_predictor: str | None = "auto"
    # Append each refined prediction (request id, output tokens, predicted total) to this JSON
    # lines file, for the simulator to replay (predict/recorded.py). None: not recorded.
    length_predictor_record: str | None = None
    # Keep each finished prompt's raw text in the predictor's history as well. Off: the history
    # holds only what prediction reads (embedding, prompt and output lengths), so prompts are
    # not kept on disk.
    length_predictor_store_text: bool = False
    # vtc (Sheng et al., OSDI'24 §4): a user's service is input tokens x vtc_input_weight + output
    # tokens x vtc_output_weight (the paper's cost function and its artifact's prices 1 and 2),
    # divided by the user's share in vtc_weights ("user=w,..."; unlisted users and the anonymous
    # user weigh 1).
    vtc_input_weight: float = 1.0
    vtc_output_weight: float = 2.0
    vtc_weights: str | None = None
    # vtc over tenants (`serve --api-keys`): each tenant's share ("tenant=w,..."; unlisted tenants
    # weigh 1); a tenant's share is then divided among its users by vtc_weights.
    tenant_weights: str | None = None
    # Stall guard (docs/DESIGN.md, "Stall guard"): over every policy, a started stream whose slack
    # runs out runs next step and is not evicted. Slack: until its reader, taking delivery_rate
    # tokens/s, runs out of tokens ("on"), and until max_stall_ms after its last token (if set).
    stall_guard: str = field(default="on", metadata={"choices": STALL_GUARD_MODES})
    delivery_rate: float = DEFAULT_DELIVERY_RATE  # tokens/s; also the reader of the stall metrics
    max_stall_ms: float | None = None
    # Plan step n+1 while step n computes, its tokens filled in by the executor (vLLM's async
    # scheduling); None: on a GPU with one pipeline stage (EngineConfig.async_scheduling_on).
    async_scheduling: bool | None = None

    def validate(self) -> None:
        if self.mlfq_quantum_ratio <= 1.0:
            raise ValueError(f"mlfq_quantum_ratio must be > 1, got {self.mlfq_quantum_ratio}")
        if self.mlfq_num_queues < 1:
            raise ValueError(f"mlfq_num_queues must be >= 1, got {self.mlfq_num_queues}")
        if self.starvation_limit_s is not None and self.starvation_limit_s <= 0:
            raise ValueError(f"starvation_limit_s must be > 0, got {self.starvation_limit_s}")
        _check_choice("preemption", self.preemption, PREEMPTION_MODES)
        _check_choice("swap_in", self.swap_in, SWAP_IN_MODES)
        if not 0.0 <= self.swap_in_async_fraction < float("inf"):  # also refuses NaN
            raise ValueError(f"swap_in_async_fraction must be a finite number >= 0, got {self.swap_in_async_fraction}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.burst_reserve_jobs < 0 or self.burst_reserve_queues < 0:
            raise ValueError("burst_reserve_jobs and burst_reserve_queues must be >= 0, got "
                             f"{self.burst_reserve_jobs} and {self.burst_reserve_queues}")
        if self.max_tokens_per_step < 1:
            raise ValueError(f"max_tokens_per_step must be >= 1, got {self.max_tokens_per_step}")
        if not self.srpt_aging >= 0 or self.srpt_aging == float("inf"):  # also refuses NaN
            raise ValueError(f"srpt_aging must be a finite number >= 0, got {self.srpt_aging}")
        for name in ("vtc_input_weight", "vtc_output_weight"):
            w = getattr(self, name)
            if not 0.0 <= w < float("inf"):  # also refuses NaN
                raise ValueError(f"{name} must be a finite number >= 0, got {w}")
        if self.vtc_input_weight == 0 and self.vtc_output_weight == 0:
            raise ValueError("vtc_input_weight and vtc_output_weight cannot both be 0")
        parse_vtc_weights(self.vtc_weights)
        parse_vtc_weights(self.tenant_weights, "tenant_weights")
        _check_choice("stall_guard", self.stall_guard, STALL_GUARD_MODES)
        if not 0.0 < self.delivery_rate < float("inf"):
            raise ValueError(f"delivery_rate must be a finite number of tokens/s > 0, got {self.delivery_rate}")
        if self.max_stall_ms is not None and not 0.0 < self.max_stall_ms < float("inf"):
            raise ValueError(f"max_stall_ms must be a finite number > 0, got {self.max_stall_ms}")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Layers per pipeline stage, comma-separated, first stage first ("5,3"); None: equal counts.
    pipeline_layers: str | None = None
    executor: str = field(default="auto", metadata={"choices": EXECUTORS})
    # executor ray: the cluster to join, "auto" (the one `ray start` runs on this node) or
    # HOST:PORT of its head; None: $RAY_ADDRESS if set, else a private one-node cluster that the
    # engine starts and stops.
    ray_address: str | None = None
    # executor ray, private cluster: run Ray's dashboard (on 127.0.0.1); off unless asked.
    ray_dashboard: bool = False
    # Whole engines behind one API server (`serve` only), each its own process; a request goes to
    # the one the router picks (engine/dp_client.py).
    data_parallel_size: int = 1
    router: str = field(default="least-work", metadata={"choices": ROUTERS})

    def validate(self) -> None:
        _check_choice("executor", self.executor, EXECUTORS)
        _check_choice("router", self.router, ROUTERS)
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.executor == "uni" and self.world_size > 1:
            raise ValueError(f"executor uni runs one rank; tensor_parallel_size {self.tensor_parallel_size} x "
                             f"pipeline_parallel_size {self.pipeline_parallel_size} needs executor mp, ray "
                             "(or auto)")
        if self.pipeline_layers is not None and len(self.stage_layers or ()) != self.pipeline_parallel_size:
            raise ValueError(f"pipeline_layers {self.pipeline_layers!r}: need {self.pipeline_parallel_size} "
                             "comma-separated counts")
        if self.ray_address is not None and self.executor != "ray":
            raise ValueError(f"ray_address {self.ray_address!r} needs executor ray, got {self.executor}")
        if self.ray_dashboard and (self.executor != "ray" or self.ray_address is not None):
            raise ValueError("ray_dashboard is for the private cluster of executor ray (no ray_address): "
                             "a cluster joined by address runs its own")

    @property
    def stage_layers(self) -> tuple[int, ...] | None:
        """`pipeline_layers` as counts; None for equal counts."""
        if self.pipeline_layers is None:
            return None
        try:
            return tuple(int(n) for n in self.pipeline_layers.split(","))
        except ValueError:
            raise ValueError(f"pipeline_layers {self.pipeline_layers!r}: expected comma-separated integers") from None

    @property
    def world_size(self) -> int:
        """Ranks in all: each pipeline stage is a tensor-parallel group."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def multiproc(self) -> bool:
        """Whether the model runs in worker processes (executor mp, or auto with several ranks)."""
        return self.executor == "mp" or (self.executor == "auto" and self.world_size > 1)


@dataclass
class CpuConfig:
    """How `tokenslice serve` shares the CPUs between the API server and the engine core
    (engine/cpus.py): the API server keeps `api_server_cpus`, the core the rest."""

    api_server_cpus: int = 1  # 0: no split, both processes use every CPU
    engine_threads: int | None = None  # torch threads in the core; None: one per engine CPU (or $OMP_NUM_THREADS)
    # Bind each process to its CPUs (Linux). None: only with more than 2 CPUs; on 2 shared cores a
    # pinned core cannot move away from other load (docs/benchmarks/decode-speed-and-llamacpp.md, CPU placement).
    pin_cpus: bool | None = None

    def validate(self) -> None:
        if self.api_server_cpus < 0:
            raise ValueError(f"api_server_cpus must be >= 0, got {self.api_server_cpus}")
        if self.engine_threads is not None and self.engine_threads < 1:
            raise ValueError(f"engine_threads must be >= 1, got {self.engine_threads}")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # Cost model the policies use for iteration times: model@hardware or a `tokenslice profile`
    # JSON. None: policies that need times fall back to a fixed default iteration.
    profile: str | None = None
    # JSON-lines file that gets one record per engine step (engine/step_trace.py); None: off.
    step_trace: str | None = None

    def validate(self) -> None:
        self.model.validate()
        self.cache.validate()
        self.scheduler.validate()
        self.parallel.validate()
        if self.scheduler.async_scheduling and self.parallel.pipeline_parallel_size > 1:
            raise ValueError("async_scheduling needs pipeline_parallel_size 1: with stages the batches in "
                             "flight already overlap, and only the last stage samples the tokens a plan "
                             "ahead would need")

    def async_scheduling_on(self, device_type: str) -> bool:
        """Whether the engine plans ahead, for a model on `device_type`: as set, else on a GPU
        with one pipeline stage. Not on CPU, where the host's work and the model's share the
        cores: a 2-core machine ran SmolLM2 at half speed with it (benchmarks/decode/host_overhead.py)."""
        if self.scheduler.async_scheduling is not None:
            return self.scheduler.async_scheduling
        return self.parallel.pipeline_parallel_size == 1 and device_type == "cuda"

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """Every engine setting by its field name, sections flattened: the names `from_options`
        takes (and, in kebab case, the CLI's engine flags)."""
        return tuple(_OPTION_SECTION)

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """An EngineConfig from flat settings (`max_batch_size=8, dtype="float32"`): each goes
        to the section with a field of that name; the rest keep their defaults. TypeError names
        an unknown setting."""
        unknown = sorted(set(options) - set(_OPTION_SECTION))
        if unknown:
            raise TypeError(f"unexpected engine option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}")
        by_section: dict[str | None, dict[str, Any]] = {}
        for name, value in options.items():
            by_section.setdefault(_OPTION_SECTION[name], {})[name] = value
        top = by_section.pop(None, {})
        sections = {s: _SECTIONS[s](**kw) for s, kw in by_section.items()}
        return cls(**sections, **top)


# EngineConfig's sections, and each flat setting's section (None: a field of EngineConfig itself).
_SECTIONS: dict[str, type] = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                              "parallel": ParallelConfig}


def _option_sections() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for f in fields(EngineConfig):
        section = f.name if f.name in _SECTIONS else None
        for name in [g.name for g in fields(_SECTIONS[f.name])] if section else [f.name]:
            if name in out:
                raise AssertionError(f"engine option {name} is defined in two sections")
            out[name] = section
    return out


_OPTION_SECTION = _option_sections()
