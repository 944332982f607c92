"""`tokenslice serve` as a drop-in for `vllm serve`: a vLLM command line (positional model, vLLM's
flag names, --chat-template, several served names) runs as a real process and serves chat through
the given template to the real `openai` client; vLLM's flags without a meaning here are refused
with the reason; nulls mean the default; /tokenizer_info, stop_reason, 404 for an unknown model,
/v1/models' fields and the `vllm:` metrics are as vLLM has them."""
from __future__ import annotations

import json
import logging
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from serverkit import RunningServer, start_server, stop_child, wait_healthy, wait_idle
from tokenslice.cli import build_parser
from tokenslice.cli.args import engine_config_from_args
from tokenslice.cli.serve import serve_engine_config
from tokenslice.cli.serve_options import resolve_model_tag, server_settings

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT.parent / "shared" / "models" / "stories260k"
# A chat template for a model that has none (stories260k): each message on a line of its own.
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]
PROMPT = "Once upon a time"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parse(*argv: str):  # noqa: ANN202 - argparse.Namespace
    a = build_parser().parse_args(["serve", *argv])
    resolve_model_tag(a)
    return a


# ---------------------------------------------------------------- the command line

def test_vllm_flag_names_set_tokenslice_settings() -> None:
    a = _parse(str(STORIES), "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
               "--num-gpu-blocks-override", "40", "--gpu-memory-utilization", "0.3", "--enforce-eager",
               "--scheduling-policy", "priority", "--distributed-executor-backend", "uni", "--swap-space", "2",
               "--dtype", "half", "-q", "none", "--served-model-name", "a", "b", "--trust-remote-code",
               "--disable-log-stats", "--kv-cache-dtype", "auto", "--max-logprobs", "5", "--disable-log-requests")
    c = serve_engine_config(a)
    assert c.model.model == str(STORIES) and c.model.dtype == "float16" and c.model.quantization == "none"
    assert (c.scheduler.max_batch_size, c.scheduler.max_tokens_per_step, c.scheduler.policy) == (4, 256, "priority")
    assert (c.cache.kv_cache_blocks, c.cache.kv_memory_fraction, c.cache.swap_space_gb) == (40, 0.3, 2.0)
    assert c.parallel.executor == "uni"
    assert c.model.compile is False and c.model.cuda_graphs is False  # --enforce-eager
    s = server_settings(a)
    assert s.model_names == ("a", "b") and s.model_root == str(STORIES)
    assert s.max_logprobs == 5 and not s.log_requests
    # Without --enforce-eager, serve compiles decode (its own default).
    assert serve_engine_config(_parse(str(STORIES))).model.compile is True
    assert engine_config_from_args(_parse("--model", str(STORIES))).model.model == str(STORIES)


def test_positional_model_and_model_flag_must_agree() -> None:
    assert _parse(str(STORIES), "--model", str(STORIES)).model == str(STORIES)
    with pytest.raises(ValueError, match="given twice"):
        _parse(str(STORIES), "--model", "builtin:tiny-other")


@pytest.mark.parametrize("argv, why", [
    (["--enable-lora"], "no LoRA"),
    (["--lora-modules", "a=b", "c=d"], "no LoRA"),
    (["--speculative-config", "{}"], "speculative"),
    (["--download-dir", "/tmp"], "nothing is downloaded"),
    (["--no-enable-chunked-prefill"], "always chunked"),
    (["--kv-cache-dtype", "fp8"], "only auto is possible here"),
    (["--api-server-count", "2"], "one API server process"),
])
def test_vllm_flags_without_a_meaning_here_fail_saying_why(argv: list[str], why: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "builtin:tiny", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert argv[0] in err and why in err, err


def test_a_chat_template_that_is_no_file_nor_template_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="looks like a file name"):
        server_settings(_parse("builtin:tiny", "--chat-template", str(tmp_path / "missing.jinja")))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        server_settings(_parse("builtin:tiny", "--chat-template", "{% for %}"))
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert server_settings(_parse("builtin:tiny", "--chat-template", str(path))).chat_template == TEMPLATE
    assert server_settings(_parse("builtin:tiny", "--chat-template", TEMPLATE)).chat_template == TEMPLATE


