"""`tokenslice serve` start-up: seconds from launch to /health, and to compiled decode speed.

For each model, two starts in a fresh user cache directory (XDG_CACHE_HOME, where inductor's
cache lives; model/inductor_decode.py): cold (empty), then warm (what the first start compiled).
Each start (defaults of `serve`: compiled decode built in the background):
  * time to /health answering 200 (polled every 0.1 s from launch);
  * then one streaming greedy request after another (a fixed prompt, --max-tokens new tokens,
    ignore_eos): its decode speed, tokens/s between the first and the last token, single stream;
    and /v1/state's compiled_decode after each (pending while steps run eager);
  * time to compiled: the first /v1/state saying ready, and the speed of the requests from then
    (--steady requests), against the speed of those served while pending (eager, with the build
    competing for the interpreter lock and the cores);
  * the server's own progress lines (model loaded, KV cache, each bucket compiled), seconds after launch.
With --no-compile a start without compiled decode too (eager speed undisturbed).

    PYTHONPATH=. .venv/bin/python benchmarks/startup/startup_time.py
    PYTHONPATH=. .venv/bin/python benchmarks/startup/startup_time.py --models stories260k --starts cold

Results: a table, and JSON under benchmarks/startup/results/.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tokenslice.bench.servers import stop_process

ROOT = Path(__file__).resolve().parents[2]
MODELS = {"stories260k": str(ROOT.parent / "shared" / "models" / "stories260k"),
          "smollm2-135m-instruct": "smollm2-135m-instruct"}
PROMPT = "Once upon a time, there was a little"
# The server's progress lines worth a column: (name, pattern in its log).
PHASES = (("model_loaded", r"model loaded in"), ("kv_allocated", r"KV cache: "),
          ("engine_ready", r"engine core running"), ("first_bucket", r"decode bucket .* compiled"),
          ("compiled", r"decode steps compiled"))


@dataclass
class Probe:
    t: float  # seconds after launch when the request finished
    tok_s: float  # decode tokens/s, first to last token
    compiled: str  # /v1/state's compiled_decode state right after


@dataclass
class Start:
    model: str
    start: str  # cold | warm | no-compile
    health_s: float | None = None
    compiled_s: float | None = None
    eager_tok_s: float | None = None  # mean over the requests served while pending
    compiled_tok_s: float | None = None  # mean over the --steady requests after ready
    phases: dict[str, float] = field(default_factory=dict)
    probes: list[Probe] = field(default_factory=list)
    error: str | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def decode_speed(client: httpx.Client, url: str, model: str, max_tokens: int) -> float:
    """Tokens/s of one streamed greedy completion, between its first and its last token."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    times = []
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])


def compiled_state(client: httpx.Client, url: str) -> str:
    state = client.get(url + "/v1/state").json()
    return str(state.get("compiled_decode", {}).get("state", "absent"))


def log_phases(log_text: str, launched_at: float) -> dict[str, float]:
    """Seconds after launch of the first log line matching each phase (the log's clock is the wall clock)."""
    out: dict[str, float] = {}
    for line in log_text.splitlines():
        m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ", line)
        if not m:
            continue
        t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
        for name, pattern in PHASES:
            if name not in out and re.search(pattern, line):
                out[name] = round(t - launched_at, 2)
    return out


def run_start(model: str, start: str, cache_home: Path, a: argparse.Namespace, log_dir: Path) -> Start:
    result = Start(model, start)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_home)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    cmd = [sys.executable, "-m", "tokenslice.cli", "serve", "--model", MODELS[model], "--port", str(port),
           "--max-batch-size", str(a.max_batch_size)] + (["--no-compile"] if start == "no-compile" else [])
    log_path = log_dir / f"{model}-{start}.log"
    launched_at = time.time()
    t0 = time.perf_counter()
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(timeout=a.timeout) as client:
            while result.health_s is None:
                if proc.poll() is not None:
                    raise RuntimeError(f"serve exited with {proc.returncode} (log: {log_path})")
                try:
                    if client.get(url + "/health", timeout=1.0).status_code == 200:
                        result.health_s = round(time.perf_counter() - t0, 2)
                except httpx.TransportError:
                    pass
                if time.perf_counter() - t0 > a.timeout:
                    raise TimeoutError(f"no /health within {a.timeout} s")
                time.sleep(0.1)
            name = client.get(url + "/v1/models").json()["data"][0]["id"]
            after_ready = 0
            while after_ready < a.steady and time.perf_counter() - t0 < a.timeout:
                tok_s = decode_speed(client, url, name, a.max_tokens)
                state = compiled_state(client, url)
                result.probes.append(Probe(round(time.perf_counter() - t0, 2), round(tok_s, 1), state))
                if state in ("ready", "off", "absent", "failed"):
                    if result.compiled_s is None and state == "ready":
                        result.compiled_s = result.probes[-1].t
                    after_ready += 1
        eager = [p.tok_s for p in result.probes if p.compiled == "pending"]
        steady = [p.tok_s for p in result.probes if p.compiled != "pending"]
        result.eager_tok_s = round(statistics.mean(eager), 1) if eager else None
        result.compiled_tok_s = round(statistics.mean(steady), 1) if steady else None
    except Exception as e:  # recorded, and the next start goes on
        result.error = f"{type(e).__name__}: {e}"
    finally:
        stop_process(proc)
    result.phases = log_phases(log_path.read_text(), launched_at)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--starts", default="cold,warm", help="comma-separated: cold, warm (after cold), no-compile")
    p.add_argument("--max-tokens", type=int, default=48, help="new tokens of each probe request")
    p.add_argument("--steady", type=int, default=5, help="probe requests after compiled decode is ready")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a start may take in all")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "startup" / "results" /
                   f"startup_time_{time.strftime('%Y%m%d_%H%M%S')}.json")
    a = p.parse_args()
    starts: list[Start] = []
    with tempfile.TemporaryDirectory(prefix="tokenslice-startup-") as tmp:
        for model in a.models.split(","):
            cache_home = Path(tmp) / model  # empty: the first start is cold
            for start in a.starts.split(","):
                s = run_start(model, start, cache_home, a, Path(tmp))
                starts.append(s)
                print(f"{model} {start}: /health {s.health_s} s, compiled {s.compiled_s} s, eager {s.eager_tok_s} "
                      f"tok/s, compiled {s.compiled_tok_s} tok/s, phases {s.phases}" + (f", ERROR {s.error}" if s.error else ""),
                      flush=True)
    print(f"\n{'model':24} {'start':10} {'/health s':>9} {'compiled s':>10} {'eager tok/s':>11} {'compiled tok/s':>14}")
    for s in starts:
        print(f"{s.model:24} {s.start:10} {s.health_s!s:>9} {s.compiled_s!s:>10} {s.eager_tok_s!s:>11} "
              f"{s.compiled_tok_s!s:>14}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    record: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
                              "load_average_at_end": [round(x, 2) for x in load],
                              "settings": {k: str(v) for k, v in vars(a).items()},
                              "starts": [asdict(s) for s in starts]}
    a.out.write_text(json.dumps(record, indent=1))
    print(f"\nwrote {a.out}")
    return 0 if all(s.error is None for s in starts) else 1


if __name__ == "__main__":
    sys.exit(main())
