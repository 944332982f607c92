"""The prepared GPU check of tokenslice: one run on a rented GPU machine (one H100 or H200), all
sections within 8 minutes, results in gpu_check.json and gpu_check.md under --out, both
rewritten after every section.

Sections (benchmarks/gpu/README.md): env, triton-kernels, parity, preemption-swap, decode-speed,
serve-bench. Each runs in its own process, with a time budget it checks between steps and a
hard limit past which it is killed, so a crash, a CUDA fault or a hang costs one section; rows a
section recorded before stay. --cpu-dry-run runs every section at tiny shapes on CPU (Triton's
interpreter for the kernels): the test suite runs it, so the GPU run meets no untried code.

    make gpu-carry                 # here: wheels the device image lacks, and stories260k
    make gpu-check                 # there: python3 benchmarks/gpu/gpu_check.py --out $OUT
    python3 benchmarks/gpu/gpu_check.py --cpu-dry-run --out /tmp/gc [--only parity,env]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from check_common import OverBudget, Profile, Recorder

SECTIONS = ("env", "triton-kernels", "parity", "preemption-swap", "decode-speed", "serve-bench")


def section_fn(name: str) -> Callable[[Recorder], None]:
    import check_engine
    import check_kernels
    import check_serve
    return {"env": check_kernels.env, "triton-kernels": check_kernels.triton_kernels, "parity": check_engine.parity,
            "preemption-swap": check_engine.preemption_swap, "decode-speed": check_engine.decode_speed,
            "serve-bench": check_serve.serve_bench}[name]


def run_child(name: str, profile: Profile, result: Path, budget: float) -> int:
    """In the section's own process: run it, recording rows as they come."""
    rec = Recorder(name, profile, result, budget)
    try:
        if profile.device == "cuda":
            import torch
            if not torch.cuda.is_available():
                rec.finish("error", "CUDA is not available (use --cpu-dry-run on a machine without a GPU)")
                return 1
        section_fn(name)(rec)
        rec.finish("ok")
        return 0
    except Exception as e:
        status = "skipped" if isinstance(e, OverBudget) else "error"
        rec.finish(status, f"{e}" if status == "skipped" else traceback.format_exc())
        return 0 if status == "skipped" else 1


def _pump(stream: Any, tail: collections.deque[str], log: Any) -> None:
    for line in iter(stream.readline, ""):
        sys.stdout.write(line)
        sys.stdout.flush()
        log.write(line)
        tail.append(line)


