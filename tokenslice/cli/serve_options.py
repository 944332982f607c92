"""`serve`'s API-server options named as vLLM names them (a `vllm serve` command line works here):
the model as a positional argument, several served names, the chat template, the generation
config's sampling defaults, logprob and logging limits, CORS, the root path, TLS, and the
ServerSettings and uvicorn options they make."""
from __future__ import annotations

import argparse
import errno
import json
import socket
from typing import Any

from tokenslice.config import ModelConfig
from tokenslice.model.known_models import served_model_name
from tokenslice.server.settings import MAX_LOGPROBS, ServerSettings

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _json_list(text: str) -> list[str]:
    """vLLM's list flags take JSON (`--allowed-origins '["http://a"]'`); a bare value is one entry."""
    try:
        value = json.loads(text)
    except ValueError:
        return [text]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _max_logprobs(text: str) -> int:
    n = int(text)
    if not 0 <= n <= MAX_LOGPROBS:
        raise argparse.ArgumentTypeError(f"must be in [0, {MAX_LOGPROBS}]: the engine computes at most "
                                         f"{MAX_LOGPROBS} alternatives per token")
    return n


def add_server_options(s: argparse.ArgumentParser) -> None:
    """The options above (serve's own: --host, --port, --api-key, ... are in cli/serve.py)."""
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as in `vllm serve MODEL` (same as --model)")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names clients may send as `model`; responses carry the first (default: --model; "
                        "a known name in its canonical spelling, a GGUF file's stem)")
    s.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="Jinja chat template (a file, or the template itself) used instead of the model's; "
                        "lets models without one serve chat")
    s.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults for what requests leave out: auto = the model's "
                        "generation_config.json, vllm = none (the API's defaults), or a directory holding one")
    s.add_argument("--override-generation-config", type=_json_object, default=None, metavar="JSON",
                   help='sampling defaults over the generation config\'s, e.g. \'{"temperature": 0.5}\'')
    s.add_argument("--max-logprobs", type=_max_logprobs, default=MAX_LOGPROBS,
                   help="most logprob alternatives a request may ask for")
    s.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='logprobs name each token "token_id:<id>" instead of its text')
    s.add_argument("--disable-log-requests", action="store_true",
                   help="no log line per request (failed requests are still logged)")
    s.add_argument("--uvicorn-log-level", default=None, choices=UVICORN_LOG_LEVELS,
                   help="uvicorn's own log level (default: --log-level)")
    s.add_argument("--allowed-origins", type=_json_list, default=None, metavar="JSON",
                   help='answer CORS requests from these origins, e.g. \'["*"]\' (default: no CORS headers)')
    s.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON",
                   help="with --allowed-origins: the methods allowed")
    s.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON",
                   help="with --allowed-origins: the headers allowed")
    s.add_argument("--allow-credentials", action="store_true", help="with --allowed-origins: allow credentials")
    s.add_argument("--root-path", default=None, help="path prefix a proxy serves the API under")
    s.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this key (and --ssl-certfile)")
    s.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate")
    s.add_argument("--disable-frontend-multiprocessing", dest="engine_process", action="store_false",
                   help="vLLM's name for --no-engine-process")


def resolve_model_tag(a: argparse.Namespace) -> None:
    """`serve MODEL` as `serve --model MODEL`; both at once must agree."""
    tag = getattr(a, "model_tag", None)
    if tag is None:
        return
    if a.model not in (ModelConfig.model, tag):
        raise ValueError(f"the model is given twice: {tag!r} and --model {a.model!r}")
    a.model = tag
    a.model_tag = None


def server_settings(a: argparse.Namespace) -> ServerSettings:
    """ServerSettings from the serve flags (after resolve_model_tag)."""
    from tokenslice.server.generation_config import load_generation_defaults
    from tokenslice.server.prompts import load_chat_template

    if a.max_waiting < 1:
        raise ValueError(f"--max-waiting must be >= 1, got {a.max_waiting}")
    if a.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {a.max_body_bytes}")
    if a.max_prompts_per_request < 1:
        raise ValueError(f"--max-prompts-per-request must be >= 1, got {a.max_prompts_per_request}")
    if not a.request_read_timeout_s > 0:
        raise ValueError(f"--request-read-timeout-s must be > 0, got {a.request_read_timeout_s}")
    if a.max_connections_per_client < 0:
        raise ValueError(f"--max-connections-per-client must be >= 0 (0: no bound), got {a.max_connections_per_client}")
    names = list(dict.fromkeys(a.served_model_name or [served_model_name(a.model)]))
    return ServerSettings(
        served_model_name=names[0], other_model_names=tuple(names[1:]), model_root=a.model,
        api_key=a.api_key or None, max_waiting=a.max_waiting, max_body_bytes=a.max_body_bytes,
        max_prompts_per_request=a.max_prompts_per_request, request_read_timeout_s=a.request_read_timeout_s,
        max_connections_per_client=a.max_connections_per_client,
        engine_process=a.engine_process, chat_template=load_chat_template(a.chat_template),
        default_sampling=load_generation_defaults(a.generation_config, a.model, a.override_generation_config),
        max_logprobs=a.max_logprobs, return_tokens_as_token_ids=a.return_tokens_as_token_ids,
        log_requests=not a.disable_log_requests, allowed_origins=tuple(a.allowed_origins or ()),
        allowed_methods=tuple(a.allowed_methods), allowed_headers=tuple(a.allowed_headers),
        allow_credentials=a.allow_credentials)


def uvicorn_options(a: argparse.Namespace) -> dict[str, Any]:
    """uvicorn.Config's keywords for the serve flags."""
    if (a.ssl_keyfile is None) != (a.ssl_certfile is None):
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    from tokenslice.server.connections import ConnectionLimits, guarded_http_protocol

    out: dict[str, Any] = {"host": a.host, "port": a.port, "log_level": a.uvicorn_log_level or a.log_level.lower(),
                           "http": guarded_http_protocol(ConnectionLimits(a.request_read_timeout_s,
                                                                          a.max_connections_per_client))}
    if a.root_path:
        out["root_path"] = a.root_path
    if a.ssl_keyfile:
        out.update(ssl_keyfile=a.ssl_keyfile, ssl_certfile=a.ssl_certfile)
    return out


def check_port_free(host: str, port: int) -> None:
    """Bind a test socket on every address uvicorn will listen on (asyncio's create_server: each
    address `host` resolves to, SO_REUSEADDR, IPv6 sockets v6-only) and close it, so that a busy
    port fails before the model loads instead of after. ValueError names the host and port."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: cannot resolve it ({e.strerror})") from None
    bound, absent = 0, None
    for family, kind, proto, _, address in dict.fromkeys(infos):
        shown = f"[{address[0]}]:{port}" if family == socket.AF_INET6 else f"{address[0]}:{port}"
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRNOTAVAIL:  # asyncio skips such an address (its family is not enabled)
                    absent = shown
                    continue
                if e.errno == errno.EADDRINUSE:
                    raise ValueError(f"--port {port}: {shown} is already in use (another server listens there); "
                                     f"stop it or choose another --port") from None
                raise ValueError(f"--host {host} --port {port}: cannot listen on {shown}: {e.strerror}") from None
        bound += 1
    if not bound and absent is not None:
        raise ValueError(f"--host {host}: cannot listen on {absent}: not an address of this machine")
