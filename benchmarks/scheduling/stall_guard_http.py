"""The stall guard on the real engine over HTTP (docs/DESIGN.md, "Stall guard"): does it keep
skip-join-mlfq's, srpt-predicted's and vtc's TTFT gains over fcfs while bounding the time between
tokens of started streams?

Protocol, fixed before any run:

- `tokenslice bench --model ../shared/models/stories260k` (one `tokenslice serve --no-compile`
  per variant, default batch 64 and KV), Alpaca prompts from the 500 held-out records
  (sched_predicted.py's split: the srpt-predicted predictor never saw them), N = 150, Gamma CV 4
  arrivals at 40 req/s, seed 0, requests spread over 4 users (vtc's fairness key), outputs to the
  dataset's length (ignore_eos), streamed.
- Variants: fcfs (no guard: vLLM's behaviour, the baseline); skip-join-mlfq, srpt-predicted
  (`--length-predictor` from sched_predicted.py) and vtc, each without the guard and with
  `--stall-guard on` (a 10 tokens/s reader's timeline), and with `--max-stall-ms 250` on top.
- Two rounds; the second runs the variants in reverse order, so drift on this shared machine
  falls on all of them alike. Reported per round: mean TTFT, mean normalized latency, p99 and
  p99.9 time between tokens, total reader stall (10 tokens/s), mean QoE, preemptions of started
  streams; ratios against fcfs of the same round. Targets (the issue's): mean TTFT <= 0.3x fcfs,
  mean normalized latency <= 0.7x, p99.9 TBT <= 1.5x, total stall <= fcfs.

    PYTHONPATH=. .venv/bin/python benchmarks/scheduling/stall_guard_http.py
    PYTHONPATH=. .venv/bin/python benchmarks/scheduling/stall_guard_http.py --report-only

Results: benchmarks/scheduling/results/stall_guard_http.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # benchmarks/common: shared helpers
from sched_common import ROOT, SHARED, code_version, fmt, log, md_table, read_json, write_json  # noqa: E402
from sched_predicted import SPLITS, held_out_file, prepare  # noqa: E402

NAME = "stall_guard_http.json"
GUARDS = {"off": "--stall-guard off", "on": "--stall-guard on", "on+250ms": "--stall-guard on --max-stall-ms 250"}
VARIANTS = [("fcfs", "off")] + [(p, g) for p in ("skip-join-mlfq", "srpt-predicted", "vtc") for g in GUARDS]
METRICS = [("mean TTFT s", "mean_ttft", 1.0), ("mean norm s/tok", "mean_normalized_latency", 1.0),
           ("p99 TBT ms", "p99_tbt", 1e3), ("p99.9 TBT ms", "p999_tbt", 1e3), ("stall s", "stall_s", 1.0),
           ("QoE", "mean_qoe", 1.0), ("started preempt", "started_preemptions", 1.0)]
TARGETS = {"mean_ttft": 0.3, "mean_normalized_latency": 0.7, "p999_tbt": 1.5, "stall_s": 1.0}


def bench(policy: str, guard: str, port: int) -> dict[str, Any]:
    server_args = f"--no-compile {GUARDS[guard]}"
    if policy == "srpt-predicted":
        server_args += f" --length-predictor {SPLITS['alpaca'][2]}"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [str(ROOT / ".venv" / "bin" / "tokenslice"), "bench", "--model", str(SHARED / "models" / "stories260k"),
               "--policy", policy, "--workload", "alpaca", "--dataset", str(held_out_file("alpaca")),
               "--num-requests", "150", "--cv", "4", "--rates", "40", "--seed", "0", "--num-users", "4",
               "--quiet", "--port", str(port), f"--server-args={server_args}", "--out", str(out)]
        log(" ".join(cmd))
        subprocess.run(cmd, check=True)
        run = json.loads(out.read_text())["runs"][0]
    run.pop("per_request", None)
    return {"policy": policy, "guard": guard, "server_args": server_args, "metrics": run["metrics"]}


def table(rounds: list[list[dict[str, Any]]]) -> str:
    rows = []
    for i, runs in enumerate(rounds):
        base = next(r["metrics"] for r in runs if r["policy"] == "fcfs")
        for policy, guard in VARIANTS:
            m = next(r["metrics"] for r in runs if r["policy"] == policy and r["guard"] == guard)
            row: list[Any] = [str(i + 1), policy, guard]
            for _, key, scale in METRICS:
                v, b = m.get(key), base.get(key)
                ratio = f" ({v / b:.2f}x)" if key in TARGETS and policy != "fcfs" and v is not None and b else ""
                row.append(fmt(v * scale if v is not None else None, 3) + ratio)
            rows.append(row)
    return md_table(["round", "policy", "guard"] + [c for c, _, _ in METRICS], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=18460)
    ap.add_argument("--report-only", action="store_true")
    a = ap.parse_args()
    if a.report_only:
        out = read_json(NAME)
    else:
        t0 = time.perf_counter()
        prepare()
        rounds = []
        for i in range(a.rounds):
            order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
            rounds.append([bench(p, g, a.port) for p, g in order])
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        out = {"rounds": rounds, "machine": f"{os.cpu_count()}-CPU box, load average {load} at the end", "code": code_version(), "date": time.strftime("%Y-%m-%d"),
               "wall_s": time.perf_counter() - t0}
        write_json(NAME, out)
    print(f"## Stall guard over HTTP, stories260k, Alpaca held out, N = 150, CV 4 at 40 req/s ({out['machine']})\n")
    print(table(out["rounds"]))


if __name__ == "__main__":
    main()
