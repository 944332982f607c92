"""What every section of the GPU check shares: the run's profile (GPU or CPU dry run), the
recorder a section writes its rows through, timers, bandwidth probes and random checkpoints."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _work_dir() -> Path:
    """Where checkpoints built on the machine go (shared by sections): memory-backed /dev/shm when it
    holds the 8B-shape one with room to spare (saving 16 GB to disk can take a minute), else /tmp."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 48e9:
        return shm / "tokenslice-gpu-check"
    return Path("/tmp/tokenslice-gpu-check")


WORK = _work_dir()
STORIES_PLACES = (ROOT / ".gpu-carry" / "models" / "stories260k", ROOT.parent / "shared" / "models" / "stories260k")

# Random-weight model shapes (Llama-3.2-1B's and Llama-3-8B's, and small ones); head_dim = hidden / heads.
LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True)
LLAMA_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False)
TINY_HD64 = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512, vocab_size=512, tie_word_embeddings=False)
TINY_HD16 = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1024, tie_word_embeddings=True)


def _gpu_budgets() -> dict[str, float]:
    return {"env": 25, "triton-kernels": 70, "parity": 60, "preemption-swap": 40, "decode-speed": 185,
            "serve-bench": 95}


@dataclass(frozen=True)
class Profile:
    """Sizes of one run: the defaults are the GPU run's, `cpu()` the dry run's (tiny, same code)."""

    device: str = "cuda"
    dry_run: bool = False
    total_s: float = 460.0  # the whole run, 8 minutes with the last section's grace
    grace_s: float = 20.0  # past its budget a section may finish its step for this long, then is killed
    budgets: dict[str, float] = field(default_factory=_gpu_budgets)
    need_scale: float = 1.0  # times a step is expected to take, relative to the GPU run's estimates
    copy_bytes: int = 1 << 30  # device-to-device copy probe
    pinned_bytes: int = 256 << 20  # host<->device probe
    kernel_shapes: tuple[tuple[int, int, int], ...] = ((9, 3, 64), (32, 8, 128))  # (q heads, kv heads, head_dim)
    kernel_dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    kernel_block_sizes: tuple[int, ...] = (16, 32)
    decode_lens: tuple[int, ...] = (1, 15, 16, 17, 100, 513, 2047)  # ragged; the long ones split (flash-decoding)
    prefill_cases: tuple[tuple[int, int], ...] = ((5, 5), (7, 40), (1, 18), (70, 200), (33, 33))  # (new, keys)
    kernel_bench: tuple[int, int, int] = (64, 1024, 20)  # decode rows, context, timed reps
    parity_prompts: int = 8
    parity_tokens: int = 32
    parity_cases: tuple[tuple[str, str, str], ...] = tuple(
        (m, dt, be) for m in ("stories260k", "tiny-hd64") for dt in ("float32", "bfloat16") for be in ("triton", "sdpa"))
    parity_graphs: tuple[bool, ...] = (True, False)
    chat_model: bool = True  # smollm2-135m-instruct, where its package is installed
    swap_cases: tuple[tuple[str, str], ...] = (("stories260k", "sdpa"), ("tiny-hd64", "triton"))  # (model, backend)
    swap_policies: tuple[str, ...] = ("skip-join-mlfq", "fixed-priority")
    swap_tokens: int = 24
    swap_move_blocks: int = 256
    decode_models: tuple[tuple[str, dict[str, Any], float], ...] = (
        ("llama-1b-shape", LLAMA_1B, 60.0), ("llama-8b-shape", LLAMA_8B, 110.0))  # (name, shape, seconds)
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    hf_batches: tuple[int, ...] = (1, 64)
    decode_prompt: int = 64
    decode_tokens: int = 128
    hf_tokens: int = 32
    serve_model: tuple[str, dict[str, Any]] = ("llama-1b-shape", LLAMA_1B)
    serve_flags: tuple[str, ...] = ()
    serve_requests: int = 150
    serve_rate: float = 30.0
    dtype: str = "bfloat16"  # of the speed models

    def scaled(self, factor: float) -> Profile:
        """Every time budget times `factor`."""
        return replace(self, total_s=self.total_s * factor, grace_s=self.grace_s * factor,
                       budgets={k: v * factor for k, v in self.budgets.items()},
                       decode_models=tuple((n, s, t * factor) for n, s, t in self.decode_models))

    @classmethod
    def cpu(cls) -> Profile:
        return cls(device="cpu", dry_run=True, total_s=110.0, grace_s=10.0,
                   budgets={"env": 10, "triton-kernels": 20, "parity": 30, "preemption-swap": 25, "decode-speed": 20,
                            "serve-bench": 35}, need_scale=0.3,
                   copy_bytes=64 << 20, pinned_bytes=0, kernel_shapes=((9, 3, 64),), kernel_block_sizes=(16,),
                   decode_lens=(1, 17, 530), prefill_cases=((5, 5), (7, 40), (1, 18)), kernel_bench=(2, 64, 2),
                   parity_prompts=3, parity_tokens=8, parity_graphs=(False,), chat_model=False,
                   parity_cases=(("stories260k", "float32", "sdpa"), ("stories260k", "bfloat16", "sdpa"),
                                 ("tiny-hd64", "float32", "triton"), ("tiny-hd64", "float32", "sdpa")),
                   swap_cases=(("stories260k", "sdpa"),), swap_policies=("fixed-priority",), swap_tokens=8,
                   swap_move_blocks=32, decode_models=(("tiny-hd16", TINY_HD16, 15.0),), decode_batches=(1, 2),
                   hf_batches=(1, 2), decode_prompt=16, decode_tokens=8, hf_tokens=4,
                   serve_model=("tiny-hd16", TINY_HD16), serve_flags=("--no-engine-process", "--no-compile"), serve_requests=6,
                   serve_rate=20.0, dtype="float32")