def run_section(name: str, args: argparse.Namespace, profile: Profile, budget: float, tmp: Path, log: Any
                ) -> dict[str, Any]:
    """The section in a child process, killed (its process group, by PID) past budget + grace."""
    result = tmp / f"{name}.json"
    cmd = [sys.executable, __file__, "--section", name, "--result", str(result), "--budget", f"{budget:.1f}"]
    cmd += ["--cpu-dry-run"] if args.cpu_dry_run else []
    cmd += ["--budget-scale", str(args.budget_scale)]
    # Nothing is downloaded (the device machine has no network): no hub look-up may wait on one.
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
               TOKENIZERS_PARALLELISM="false")
    env.pop("TRITON_INTERPRET", None)
    if args.cpu_dry_run:
        env["TRITON_INTERPRET"] = "1"  # before the child imports triton: kernels and the triton backend interpreted
    tail: collections.deque[str] = collections.deque(maxlen=40)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    pump = threading.Thread(target=_pump, args=(proc.stdout, tail, log), daemon=True)
    pump.start()
    try:
        rc = proc.wait(budget + profile.grace_s)
        killed = False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the section's own group: its servers and workers too
        except ProcessLookupError:
            pass
        rc, killed = proc.wait(), True
    pump.join(5)
    state: dict[str, Any] = json.loads(result.read_text()) if result.is_file() else {"section": name, "rows": []}
    state["elapsed_s"] = round(time.monotonic() - t0, 1)
    state["budget_s"] = round(budget, 1)
    if killed:
        state.update(status="error", error=f"killed after {state['elapsed_s']} s (budget {budget:.0f} s + "
                                           f"{profile.grace_s:.0f} s grace)\n" + "".join(tail))
    elif state.get("status") in (None, "running"):
        state.update(status="error", error=f"exited with {rc} before finishing\n" + "".join(tail))
    return state


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def write_report(out: Path, meta: dict[str, Any], sections: dict[str, dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps({"meta": meta, "sections": sections}, indent=1, default=str) + "\n")
    lines = [f"# tokenslice GPU check ({meta['device']})", "",
             f"{meta['started']}; {meta['mode']}; total {meta.get('elapsed_s', '?')} s.", "",
             "| section | check | result | numbers | verdict |", "| --- | --- | --- | --- | --- |"]
    for name, s in sections.items():
        head = f"{s['status']} in {s.get('elapsed_s', '?')} s (budget {s.get('budget_s', '?')} s)"
        if s.get("error"):
            head += ": " + s["error"].strip().splitlines()[-1][:300]
        lines.append(f"| {name} | (section) | {_cell(head)} |  | {s['status']} |")
        for r in s.get("rows", []):
            nums = " ".join(f"{k}={v}" for k, v in r["numbers"].items() if k != "traceback")
            lines.append(f"| {name} | {_cell(r['check'])} | {_cell(r['result'])} | {_cell(nums)} | {r['verdict']} |")
    errors = [f"### {n}: {r['check']}\n\n```\n{r['numbers'].get('traceback') or ''}\n```"
              for n, s in sections.items() for r in s.get("rows", []) if r["verdict"] == "error"]
    errors += [f"### {n}\n\n```\n{s['error']}\n```" for n, s in sections.items()
               if s.get("error") and s["status"] == "error"]
    if errors:
        lines += ["", "## Errors", "", *errors]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/gpu", help="folder for gpu_check.json, gpu_check.md, gpu_check.log")
    ap.add_argument("--cpu-dry-run", action="store_true", help="every section at tiny shapes on CPU")
    ap.add_argument("--only", default=None, help=f"comma-separated sections of: {', '.join(SECTIONS)}")
    ap.add_argument("--budget-scale", type=float, default=1.0,
                    help="multiply every time budget (a slow or busy machine; a rerun of a section)")
    ap.add_argument("--section", help=argparse.SUPPRESS)  # child mode: one section
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    profile = (Profile.cpu() if args.cpu_dry_run else Profile()).scaled(args.budget_scale)
    if args.section:
        return run_child(args.section, profile, Path(args.result), args.budget)
    names = [s.strip() for s in args.only.split(",")] if args.only else list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "device": profile.device,
            "mode": "CPU dry run (tiny shapes)" if args.cpu_dry_run else "GPU run", "argv": sys.argv[1:],
            "total_budget_s": profile.total_s}
    sections: dict[str, dict[str, Any]] = {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp, open(out / "gpu_check.log", "w") as log:
        for name in names:
            left = profile.total_s - (time.monotonic() - t0)
            budget = min(profile.budgets[name], left - profile.grace_s)
            print(f"== {name}: budget {budget:.0f} s, {time.monotonic() - t0:.0f} s elapsed", flush=True)
            if budget < 5:
                sections[name] = {"section": name, "status": "skipped", "rows": [],
                                  "error": f"skipped: the run's {profile.total_s:.0f} s are spent"}
            else:
                sections[name] = run_section(name, args, profile, budget, Path(tmp), log)
            meta["elapsed_s"] = round(time.monotonic() - t0, 1)
            write_report(out, meta, sections)
            print(f"== {name}: {sections[name]['status']} in {sections[name].get('elapsed_s', 0)} s", flush=True)
    bad = [n for n, s in sections.items() if s["status"] == "error"]
    print(f"wrote {out / 'gpu_check.md'} and gpu_check.json in {meta['elapsed_s']} s; "
          f"{len(bad)} section(s) errored{': ' + ', '.join(bad) if bad else ''}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
