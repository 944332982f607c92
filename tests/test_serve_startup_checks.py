"""What `tokenslice serve` checks before any model loads (a busy port, a model or tokenizer that
is not there, a quantized GGUF file asked to be quantized again), each a one-line error naming
the flag and exit code 2; the Hugging Face id of the known model; and the parameter count the
start-up line gives a quantized model."""
from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest

from conftest import STORIES
from test_gguf import write_gguf
from tokenslice import LLM
from tokenslice.cli import build_parser
from tokenslice.cli.serve_options import check_port_free, resolve_model_tag, server_settings
from tokenslice.config import ModelConfig
from tokenslice.model.arch import ModelLoadError
from tokenslice.model.gguf import check_requantization, gguf_arch, open_gguf
from tokenslice.model.known_models import check_tokenizer_source, known_model, resolve_model, served_model_name
from tokenslice.model.loader import load_model, parameter_count

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_HF = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_PARAMS = 134_515_008  # Hugging Face's count for SmolLM2-135M (tied embedding counted once)
# A failure deadline for a serve child that should exit at once; not a timing check.
DEADLINE_S = 120
Q = gguf.GGMLQuantizationType


@pytest.fixture
def listening() -> Iterator[tuple[str, int]]:
    """A real listening socket on 127.0.0.1, bound as uvicorn binds (SO_REUSEADDR), held open."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(*flags: str) -> subprocess.CompletedProcess[str]:
    """`tokenslice serve FLAGS` as a child in its own process group, killed with everything it
    started if it outlives the deadline (a regression would load the model and serve)."""
    proc = subprocess.Popen([sys.executable, "-m", "tokenslice.cli", "serve", "--no-compile", *flags], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    """The child's error, after checking it exited 2 before loading anything, saying it in one line."""
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "loading the model" not in proc.stderr and "engine core" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0]


def test_a_busy_port_fails_before_the_model_loads(listening: tuple[str, int]) -> None:
    host, port = listening
    line = _one_line_error(_serve("--model", "builtin:tiny", "--host", host, "--port", str(port)))
    assert f"{host}:{port}" in line and "already in use" in line and "--port" in line


def test_the_port_check_binds_nothing_it_keeps(listening: tuple[str, int]) -> None:
    host, port = listening
    with pytest.raises(ValueError, match=rf"--port {port}: {re.escape(host)}:{port} is already in use"):
        check_port_free(host, port)
    free = _free_port()
    check_port_free("127.0.0.1", free)
    with socket.socket() as s:  # the test socket is closed: a server can listen there now
        s.bind(("127.0.0.1", free))
        s.listen()
    with pytest.raises(ValueError, match=r"--host 'no-such-host\.invalid': cannot resolve it"):
        check_port_free("no-such-host.invalid", free)


def test_an_unknown_hub_id_lists_the_known_names_and_how_to_serve_a_local_copy() -> None:
    line = _one_line_error(_serve("--model", "Qwen/Qwen2.5-0.5B-Instruct", "--port", str(_free_port())))
    assert "--model 'Qwen/Qwen2.5-0.5B-Instruct'" in line and "downloads nothing" in line
    assert SMOLLM2 in line and SMOLLM2_HF in line and "builtin:tiny" in line
    assert "--local-dir DIR" in line and "--model DIR" in line and ".gguf" in line


def test_a_missing_local_path_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=rf"model '{re.escape(str(tmp_path / 'absent'))}' does not exist; "
                                             rf"pass a local Hugging Face directory, a \.gguf file or a known name"):
        LLM(str(tmp_path / "absent"))


