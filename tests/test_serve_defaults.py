"""What `serve` runs when a user gives no scheduling flags: the default policy with the stall
guard, and srpt-predicted learning a length head for a model the package has none for."""
from __future__ import annotations

import httpx

from serverkit import HTTP_TIMEOUT_S, start_server, until

from tokenslice.config import SchedulerConfig

DEFAULT_POLICY = "fcfs"


def _state(srv) -> dict:
    r = httpx.get(srv.url("/v1/state"), timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def _complete(srv, n: int) -> None:
    for i in range(n):
        r = httpx.post(srv.url("/v1/completions"), timeout=HTTP_TIMEOUT_S,
                       json={"model": srv.server.settings.served_model_name, "prompt": f"Once {i}",
                             "max_tokens": 3 + i, "temperature": 0})
        assert r.status_code == 200, r.text


def test_serve_with_no_policy_flag_runs_the_default_policy_with_the_stall_guard() -> None:
    assert SchedulerConfig().policy == DEFAULT_POLICY
    with start_server() as srv:
        state = _state(srv)
        assert state["policy"] == DEFAULT_POLICY
        assert state["stall_guard"] == {"mode": "on", "max_stall_ms": None}


def test_srpt_predicted_on_a_model_with_no_head_serves_and_learns() -> None:
    with start_server("--policy", "srpt-predicted") as srv:
        before = _state(srv)["length_predictor"]
        assert before["kind"] == "self" and before["min_answers"] == 64
        _complete(srv, 3)
        # /v1/state is the latest of the core's periodic snapshots: the next one shows them.
        until(lambda: _state(srv)["length_predictor"]["answers"] == before["answers"] + 3)
        after = _state(srv)["length_predictor"]
        if not after["ready"]:
            assert _state(srv)["queues"]["warmup_for"] == "srpt-predicted"