def test_vllm_style_command_line_serves_chat_through_the_template(tmp_path: Path) -> None:
    """The issue's check: `tokenslice serve MODEL` with vLLM's flags, as a real process."""
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    port = _free_port()
    cmd = [sys.executable, "-m", "tokenslice.cli", "serve", str(STORIES), "--port", str(port),
           "--max-num-seqs", "4", "--max-num-batched-tokens", "256", "--gpu-memory-utilization", "0.05",
           "--enforce-eager", "--chat-template", str(template), "--served-model-name", "a", "b",
           "--trust-remote-code", "--disable-log-stats"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base, 240)
        c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        cards = c.models.list().data
        assert [m.id for m in cards] == ["a", "b"]
        assert all(m.model_extra["root"] == str(STORIES) and m.model_extra["max_model_len"] == 512 for m in cards)
        r = c.chat.completions.create(model="b", messages=MESSAGES, max_tokens=8, temperature=0)
        assert r.model == "a" and r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
        # The prompt is the template's rendering, tokenized as the model's tokenizer does.
        tok = AutoTokenizer.from_pretrained(STORIES)
        text = tok.apply_chat_template(MESSAGES, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)
        assert text == "user: Tell me a story about a cat.\nassistant:"
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert r.usage.prompt_tokens == len(ids)
        assert httpx.post(base + "/tokenize", json={"model": "a", "messages": MESSAGES}).json()["tokens"] == ids
        # The aliases reached the engine: vLLM's cache info carries --gpu-memory-utilization.
        metrics = httpx.get(base + "/metrics").text
        assert re.search(r'vllm:cache_config_info\{[^}]*gpu_memory_utilization="0.05"', metrics), metrics[-2000:]
    finally:
        out = stop_child(proc)
    assert "vLLM flag --trust-remote-code" in out and "vLLM flag --disable-log-stats" in out, out[-3000:]
    assert proc.returncode in (0, -signal.SIGTERM), out[-2000:]


# ---------------------------------------------------------------- the API

@pytest.fixture(scope="module")
def srv() -> Iterator[RunningServer]:
    with start_server("--model", str(STORIES), "--kv-cache-blocks", "128", "--served-model-name", "s", "t",
                      "--chat-template", TEMPLATE, "--override-generation-config",
                      '{"temperature": 0, "max_new_tokens": 7}', "--max-logprobs", "3",
                      "--return-tokens-as-token-ids", "--allowed-origins", '["http://example.test"]',
                      "--disable-log-requests") as s:
        yield s


@pytest.fixture(scope="module")
def client(srv: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0, timeout=120)


NULLS = {"n": None, "presence_penalty": None, "frequency_penalty": None, "stream": None, "min_tokens": None,
         "ignore_eos": None, "priority": None, "temperature": None, "top_p": None, "seed": None, "stop": None,
         "stream_options": None, "logit_bias": None, "user": None, "max_tokens": None}


def test_nulls_mean_the_default(srv: RunningServer) -> None:
    plain = httpx.post(srv.url("/v1/completions"), json={"prompt": PROMPT}, timeout=120).json()
    nulls = httpx.post(srv.url("/v1/completions"), json={"prompt": PROMPT, "echo": None, "best_of": None,
                                                          "logprobs": None, "prompt_logprobs": None, **NULLS},
                       timeout=120)
    assert nulls.status_code == 200, nulls.text
    assert nulls.json()["choices"][0]["text"] == plain["choices"][0]["text"]
    chat = httpx.post(srv.url("/v1/chat/completions"), timeout=120, json={
        "messages": MESSAGES, "logprobs": None, "top_logprobs": None, "max_completion_tokens": None,
        "add_generation_prompt": None, **NULLS})
    assert chat.status_code == 200, chat.text
    # A required field is still required.
    r = httpx.post(srv.url("/v1/completions"), json={"prompt": None}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_generation_config_defaults_fill_what_requests_leave_out(client: openai.OpenAI) -> None:
    # --override-generation-config: temperature 0 (greedy whatever the seed) and 7 tokens by default.
    a = client.completions.create(model="s", prompt=PROMPT, seed=1)
    b = client.completions.create(model="s", prompt=PROMPT, seed=2)
    assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens == 7
    assert client.completions.create(model="s", prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3


def test_unknown_model_is_404_model_not_found(srv: RunningServer, client: openai.OpenAI) -> None:
    for call in (lambda: client.completions.create(model="nope", prompt=PROMPT, max_tokens=2),
                 lambda: client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2),
                 lambda: client.models.retrieve("nope")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "model_not_found" and e.value.body["type"] == "invalid_request_error"
    r = httpx.post(srv.url("/tokenize"), json={"model": "nope", "prompt": PROMPT})
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    # Every served name is accepted; responses carry the first.
    assert client.completions.create(model="t", prompt=PROMPT, max_tokens=2).model == "s"


def test_models_are_listed_as_vllm_lists_them(srv: RunningServer) -> None:
    data = httpx.get(srv.url("/v1/models")).json()["data"]
    assert [m["id"] for m in data] == ["s", "t"]
    for m in data:
        assert m["root"] == str(STORIES) and m["parent"] is None and m["max_model_len"] == 512
        [perm] = m["permission"]
        assert perm["object"] == "model_permission" and perm["allow_sampling"] and perm["organization"] == "*"


def test_tokenizer_info(srv: RunningServer) -> None:
    info = httpx.get(srv.url("/tokenizer_info")).json()
    assert info["tokenizer_class"] and info["chat_template"] == TEMPLATE
    assert (info["bos_token"], info["eos_token"], info["model_max_length"]) == ("<s>", "</s>", 512)
    assert not any(str(STORIES) in json.dumps(v) for v in info.values())  # no file paths


def test_stop_reason(client: openai.OpenAI, srv: RunningServer) -> None:
    greedy = client.completions.create(model="s", prompt=PROMPT, max_tokens=12).choices[0]
    assert greedy.finish_reason == "length" and greedy.model_extra["stop_reason"] is None
    word = greedy.text.split()[2]  # a word the greedy text has
    by_string = client.completions.create(model="s", prompt=PROMPT, max_tokens=12, stop=["zzz", word]).choices[0]
    assert by_string.finish_reason == "stop" and by_string.model_extra["stop_reason"] == word
    assert greedy.text.startswith(by_string.text) and word not in by_string.text
    # The generated ids, as --return-tokens-as-token-ids names them in logprobs.
    ids = client.completions.create(model="s", prompt=PROMPT, max_tokens=12, logprobs=0).choices[0].logprobs.tokens
    third = int(ids[2].removeprefix("token_id:"))
    by_token = client.completions.create(model="s", prompt=PROMPT, max_tokens=12,
                                         extra_body={"stop_token_ids": [third]}).choices[0]
    assert by_token.finish_reason == "stop" and by_token.model_extra["stop_reason"] == third
    chat = client.chat.completions.create(model="s", messages=MESSAGES, max_tokens=12).choices[0]
    words = chat.message.content.split()
    chat_word = words[min(1, len(words) - 1)]
    stopped = client.chat.completions.create(model="s", messages=MESSAGES, max_tokens=12, stop=[chat_word]).choices[0]
    assert stopped.finish_reason == "stop" and stopped.model_extra["stop_reason"] == chat_word
    # Streamed: the chunk that carries the finish reason carries the stop reason.
    for stream in (client.completions.create(model="s", prompt=PROMPT, max_tokens=12, stop=[word], stream=True),
                   client.chat.completions.create(model="s", messages=MESSAGES, max_tokens=12, stop=[chat_word],
                                                  stream=True)):
        last = [ch for ch in stream if ch.choices and ch.choices[0].finish_reason][-1].choices[0]
        assert last.finish_reason == "stop" and last.model_extra["stop_reason"] in (word, chat_word)


def test_logprob_limit_and_token_ids(client: openai.OpenAI) -> None:
    r = client.completions.create(model="s", prompt=PROMPT, max_tokens=2, logprobs=3)
    assert all(re.fullmatch(r"token_id:\d+", t) for t in r.choices[0].logprobs.tokens)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="s", prompt=PROMPT, max_tokens=2, logprobs=4)
    assert e.value.body["param"] == "logprobs" and "--max-logprobs" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="s", messages=MESSAGES, max_tokens=2, logprobs=True, top_logprobs=4)


