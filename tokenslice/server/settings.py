"""The server's own settings (the engine's are in tokenslice/config.py); `serve` flags are their
kebab-case field names. Imports nothing heavy, so the CLI can read the defaults cheaply."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenslice.request import MAX_LOGPROBS


@dataclass
class ServerSettings:
    served_model_name: str  # the name responses carry (vLLM: the first of --served-model-name)
    other_model_names: tuple[str, ...] = ()  # further names requests may use (listed in /v1/models)
    model_root: str | None = None  # /v1/models' `root`: the --model value, as vLLM reports it
    chat_template: str | None = None  # Jinja text used instead of the tokenizer's own (--chat-template)
    # Sampling defaults for fields a request leaves out (--generation-config): temperature, top_p,
    # top_k, min_p, repetition_penalty, and max_tokens from max_new_tokens.
    default_sampling: dict[str, Any] = field(default_factory=dict)
    max_logprobs: int = MAX_LOGPROBS  # most alternatives a request may ask for (--max-logprobs)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>"
    log_requests: bool = True  # one log line per request (errors are always logged)
    # CORS (--allowed-origins ...): none unless origins are given.
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    cache_config_info: dict[str, str] = field(default_factory=dict)  # labels of vllm:cache_config_info
    api_key: str | None = None
    api_keys: str | None = None  # --api-keys FILE: tenants and their keys (server/identity.py)
    metrics_require_key: bool = False  # /metrics needs an admin key (or the single --api-key)
    max_waiting: int = 1024  # requests admitted but without a first token; more get 429
    max_body_bytes: int = 4 * 1024 * 1024
    # Prompts one completions request may carry (a list of prompts); more get 400 before any is
    # tokenized. As vLLM's default batch bound (max_num_seqs 256): one request fills a batch, no more.
    max_prompts_per_request: int = 256
    # Seconds a client may take to send a request's headers (from connecting, or from the
    # previous answer) and, separately, its body; slower connections are closed (408 for a body).
    request_read_timeout_s: float = 30.0
    # Open connections per client address; more are answered 503 and closed (0: no bound).
    max_connections_per_client: int = 1024
    retry_after_s: int = 1
    # Run the engine in a process of its own (engine/core.py), so HTTP work never holds its
    # interpreter lock; off: on a thread of the server process (AsyncEngine).
    engine_process: bool = True

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request may send, the one responses carry first."""
        return (self.served_model_name, *self.other_model_names)
