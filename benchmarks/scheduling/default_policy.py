"""Which policy `tokenslice serve` runs by default: the candidates on the default model over HTTP.

Protocol, fixed before any run:

- `tokenslice bench --model smollm2-135m-instruct` (one `tokenslice serve` per policy, its default
  flags: compiled decode, which the bench waits for, the stall guard on, batch 64); candidates
  fcfs (vLLM's order, the baseline), skip-join-mlfq, srpt-predicted (the self length head the
  package ships, `--length-predictor auto`) and vtc.
- Prompts held out from the shipped head's answers: Alpaca records and ShareGPT conversations
  (their first human -> gpt pair) that benchmarks/length/own_answers.py's sample never drew. Chat
  endpoint; max_tokens = the dataset answer's length, capped at 512, and the model's own end of
  answer ends a request earlier (no ignore_eos): the traffic a chat service sees. N = 200 requests
  per point, seed 0, spread over 4 users (vtc's key), streamed.
- Saturation: fcfs's throughput with 128 requests in flight (closed loop, the same N: twice the
  batch of 64, so requests queue), per dataset; the points are Poisson (CV 1) and Gamma CV 4
  arrivals at 0.5x and 0.9x of it.
- Revised once (2026-11-29), before any complete run: the first protocol took N = 60 and
  saturation at 64 in flight. With fewer requests than the batch holds, no request ever waits for
  a slot, so "saturation" was one batch's makespan and every point ran at no queueing at all
  (mean TTFT 0.06-0.2 s for every policy on Alpaca): it could not tell the policies apart.
- Reported per point: mean TTFT, p99.9 time between tokens, mean normalized latency, throughput;
  ratios against fcfs at the same point. The checks: mean TTFT <= 0.3x fcfs and p99.9 TBT <= 1.5x.
- Choice rule: the default is the candidate meeting both checks at the most points; a tie goes to
  the lower geometric mean of its TTFT ratios. fcfs is a candidate too (ratios 1, no check met):
  a policy that meets no check and is slower on average does not replace it.

    nohup .venv/bin/python benchmarks/scheduling/default_policy.py > /tmp/default_policy.log 2>&1 &
    .venv/bin/python benchmarks/scheduling/default_policy.py --report-only

Results: benchmarks/scheduling/results/default_policy.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # benchmarks/common: shared helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "length"))  # own_answers.py: the head's sample
from sched_common import ROOT, SHARED, code_version, fmt, log, md_table, read_json, write_json  # noqa: E402

NAME = "default_policy.json"
MODEL = "smollm2-135m-instruct"
CANDIDATES = ["fcfs", "skip-join-mlfq", "srpt-predicted", "vtc"]
LOADS = [0.5, 0.9]
CVS = [1.0, 4.0]
N = 200
SATURATION_CONCURRENCY = 128
MAX_TOKENS_CAP = 512
CHECKS = {"mean_ttft": 0.3, "p999_tbt": 1.5}
METRICS = [("mean TTFT s", "mean_ttft", 1.0), ("p99.9 TBT ms", "p999_tbt", 1e3),
           ("mean norm s/tok", "mean_normalized_latency", 1.0), ("tok/s", "throughput_tok_s", 1.0)]


def held_out_files(work: Path) -> dict[str, Path]:
    """Alpaca records and ShareGPT conversations that own_answers.py's sample never drew."""
    from own_answers import SAMPLE, sample_prompts

    drawn = {pid for pid, _, _ in sample_prompts(*SAMPLE)}
    alpaca = json.loads((SHARED / "data" / "alpaca_4500.json").read_text())
    sharegpt = json.loads((SHARED / "data" / "sharegpt_multiturn_800.json").read_text())
    kept = {"alpaca": [r for i, r in enumerate(alpaca) if f"alpaca-{i}" not in drawn],
            "sharegpt": [c for c in sharegpt if f"sharegpt-{c.get('id')}" not in drawn]}
    work.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, records in kept.items():
        out[name] = work / f"{name}_held_out.json"
        out[name].write_text(json.dumps(records))
        log(f"{name}: {len(records)} held-out records")
    return out


