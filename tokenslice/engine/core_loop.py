"""The engine-core loop without its transport: between steps it applies what its shell received,
takes a step when anything is live (or an abort's final output is due), counts faults, and hands
each step's outcome to the shell. The engine-core process (engine/core.py, ZMQ) and the in-thread
driver (engine/async_engine.py, a command queue) are thin shells over it, so the loop's rules are
written once (as vLLM's EngineCore under EngineCoreProc).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenslice.engine.engine import Engine
from tokenslice.engine.protocol import MAX_CONSECUTIVE_FAULTS
from tokenslice.exec.base import WorkerError
from tokenslice.request import EngineRequest, RequestOutput

log = logging.getLogger(__name__)


@dataclass
class StepOutcome:
    outputs: list[RequestOutput] = field(default_factory=list)  # finished requests already left `live`
    failed: list[str] = field(default_factory=list)  # live requests a step fault ended (aborted in the engine)
    # Requests the engine ended before they ran, and why (not a fault: their grammar failed).
    reasons: dict[str, str] = field(default_factory=dict)
    fault: bool = False  # the step raised (`failed` may be empty: nothing was live)


class CoreLoop:
    """The only code that touches the engine, on the loop's thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.live: set[str] = set()  # requests whose client still waits for them
        # An abort's final output (and the executor's cue to forget the request) comes out of the
        # next step; when nothing else is live, the loop takes one empty step to deliver it.
        self.flush = False
        self.consecutive_faults = 0
        self.num_faults = 0

    @property
    def busy(self) -> bool:
        return self.engine.has_unfinished() or self.flush

    def run(self, receive: Callable[[bool], bool], deliver: Callable[[StepOutcome], None]) -> None:
        """The loop, over its shell's transport: `receive(block)` applies every queued command
        (waiting for one if `block`) and says whether to go on; `deliver` hands a step's outputs,
        or the requests its fault ended, to their clients. Raises WorkerError (a rank is gone)
        and RuntimeError after MAX_CONSECUTIVE_FAULTS failed steps, once those were delivered."""
        while receive(not self.busy):
            if self.busy:
                deliver(self.step())
                if self.consecutive_faults >= MAX_CONSECUTIVE_FAULTS:
                    raise RuntimeError(f"{self.consecutive_faults} engine steps failed in a row")

    # ---- commands ---------------------------------------------------------------------------
    def add(self, request: EngineRequest) -> None:
        """Raises what Engine.add raises (InvalidRequestError for a request it refuses)."""
        self.engine.add(request)
        self.live.add(request.request_id)

    def abort(self, request_ids: list[str]) -> None:
        """Abort the live ones (the others finished meanwhile)."""
        for rid in request_ids:
            if rid in self.live:
                self.live.discard(rid)
                self.engine.abort_request(rid)
                self.flush = True

    def set_priority(self, request_id: str, priority: int) -> bool:
        return self.engine.set_priority(request_id, priority)

    def state(self) -> dict[str, Any]:
        return self.engine.state()

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> StepOutcome:
        self.flush = False
        try:
            outputs = self.engine.step()
        except WorkerError:
            raise  # a rank is gone for good: no later step can run
        except Exception:
            self.num_faults += 1
            self.consecutive_faults += 1
            failed, self.live = sorted(self.live), set()
            log.exception("engine step failed; failing requests %s", ", ".join(failed) or "(none)")
            for rid in failed:
                self.engine.abort_request(rid)  # if even this fails, the loop dies and the server sees it
            return StepOutcome(failed=failed, fault=True)
        self.consecutive_faults = 0
        for out in outputs:
            if out.finished:
                self.live.discard(out.request_id)
        reasons = self.engine.take_failed()
        self.live.difference_update(reasons)
        return StepOutcome(outputs, failed=sorted(reasons), reasons=reasons)


__all__ = ["CoreLoop", "StepOutcome"]
