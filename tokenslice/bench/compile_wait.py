"""`tokenslice bench` waits for a server's compiled decode before loading it. On CPU `serve` builds
its compiled decode steps on a thread while it already answers (/v1/state's `compiled_decode`:
pending, then ready), on the cores the benchmark measures: a sweep begun at /health measures
eager steps slowed by the compiler (`make demo` once found every rate past the SLO). Servers that
report no compiled decode (another server, workers per rank) are not waited for. No torch here."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx

from tokenslice.bench.client_config import CONTROL_TIMEOUT_S, ClientConfig

log = logging.getLogger(__name__)

WAIT_COMPILED_TIMEOUT_S = 900.0  # cold inductor builds take minutes on a loaded 2-core machine
POLL_S = 0.5
FINAL_STATES = ("ready", "off", "failed")  # model/inductor_decode.py CompileStatus.state


@dataclass
class CompiledWait:
    """What a server said of its compiled decode, and how long bench waited for it."""

    state: str  # ready | off | failed | "not reported" (no compiled_decode) | "no state" (no /v1/state)
    waited_s: float
    detail: dict[str, Any] | None = None  # /v1/state's compiled_decode as it last read


def _read(cfg: ClientConfig, timeout_s: float) -> tuple[str, dict[str, Any] | None]:
    r = httpx.get(cfg.root + "/v1/state", headers=cfg.headers(), timeout=timeout_s)
    try:
        body = r.json() if r.status_code == 200 else None
    except ValueError:  # not JSON: not a tokenslice /v1/state
        body = None
    if not isinstance(body, dict):
        return "no state", None
    detail = body.get("compiled_decode")
    if not isinstance(detail, dict) or "state" not in detail:
        return "not reported", None
    return str(detail["state"]), detail


def wait_compiled(cfg: ClientConfig, timeout_s: float = WAIT_COMPILED_TIMEOUT_S) -> CompiledWait:
    """Poll /v1/state until compiled decode is ready, off or failed (or not reported at all).
    ValueError, naming the flags, when it is still being built after `timeout_s`."""
    start = time.monotonic()
    said = False
    while True:
        waited = time.monotonic() - start
        state, detail = _read(cfg, min(CONTROL_TIMEOUT_S, max(1.0, timeout_s - waited)))
        built = f"{detail.get('buckets_ready')} of {detail.get('buckets')} graphs built" if detail else ""
        if state != "pending":
            break
        if waited >= timeout_s:
            raise ValueError(f"{cfg.root}: compiled decode still being built after {timeout_s:g} s ({built}); "
                             "wait longer with --wait-compiled-timeout-s, or measure eager steps with "
                             "--no-wait-compiled")
        if not said:
            log.info("waiting for %s to build its compiled decode steps (%s) before loading it", cfg.root, built)
            said = True
        time.sleep(POLL_S)
    if state == "failed":
        log.warning("%s: compiled decode failed (%s); its steps run eager", cfg.root, detail and detail.get("error"))
    elif state in FINAL_STATES:
        log.info("%s: compiled decode %s%s", cfg.root, state,
                 f" after waiting {waited:.1f} s ({built})" if said else "")
    elif state == "no state":
        log.info("%s has no /v1/state: not waiting for compiled decode", cfg.root)
    else:
        log.info("%s: compiled decode %s in /v1/state: not waiting for it", cfg.root, state)
    return CompiledWait(state, waited, detail)


__all__ = ["CompiledWait", "FINAL_STATES", "WAIT_COMPILED_TIMEOUT_S", "wait_compiled"]
