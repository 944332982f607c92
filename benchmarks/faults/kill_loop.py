"""Kill one process of `tokenslice serve` with SIGKILL, again and again, and count how often the
server exits non-zero within the bound and how many processes are left behind.

Kinds: core (the engine-core process), worker (one rank of -tp 2), ray_actor (one Ray actor of
--executor ray -tp 2, on the private cluster the engine starts), server and ray_server (the
serve process itself, over -tp 2 workers or the private Ray cluster: its core, workers and Ray's
processes must go by themselves). Runs alternate between a streaming request
in flight and an idle server. Bounds (issue: no hang when a process dies): the server exits
non-zero within 5 s of a core/worker/actor death; every process it started is gone within 2 s
of the server's exit (or of its death).

    PYTHONPATH=. .venv/bin/python benchmarks/faults/kill_loop.py --runs 10
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # tests/faultkit.py: the kill harness
from faultkit import FLAGS, KINDS, KillOutcome, kill_and_watch, kills_server, start_serve  # noqa: E402

EXIT_BOUND_S = 5.0
ORPHAN_BOUND_S = 2.0
RESULTS = Path(__file__).resolve().parent / "results"


def one_run(kind: str, index: int) -> KillOutcome:
    srv = start_serve(*FLAGS[kind])
    try:
        return kill_and_watch(srv, kind, index, in_flight=index % 2 == 0, orphan_after_s=ORPHAN_BOUND_S)
    finally:
        left = srv.reap()
        if left:
            print(f"  reaped {len(left)} leftover processes", flush=True)


def ok(o: KillOutcome) -> bool:
    """Exited within the bound (non-zero unless it was the one killed) and left nothing running."""
    exited = o.exit_s is not None and (kills_server(o.kind) or (o.exit_s <= EXIT_BOUND_S and o.exit_code not in (0, None)))
    return exited and not o.orphans


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10, help="kills per kind")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of " + ",".join(KINDS))
    p.add_argument("--out", default=str(RESULTS / "kill_loop.json"))
    a = p.parse_args()
    summary, runs = {}, []
    for kind in a.kinds.split(","):
        outcomes = []
        for i in range(a.runs):
            o = one_run(kind, i)
            outcomes.append(o)
            runs.append(asdict(o))
            print(f"{kind:9s} run {i:2d} in_flight={o.in_flight!s:5s} exit={o.exit_code} exit_s={o.exit_s} "
                  f"gone_s={o.gone_s} orphans={len(o.orphans)} {'ok' if ok(o) else 'FAIL'}", flush=True)
            for line in o.orphans:
                print(f"    orphan: {line}", flush=True)
        exits = [o.exit_s for o in outcomes if o.exit_s is not None]
        gone = [o.gone_s for o in outcomes if o.gone_s is not None]
        summary[kind] = {
            "runs": len(outcomes), "ok": sum(ok(o) for o in outcomes),
            "exited_within_bound": sum(o.exit_s is not None and o.exit_s <= EXIT_BOUND_S for o in outcomes),
            "nonzero_exit": sum(o.exit_code not in (0, None) for o in outcomes),
            "runs_with_orphans": sum(bool(o.orphans) for o in outcomes),
            "orphans": sum(len(o.orphans) for o in outcomes),
            "max_exit_s": max(exits) if exits else None, "max_gone_s": max(gone) if gone else None,
        }
    print(f"\n{'kind':10s} {'runs':>4s} {'ok':>3s} {'exit<=5s':>8s} {'nonzero':>7s} {'orphans':>7s} "
          f"{'max exit s':>10s} {'max gone s':>10s}")
    for kind, s in summary.items():
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        print(f"{kind:10s} {s['runs']:4d} {s['ok']:3d} {s['exited_within_bound']:8d} {s['nonzero_exit']:7d} "
              f"{s['orphans']:7d} {fmt(s['max_exit_s']):>10s} {fmt(s['max_gone_s']):>10s}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"bounds": {"exit_s": EXIT_BOUND_S, "orphan_s": ORPHAN_BOUND_S},
                                       "machine": platform.platform(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                                       "summary": summary, "runs": runs}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
