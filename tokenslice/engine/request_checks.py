"""What the engine refuses at admission, with the parameter to name in the 400 answer."""
from __future__ import annotations

from tokenslice.kv.manager import KVManager
from tokenslice.request import InvalidRequestError
from tokenslice.sched.policy import Policy


def check_prompt(ids: list[int], max_model_len: int, vocab_size: int, kv: KVManager) -> None:
    """A prompt must leave room for one generated token, in the context and in the KV cache."""
    if not ids:
        raise InvalidRequestError("prompt is empty", "prompt")
    if len(ids) >= max_model_len:
        raise InvalidRequestError(
            f"prompt has {len(ids)} tokens; this model's context is {max_model_len} tokens, "
            f"which must also leave room for at least one generated token", "prompt")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})", "prompt")
    if kv.blocks_for_tokens(len(ids) + 1) > kv.device.num_blocks:
        raise InvalidRequestError(
            f"prompt has {len(ids)} tokens; the KV cache holds only {kv.capacity_tokens}", "prompt")


def check_priority(priority: int, policy: Policy) -> None:
    """As vLLM: a priority the policy would ignore is an error, not a silent no-op."""
    if priority != 0 and not policy.uses_priority:
        raise InvalidRequestError(
            f"priority {priority} needs a policy that schedules by priority (--policy priority); "
            f"this engine runs {policy.name!r}", "priority")


def check_delivery_rate(rate: float | None) -> None:
    """A stream's own reader pace (the stall guard's timeline) must be a positive number of tokens/s."""
    if rate is not None and not 0.0 < rate < float("inf"):
        raise InvalidRequestError(f"tokenslice.delivery_rate must be a finite number of tokens/s > 0, got {rate}",
                                  "tokenslice.delivery_rate")