class OverBudget(Exception):
    """A step would not fit in what is left of its section's time."""


class Recorder:
    """A section's rows, written to `path` (JSON) after each one, so a killed section keeps them."""

    def __init__(self, name: str, profile: Profile, path: Path, budget_s: float) -> None:
        self.name, self.profile, self.path = name, profile, path
        self.start = time.monotonic()
        self.deadline = self.start + budget_s
        self.state: dict[str, Any] = {"section": name, "status": "running", "budget_s": budget_s, "rows": [],
                                      "data": {}}
        self.save()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def need(self, seconds: float, what: str) -> None:
        seconds *= self.profile.need_scale
        if self.left() < seconds:
            raise OverBudget(f"skipped: over budget ({what} needs ~{seconds:.0f} s, {self.left():.0f} s left)")

    def log(self, msg: str) -> None:
        print(f"[{self.name} +{time.monotonic() - self.start:6.1f}s] {msg}", flush=True)

    def row(self, check: str, result: str, numbers: dict[str, Any] | None = None, verdict: str = "info") -> None:
        """verdict: pass | fail | info | skipped | error."""
        self.state["rows"].append({"check": check, "result": result, "numbers": numbers or {}, "verdict": verdict})
        self.log(f"{verdict.upper():7} {check}: {result} {_fmt(numbers or {})}")
        self.save()

    @contextmanager
    def case(self, check: str) -> Iterator[None]:
        """One isolated part of a section: an exception becomes an error row (over budget: a
        skipped one) and the section goes on."""
        try:
            yield
        except OverBudget as e:
            self.row(check, str(e), verdict="skipped")
        except Exception as e:
            tb = traceback.format_exc(limit=-6)
            self.row(check, f"{type(e).__name__}: {e}"[:400], {"traceback": tb}, verdict="error")

    def finish(self, status: str, error: str | None = None) -> None:
        self.state.update(status=status, elapsed_s=round(time.monotonic() - self.start, 2))
        if error:
            self.state["error"] = error
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1, default=str))
        tmp.replace(self.path)


