"""The sybil scenario of vtc on the simulator: does a client that spreads its requests over many
made-up `user` values take another client's share?

Protocol, fixed before any run:

- Cost model opt-13b@a100-40gb, ample KV; `--policy vtc` (weights 1 and 2), batch 2 and 16.
- The attacker: 48 requests (8-token prompts, 400 output tokens), arriving at t = 0, on 1 or on
  48 user ids. After 30 steps, the victim: one request (8-token prompt, 32 output tokens).
- Keyed by `user` alone (no --api-keys: every request's tenant is None) or by tenant (attacker
  and victim are two tenants, the `user` divides only the attacker's own share).
- The stall guard (sched/stall_guard.py) off, and on at its defaults (readers at 10 tokens/s).
- Reported: the victim's steps from arrival to its end, its latency (virtual seconds), and the
  ratio of its latency with 48 ids to that with 1 id (the issue's bound: at most 1.5x).

    PYTHONPATH=. .venv/bin/python benchmarks/scheduling/sybil_sim.py

Results: benchmarks/scheduling/results/sybil_sim.json.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenslice.config import SchedulerConfig
from tokenslice.predict.cost import load_cost_model
from tokenslice.request import EngineRequest, SamplingParams
from tokenslice.sim.engine import simulated_engine

COST = "opt-13b@a100-40gb"
ATTACKER_REQUESTS, ATTACKER_TOKENS, VICTIM_TOKENS, WARMUP_STEPS = 48, 400, 32, 30
RESULTS = Path(__file__).resolve().parent / "results" / "sybil_sim.json"


def victim_run(batch: int, tenants: bool, ids: int, guard: str) -> dict[str, Any]:
    eng = simulated_engine(SchedulerConfig(policy="vtc", max_batch_size=batch, stall_guard=guard),
                           load_cost_model(COST), kv_cache_blocks=100_000)
    eng.fast_forward = False
    for i in range(ATTACKER_REQUESTS):
        eng.add(EngineRequest(f"a{i}", [0] * 8, SamplingParams(max_tokens=ATTACKER_TOKENS, ignore_eos=True),
                              user=f"u{i % ids}", tenant="attacker" if tenants else None))
    for _ in range(WARMUP_STEPS):
        eng.step()
    victim = eng.add(EngineRequest("v", [0] * 8, SamplingParams(max_tokens=VICTIM_TOKENS, ignore_eos=True),
                                   user="victim", tenant="victim" if tenants else None))
    steps = 0
    while not victim.is_finished:
        eng.step()
        steps += 1
    m = victim.metrics
    return {"batch": batch, "keyed_by": "tenant" if tenants else "user", "attacker_ids": ids, "stall_guard": guard,
            "victim_steps": steps, "victim_latency_s": m.finish_time - m.arrival_time}


def main() -> None:
    rows = [victim_run(batch, tenants, ids, guard) for guard in ("off", "on") for batch in (2, 16)
            for tenants in (False, True) for ids in (1, 48)]
    one = {(r["batch"], r["keyed_by"], r["stall_guard"]): r["victim_latency_s"] for r in rows if r["attacker_ids"] == 1}
    print(f"{'guard':>5} {'batch':>5} {'keyed by':>8} {'ids':>3} {'steps':>6} {'latency s':>9} {'x 1 id':>6}")
    for r in rows:
        r["vs_one_id"] = r["victim_latency_s"] / one[(r["batch"], r["keyed_by"], r["stall_guard"])]
        print(f"{r['stall_guard']:>5} {r['batch']:>5} {r['keyed_by']:>8} {r['attacker_ids']:>3} {r['victim_steps']:>6} "
              f"{r['victim_latency_s']:>9.3f} {r['vs_one_id']:>6.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"cost_model": COST, "rows": rows}, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
