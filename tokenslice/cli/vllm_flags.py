"""vLLM's `serve` flags that have no tokenslice setting of their own, so a `vllm serve` command line
runs here as it is or fails saying why: flags accepted because what they ask for is what
tokenslice does anyway (noted in the log), flags accepted with the one value that means
something here, and flags refused with the reason. vLLM's flags that do have a meaning here are
aliases of tokenslice's own (cli/args.py, cli/serve_options.py)."""
from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("tokenslice.cli")

# Accepted as they are: (flag, takes a value, why it changes nothing here).
ACCEPTED = (
    ("--trust-remote-code", False, "tokenslice runs its own model code only; nothing from the checkpoint is executed"),
    ("--disable-log-stats", False, "tokenslice logs no periodic stats lines (the numbers are on /metrics)"),
    ("--enable-log-requests", False, "one line per request is logged by default (--disable-log-requests turns it off)"),
    ("--enable-tokenizer-info-endpoint", False, "/tokenizer_info is always served (behind --api-key when one is set)"),
    ("--enable-chunked-prefill", False, "prefill is always chunked to --max-num-batched-tokens tokens per step"),
    ("--max-log-len", True, "prompts are never logged"),
)

# Accepted with these values only: (flag, values, why).
ONLY_VALUES = (
    ("--kv-cache-dtype", ("auto",), "device KV is kept in the model's dtype (--dtype); host KV can be int8 "
                                    "(--offload-dtype int8)"),
    ("--load-format", ("auto", "safetensors", "gguf"), "weights load from safetensors files or a GGUF file, "
                                                       "as --model is"),
    ("--tokenizer-mode", ("auto", "hf"), "the model's Hugging Face tokenizer is used"),
    ("--api-server-count", ("1",), "one API server process (the engine core runs in a process of its own)"),
    ("--response-role", ("assistant",), "chat replies always have the role assistant"),
    ("--chat-template-content-format", ("auto", "string"),
     "the text parts of a message are joined into one string for the template"),
)

_NO_DOWNLOAD = "nothing is downloaded: --model is a local directory, a .gguf file or a known name"
_NO_CODE = "the server loads no code by name"
# Refused: (flags, why).
REFUSED = (
    (("--revision", "--code-revision", "--tokenizer-revision", "--download-dir", "--hf-token"), _NO_DOWNLOAD),
    (("--hf-overrides",), "the checkpoint's config is used as it is"),
    (("--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank", "--max-cpu-loras"),
     "no LoRA adapters; serve merged weights"),
    (("--speculative-config", "--speculative-model", "--num-speculative-tokens"), "no speculative decoding"),
    (("--enable-auto-tool-choice", "--tool-call-parser", "--tool-parser-plugin"),
     "no tool calling (requests with tools get 400)"),
    (("--reasoning-parser",), "no reasoning parser: the text comes back as generated"),
    (("--guided-decoding-backend", "--structured-outputs-config"), "no structured outputs (guided decoding)"),
    (("--limit-mm-per-prompt", "--mm-processor-kwargs"), "text-only models"),
    (("--cpu-offload-gb",), "weights stay in device memory (KV can move to host: --preemption reactive-swap)"),
    (("--enable-expert-parallel",), "no mixture-of-experts models"),
    (("--middleware", "--worker-cls", "--worker-extension-cls"), _NO_CODE),
    (("--enable-sleep-mode",), "the engine has no sleep mode"),
    (("--enable-prompt-tokens-details",), "usage reports no cached-token details"),
    (("--no-enable-chunked-prefill",), "prefill is always chunked to --max-num-batched-tokens tokens per step"),
    (("--preemption-mode",), "use --preemption (recompute, reactive-swap, proactive-swap or defer)"),
)


class EnforceEager(argparse.Action):
    """vLLM's --enforce-eager: no compiled decode steps and no CUDA graphs (--no-compile --no-cuda-graphs)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        namespace.compile = False
        namespace.cuda_graphs = False


class _Accepted(argparse.Action):
    """Takes the flag (and its value) and keeps why it changes nothing, for the log."""

    def __init__(self, option_strings: Sequence[str], dest: str, why: str = "",
                 values: tuple[str, ...] | None = None, **kwargs: Any) -> None:
        self.why = why
        self.allowed = values
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if self.allowed is not None and values not in self.allowed:
            parser.error(f"{option_string} {values}: only {' or '.join(self.allowed)} is possible here: {self.why}")
        notes = list(getattr(namespace, "vllm_notes", []))
        notes.append(f"{option_string}: {self.why}")
        namespace.vllm_notes = notes


class _Refused(argparse.Action):
    """Fails the command line with the reason (whatever values follow the flag)."""

    def __init__(self, option_strings: Sequence[str], dest: str, why: str = "", **kwargs: Any) -> None:
        self.why = why
        super().__init__(option_strings, dest, nargs="*", default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string} is not supported by tokenslice: {self.why}")


def add_vllm_compat_flags(p: argparse.ArgumentParser) -> None:
    """The flags above, in a help group of their own."""
    g = p.add_argument_group("vLLM flags without a tokenslice setting",
                             "accepted where they ask for what tokenslice does anyway, refused with the reason "
                             "otherwise")
    for flag, takes_value, why in ACCEPTED:
        g.add_argument(flag, action=_Accepted, why=why, nargs=None if takes_value else 0,
                       help=f"accepted: {why}")
    for flag, values, why in ONLY_VALUES:
        g.add_argument(flag, action=_Accepted, why=why, values=values, metavar="|".join(values),
                       help=f"accepted as {' or '.join(values)}: {why}")
    for flags, why in REFUSED:
        for flag in flags:
            g.add_argument(flag, action=_Refused, why=why, help=argparse.SUPPRESS)


def log_vllm_notes(a: argparse.Namespace) -> None:
    """One log line per accepted vLLM flag that changes nothing here."""
    for note in getattr(a, "vllm_notes", []):
        log.info("vLLM flag %s", note)