def _fmt(numbers: dict[str, Any]) -> str:
    def one(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    return " ".join(f"{k}={one(v)}" for k, v in numbers.items() if k != "traceback")


def sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def best_seconds(fn: Callable[[], object], device: str, reps: int, warmup: int = 1, inner: int = 1
                 ) -> tuple[float, float]:
    """(best, median) wall seconds of one fn call over `reps` timings of `inner` calls each, the
    device synchronized around each timing (inner > 1: short kernels, launch queue kept full)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        sync(device)
        times.append((time.perf_counter() - t) / inner)
    return min(times), statistics.median(times)


def copy_gbps(device: str, nbytes: int) -> float:
    """Device-memory copy bandwidth, bytes read + written per second (GB/s)."""
    import torch
    a = torch.ones(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    best, _ = best_seconds(lambda: b.copy_(a), device, reps=10, warmup=2)
    return 2 * nbytes / best / 1e9


def pinned_gbps(nbytes: int) -> dict[str, float]:
    """Pinned host <-> device copy bandwidth in each direction (GB/s)."""
    import torch
    host = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d, _ = best_seconds(lambda: dev.copy_(host, non_blocking=True), "cuda", reps=5)
    d2h, _ = best_seconds(lambda: host.copy_(dev, non_blocking=True), "cuda", reps=5)
    return {"h2d_GBps": nbytes / h2d / 1e9, "d2h_GBps": nbytes / d2h / 1e9}


def stories_path() -> Path:
    for p in STORIES_PLACES:
        if (p / "config.json").is_file():
            return p
    raise FileNotFoundError(f"stories260k not found in {', '.join(map(str, STORIES_PLACES))} (make gpu-carry)")


def head_dim(path: Path) -> int:
    cfg = json.loads((path / "config.json").read_text())
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def random_llama(name: str, shape: dict[str, Any], dtype: str, device: str, keep: bool = False
                 ) -> tuple[Path, Any]:
    """A random-weight Llama checkpoint of `shape` in WORK/name (config.json, safetensors,
    stories260k's tokenizer), initialised on `device` (fast on a GPU) and saved; built once, into a
    folder of its own renamed into place, so a reader never sees half of one. Returns (path, the
    transformers model if `keep`, built anew then, else None)."""
    path = WORK / name
    if path.is_dir() and not keep:
        return path, None
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype)).eval()
    building = WORK / f".{name}.{os.getpid()}"
    model.save_pretrained(building)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(stories_path() / f, building / f)
    shutil.rmtree(path, ignore_errors=True)
    try:
        building.rename(path)
    except OSError:  # another run put one there meanwhile: the same seed and shape
        shutil.rmtree(building, ignore_errors=True)
    return path, model if keep else None


def model_path(name: str) -> Path:
    """A parity/swap model by name: stories260k, or a small random one built here."""
    if name == "stories260k":
        return stories_path()
    return random_llama(name, {"tiny-hd64": TINY_HD64, "tiny-hd16": TINY_HD16}[name], "float32", "cpu")[0]


def hf_generate(model: Any, prompt: list[list[int]] | list[int], n: int) -> list[list[int]]:
    """transformers' greedy generate of exactly n tokens (no end-of-sequence stop), new ids per row."""
    import torch
    from transformers import GenerationConfig

    rows = prompt if prompt and isinstance(prompt[0], list) else [prompt]
    ids = torch.tensor(rows, device=model.device)
    model.generation_config.eos_token_id = None  # as ignore_eos: defaults merged in cannot bring it back
    gc = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    if out.shape[1] != ids.shape[1] + n:
        raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, not {n}")
    return out[:, ids.shape[1]:].tolist()


def free_memory() -> None:
    import gc

    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class Timer:
    """Seconds since creation, for a row's numbers."""

    t0: float = field(default_factory=time.perf_counter)

    def __call__(self) -> float:
        return round(time.perf_counter() - self.t0, 2)
