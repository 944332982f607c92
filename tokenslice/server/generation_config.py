"""Sampling defaults from a model's generation_config.json, as vLLM's `--generation-config`: the
values a request leaves out (or sends as null) come from the file instead of the API's defaults.
vLLM reads the same keys: temperature, top_p, top_k, min_p, repetition_penalty, and
max_new_tokens as the default max_tokens."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tokenslice.server.protocol import SamplingFields

log = logging.getLogger("tokenslice.server")

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GENERATION_CONFIG_FILE = "generation_config.json"


def load_generation_defaults(source: str, model: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sampling defaults: `source` "auto" reads the model directory's generation_config.json (none
    for a GGUF file, a known name or builtin:tiny), "vllm" reads nothing (the API's defaults), any
    other value is a directory holding one. `overrides` (vLLM's --override-generation-config) win.
    ValueError says what is wrong with the source or an override."""
    config: dict[str, Any] = {}
    if source != "vllm":
        folder = Path(model if source == "auto" else source)
        path = folder / GENERATION_CONFIG_FILE
        if path.is_file():
            try:
                config = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"--generation-config: cannot read {path}: {e}") from None
        elif source != "auto":
            raise ValueError(f"--generation-config {source}: no {GENERATION_CONFIG_FILE} in that directory")
    unknown = sorted(set(overrides or {}) - {*SAMPLING_KEYS, "max_new_tokens"})
    if unknown:
        raise ValueError(f"--override-generation-config: unknown key {', '.join(unknown)}; "
                         f"known: {', '.join((*SAMPLING_KEYS, 'max_new_tokens'))}")
    config.update(overrides or {})
    out: dict[str, Any] = {}
    for key in (*SAMPLING_KEYS, "max_new_tokens"):
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"generation config: {key} must be a number, got {value!r}")
        out["max_tokens" if key == "max_new_tokens" else key] = int(value) if key in ("top_k", "max_new_tokens") \
            else float(value)
    if out:
        log.info("sampling defaults from the generation config: %s", ", ".join(f"{k}={v}" for k, v in out.items()))
    return out


def with_defaults(body: SamplingFields, defaults: dict[str, Any]) -> SamplingFields:
    """The request with the sampling defaults in the fields it left out. max_tokens is not among
    them: the routes apply it themselves, capped to the room left in the context."""
    missing = {k: v for k, v in defaults.items() if k != "max_tokens" and k not in body.model_fields_set}
    return body.model_copy(update=missing) if missing else body
