"""DESIGN.md, Layout: the scheduler, the KV bookkeeping and the cost model stay torch-free, so the
simulator runs fast and never needs a model."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_planning_layers_do_not_import_torch() -> None:
    code = ("import sys; import tokenslice.sched.scheduler, tokenslice.sched.mlfq, tokenslice.sched.srpt, "
            "tokenslice.sched.fcfs, tokenslice.kv.manager, tokenslice.kv.groups, tokenslice.predict.cost, "
            "tokenslice.exec.sim, tokenslice.engine.engine; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    assert out == "False"