def test_the_hub_id_of_the_known_model_serves_it_under_that_name(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_model(SMOLLM2_HF) == resolve_model(SMOLLM2) and resolve_model(SMOLLM2_HF.lower()).endswith(".gguf")
    # `vllm serve HuggingFaceTB/SmolLM2-135M-Instruct` as it is: served under the name given.
    args = build_parser().parse_args(["serve", SMOLLM2_HF])
    resolve_model_tag(args)
    settings = server_settings(args)
    assert (settings.served_model_name, settings.model_root) == (SMOLLM2_HF, SMOLLM2_HF)
    assert served_model_name(SMOLLM2.upper()) == SMOLLM2
    # A directory downloaded under that name is served from disk instead.
    monkeypatch.chdir(tmp_path)
    (tmp_path / SMOLLM2_HF).mkdir(parents=True)
    assert known_model(SMOLLM2_HF) is None and resolve_model(SMOLLM2_HF) == SMOLLM2_HF


def test_a_wrong_tokenizer_path_is_one_line_naming_the_flag(tmp_path: Path) -> None:
    missing = tmp_path / "no-tokenizer"
    line = _one_line_error(_serve("--model", str(STORIES), "--tokenizer", str(missing), "--port", str(_free_port())))
    assert f"--tokenizer '{missing}' does not exist" in line
    with pytest.raises(ModelLoadError, match=r"--tokenizer '.*' is a file"):
        check_tokenizer_source(str(STORIES / "config.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"--tokenizer '.*empty': the directory holds no tokenizer"):
        check_tokenizer_source(str(tmp_path / "empty"))
    check_tokenizer_source(str(STORIES))
    check_tokenizer_source(SMOLLM2_HF)


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantizing_the_quantized_file_again_is_refused(mode: str) -> None:
    with pytest.raises(ModelLoadError, match=rf"--quantization {mode}: SmolLM2-135M-Instruct\.Q4_1\.gguf is "
                                             r"quantized already \(Q4_1, Q8_0\).*--quantization auto"):
        load_model(ModelConfig(model=SMOLLM2, quantization=mode, device="cpu"), with_tokenizer=False)


def test_serve_refuses_requantization_before_loading() -> None:
    line = _one_line_error(_serve("--model", SMOLLM2, "--quantization", "int4", "--port", str(_free_port())))
    assert "--quantization int4" in line and "quantized already" in line and "--quantization auto" in line


def test_requantization_is_judged_by_the_linears(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Float files take int4 / int8; a quantized linear (a tied embedding is the head) refuses them;
    a quantized embedding of its own is no linear, so the mode quantizes float weights only."""
    def check(kind: str, types: dict[str, gguf.GGMLQuantizationType], mode: str = "int4") -> None:
        path = write_gguf(tiny_checkpoints[kind], tmp_path / f"{kind}-{len(types)}-{'-'.join(types)}.gguf",
                          types=types)
        check_requantization(open_gguf(path), path, mode)

    check("llama", {})
    check("llama", {"token_embd.weight": Q.Q8_0})  # untied: the head is output.weight, float
    check("llama", {"blk.0.attn_q.weight": Q.Q4_1}, "auto")
    with pytest.raises(ModelLoadError, match=r"quantized already \(Q4_1\)"):
        check("llama", {"blk.0.attn_q.weight": Q.Q4_1})
    with pytest.raises(ModelLoadError, match=r"--quantization int8: .* quantized already \(Q8_0\)"):
        check("qwen2", {"token_embd.weight": Q.Q8_0}, "int8")


def test_the_parameter_count_is_the_models_whatever_its_storage(caplog: pytest.LogCaptureFixture) -> None:
    path = Path(resolve_model(SMOLLM2))
    reader = open_gguf(path)
    assert parameter_count(gguf_arch(reader, path)) == SMOLLM2_PARAMS
    assert sum(int(t.n_elements) for t in reader.tensors) == SMOLLM2_PARAMS  # the file's tensor shapes
    # A quantized model's packed linears are buffers, not parameters: the start-up line counts them all.
    with caplog.at_level(logging.INFO, logger="tokenslice.exec.factory"), \
            LLM("builtin:tiny", quantization="int4", device="cpu", kv_cache_blocks=16) as llm:
        model = llm.engine.runner.model
        count = parameter_count(model.arch)
        assert sum(p.numel() for p in model.parameters()) < count / 2
    assert f"{count / 1e6:.0f} M parameters" in caplog.text