def bench(dataset: str, file: Path, policies: list[str], extra: list[str]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [str(ROOT / ".venv" / "bin" / "tokenslice"), "bench", "--model", MODEL, "--policy", ",".join(policies),
               "--workload", dataset, "--dataset", str(file), "--num-requests", str(N), "--seed", "0",
               "--num-users", "4", "--endpoint", "chat", "--no-ignore-eos", "--max-tokens-cap", str(MAX_TOKENS_CAP),
               "--early-stop-factor", "0", "--quiet", "--out", str(out), *extra]
        log(" ".join(cmd))
        # A fresh state directory per run: srpt-predicted's self head starts from the shipped one
        # at every point, never from answers to these same prompts at an earlier point.
        subprocess.run(cmd, check=True, env=os.environ | {"XDG_STATE_HOME": str(Path(tmp) / "state")})
        runs = json.loads(out.read_text())["runs"]
    for run in runs:
        per = run.pop("per_request", None) or {}
        run["error_counts"] = per.get("error_counts")  # what failed requests said (kept: small)
    return runs


def measure(work: Path) -> dict[str, Any]:
    files = held_out_files(work)
    out: dict[str, Any] = {"saturation_rps": {}, "points": []}
    for dataset, file in files.items():
        sat = bench(dataset, file, ["fcfs"], ["--concurrency", str(SATURATION_CONCURRENCY)])[0]
        rps = sat["metrics"]["throughput_rps"]
        out["saturation_rps"][dataset] = rps
        log(f"{dataset}: fcfs saturation {rps:.3f} req/s")
        for cv in CVS:
            rates = ",".join(f"{load * rps:.4f}" for load in LOADS)
            for run in bench(dataset, file, CANDIDATES, ["--rates", rates, "--cv", str(cv)]):
                load = min(LOADS, key=lambda x: abs(x * rps - run["rate"]))
                out["points"].append({"dataset": dataset, "cv": cv, "load": load, "policy": run["policy"],
                                      "rate": run["rate"], "metrics": run["metrics"],
                                      "error_counts": run.get("error_counts")})
                write_json(NAME, out | {"partial": True})
    return out


def ratios(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each candidate's metrics against fcfs at the same (dataset, cv, load)."""
    base = {(p["dataset"], p["cv"], p["load"]): p["metrics"] for p in points if p["policy"] == "fcfs"}
    rows = []
    for p in points:
        b = base.get((p["dataset"], p["cv"], p["load"]))
        if b is None:
            continue
        r = {k: (p["metrics"].get(k) / b[k] if p["metrics"].get(k) is not None and b.get(k) else None)
             for k, _ in CHECKS.items()}
        rows.append(p | {"ratio": r, "meets": all(r[k] is not None and r[k] <= v for k, v in CHECKS.items())})
    return rows


def choose(rows: list[dict[str, Any]]) -> str:
    """The choice rule of the protocol: most points meeting both checks, then the lower geometric
    mean TTFT ratio."""
    def score(policy: str) -> tuple[int, float]:
        mine = [r for r in rows if r["policy"] == policy]
        met = sum(r["meets"] for r in mine)
        ttft = [r["ratio"]["mean_ttft"] for r in mine if r["ratio"]["mean_ttft"]]
        gm = math.exp(sum(math.log(x) for x in ttft) / len(ttft)) if ttft else math.inf
        return -met, gm
    return min(CANDIDATES, key=lambda p: (0, 1.0) if p == "fcfs" else score(p))


def report(out: dict[str, Any]) -> None:
    rows = ratios(out["points"])
    table = []
    for r in sorted(rows, key=lambda r: (r["dataset"], r["cv"], r["load"], CANDIDATES.index(r["policy"]))):
        cells: list[Any] = [r["dataset"], f"{r['cv']:g}", f"{r['load']:g}", r["policy"]]
        for _, key, scale in METRICS:
            v = r["metrics"].get(key)
            ratio = r["ratio"].get(key)
            cells.append(fmt(v * scale if v is not None else None, 3)
                         + (f" ({ratio:.2f}x)" if ratio is not None and r["policy"] != "fcfs" else ""))
        cells.append("yes" if r["meets"] else "no" if r["policy"] != "fcfs" else "")
        table.append(cells)
    sat = ", ".join(f"{k} {v:.2f} req/s" for k, v in out["saturation_rps"].items())
    print(f"## Default policy candidates, {MODEL} over HTTP, N = {N}, seed 0 (fcfs saturation: {sat}; "
          f"{out.get('machine', '')})\n")
    print(md_table(["dataset", "CV", "load", "policy"] + [c for c, _, _ in METRICS] + ["meets checks"], table))
    print(f"\nchosen by the protocol's rule: {choose(rows)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "tokenslice-default-policy")
    a = ap.parse_args()
    if a.report_only:
        out = read_json(NAME)
    else:
        t0 = time.perf_counter()
        out = measure(a.work)
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        out |= {"machine": f"{os.cpu_count()}-CPU box, load average {load} at the end", "code": code_version(),
                "date": time.strftime("%Y-%m-%d"), "wall_s": time.perf_counter() - t0}
        write_json(NAME, out)
    report(out)


if __name__ == "__main__":
    main()
