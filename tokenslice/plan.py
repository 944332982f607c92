"""What the scheduler hands the executor each step, and what comes back (docs/DESIGN.md, StepPlan).

Plain data so that any executor (local, distributed, simulated) can take it, plus `copy_runs`,
how the block pairs of a swap coalesce into copies (the scheduler and every executor count them).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from tokenslice.request import Request, SamplingParams, TokenLogprobs


Direction = Literal["out", "in"]  # of a KV swap. out: device -> host; in: host -> device

@dataclass
class SeqSlice:
    """One request's share of a step: compute `token_ids` at positions start_pos.., maybe sample."""

    request_id: str
    token_ids: list[int]
    start_pos: int  # tokens already in the cache before this step
    block_table: list[int]
    sample: bool  # this slice reaches the end of the known tokens: sample the next one
    params: SamplingParams
    num_output_tokens: int  # before this step; for min_tokens
    eos_token_id: int | None = None
    # Prompt logprobs to report: the log-probability of each target (the next prompt token) at
    # slice rows prompt_logprob_offset.. (positions already reported, e.g. before a recompute, are left out).
    prompt_logprob_targets: list[int] = field(default_factory=list)
    prompt_logprob_offset: int = 0
    # Prompt + output token ids so far, only for a sampling slice whose params need them
    # (penalties): the runner cannot rebuild them (earlier steps, prefix-cache hits, recompute).
    history_token_ids: list[int] = field(default_factory=list)
    # Return the hidden state of this slice's last token after layer StepPlan.hidden_layer
    # (StepResult.hidden): the length predictor's features, taken from a forward pass that runs anyway.
    capture_hidden: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)



# A token sampled by a step still in flight (async scheduling): the executor that ran that step
# puts the sampled id in its place before computing (ModelRunner.fill_pending).
PENDING_TOKEN = -1


def request_slice(req: Request, start: int, chunk: int, block_table: list[int], sample: bool,
                  pending: int = 0) -> SeqSlice:
    """`req`'s share of a step: positions start..start+chunk-1, sampling after them if `sample`
    (never for a prompt-only request, max_tokens 0). Marks the prompt logprobs it will report.
    `pending`: its output tokens sampled by a step in flight, the last of which this slice may
    compute (PENDING_TOKEN)."""
    ids = req.token_ids(start, start + chunk)
    ids += [PENDING_TOKEN] * (chunk - len(ids))
    s = SeqSlice(req.request_id, ids, start, block_table, sample and req.params.max_tokens > 0, req.params,
                 len(req.output_token_ids) + pending, req.eos_token_id)
    if req.params.prompt_logprobs is not None:
        s.prompt_logprob_offset, s.prompt_logprob_targets = req.take_prompt_logprob_targets(start, chunk)
    if s.sample and req.params.penalized:  # the runner sees only this step's tokens (and fills a pending one in)
        s.history_token_ids = req.prompt_token_ids + req.output_token_ids
    return s

@dataclass
class BlockTransfer:
    """One request's KV moving between tiers in the background, overlapping compute
    (FastServe §4.2 proactive offload/upload, FastSwitch async swap-in). The request is not
    scheduled, and its source and destination blocks are not reallocated, until the executor
    reports the request id in StepResult.transfers_done."""

    request_id: str
    direction: Direction
    pairs: list[tuple[int, int]]  # (source block, destination block), in block-table order


def copy_runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Coalesce (src, dst) block pairs into (src_start, dst_start, length) copies.

    A copy grows while both source and destination stay consecutive: that is what one
    memcpy / cudaMemcpyAsync can move (FastSwitch: fewer, larger transfers).
    """
    out: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if out:
            s, d, n = out[-1]
            if s + n == src and d + n == dst:
                out[-1] = (s, d, n + 1)
                continue
        out.append((src, dst, 1))
    return out


@dataclass
class StepPlan:
    prefill: list[SeqSlice] = field(default_factory=list)
    decode: list[SeqSlice] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    # swap_out / swap_in run before this step's compute, in that order (critical path);
    # async_transfers start now and complete in a later StepResult.transfers_done.
    async_transfers: list[BlockTransfer] = field(default_factory=list)
    drop: list[str] = field(default_factory=list)  # requests whose KV was discarded (recompute)
    finished: list[str] = field(default_factory=list)  # executor may forget per-request state
    hidden_layer: int | None = None  # the layer whose output capture_hidden slices return

    @property
    def slices(self) -> list[SeqSlice]:
        return self.decode + self.prefill

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.prefill) + len(self.decode)

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def has_work(self) -> bool:
        """Anything for an executor to do: compute, copies or drops (`finished` alone is not)."""
        return not self.is_empty or bool(self.swap_in or self.swap_out or self.async_transfers or self.drop)


@dataclass
class StepResult:
    sampled: dict[str, int] = field(default_factory=dict)  # request id -> new token
    step_seconds: float = 0.0  # the whole step, synchronous transfers and waiting included
    transfer_seconds: float = 0.0  # of step_seconds: synchronous swap copies (critical path)
    # Of step_seconds: a pipeline stage blocked on its neighbours (activations not yet there, or
    # not yet taken): a bubble, not work. The executor's merge leaves it out of step_seconds.
    wait_seconds: float = 0.0
    # Async transfers (of this or earlier plans) that completed; an empty plan with transfers
    # in flight waits for at least one, so the engine never spins.
    transfers_done: list[str] = field(default_factory=list)
    # Copy seconds of the reported transfers that were measured (request id -> seconds, queueing
    # excluded): swap statistics for the adaptive swap-in choice (FastSwitch §3.2).
    transfer_durations: dict[str, float] = field(default_factory=dict)
    # Only for slices whose params ask (SamplingParams.logprobs / prompt_logprobs): the sampled
    # token's, and the prompt positions of SeqSlice.prompt_logprob_targets.
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # Request id -> the hidden state (float32 values, plain for any transport) of its slice's last
    # token after StepPlan.hidden_layer, for the slices with capture_hidden; empty where the
    # model cannot capture (an architecture without it, a pipeline stage).
    hidden: dict[str, list[float]] = field(default_factory=dict)
    # Simulator with several plans in flight: the virtual time this result is ready (their
    # step_seconds overlap, so they cannot place it on the clock); None: ready when returned.
    done_at: float | None = None