def test_cors_for_the_allowed_origin(srv: RunningServer) -> None:
    headers = {"Origin": "http://example.test", "Access-Control-Request-Method": "POST"}
    r = httpx.options(srv.url("/v1/completions"), headers=headers)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://example.test"
    other = httpx.options(srv.url("/v1/completions"), headers={**headers, "Origin": "http://elsewhere.test"})
    assert "access-control-allow-origin" not in other.headers


def test_requests_are_not_logged_but_failures_are(client: openai.OpenAI, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tokenslice.server"):
        ok = client.completions.create(model="s", prompt=PROMPT, max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "tokenslice.server"]
    assert not any(ok.id in line for line in lines)
    assert any("status=404" in line for line in lines), lines


def test_vllm_metrics(srv: RunningServer, client: openai.OpenAI) -> None:
    client.completions.create(model="s", prompt=PROMPT, max_tokens=5)
    stream = client.completions.create(model="s", prompt=[PROMPT, "The cat"], max_tokens=6, stream=True)
    assert sum(1 for _ in stream) > 0
    m = wait_idle(srv)
    label = '{engine="0",model_name="s"}'
    for name in ("prompt_tokens_total", "generation_tokens_total"):
        assert m[f"vllm:{name}{label}"] == m[f"tokenslice:{name}"] > 0
    finished = m["vllm:request_success_total"]
    assert finished == m["tokenslice:request_success_total"] >= 3
    for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert m[f"vllm:{name}_count{label}"] == finished, name
    assert m[f"vllm:request_prompt_tokens_sum{label}"] == m[f"vllm:prompt_tokens_total{label}"]
    assert m[f"vllm:request_generation_tokens_sum{label}"] == m[f"vllm:generation_tokens_total{label}"]
    # Each decode token after a request's first has its gap, under both of vLLM's names.
    tpot = m[f"vllm:time_per_output_token_seconds_count{label}"]
    assert tpot == m[f"vllm:inter_token_latency_seconds_count{label}"] == m[f"vllm:generation_tokens_total{label}"] \
        - finished
    # Every token processed belongs to one engine step.
    assert m[f"vllm:iteration_tokens_total_sum{label}"] == (m[f"vllm:prompt_tokens_total{label}"]
                                                           + m[f"vllm:generation_tokens_total{label}"])
    assert 0 < m[f"vllm:iteration_tokens_total_count{label}"] <= m[f"vllm:generation_tokens_total{label}"]
    for gauge in ("num_requests_running", "num_requests_waiting", "gpu_cache_usage_perc", "kv_cache_usage_perc"):
        assert m[f"vllm:{gauge}{label}"] == 0.0, gauge
    info = [k for k in m if k.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and 'num_gpu_blocks="128"' in info[0] and 'block_size="16"' in info[0]
