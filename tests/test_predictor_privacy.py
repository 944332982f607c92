"""The output-length predictor keeps prompts' embeddings and lengths, not their text (unless
asked), in files only their owner can read."""
from __future__ import annotations

import stat
from pathlib import Path

import pytest

from conftest import STORIES
from tokenslice import LLM, SamplingParams
from tokenslice.predict.length import LengthPredictor, PredictorConfig
from tokenslice.predict.regressor import RegressorConfig

CANARY = "ZEBRA-CANARY-7781"


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def _serve_canaries(path: Path, **options: object) -> tuple[dict[str, int], list[bytes]]:
    """Run prompts holding the canary through srpt-predicted; the predictor's files' modes and
    contents while the engine still runs (WAL files included) and after it closed."""
    llm = LLM(str(STORIES), policy="srpt-predicted", length_predictor=str(path), **options)
    prompts = [f"Once upon a time {CANARY} met a {w}." for w in ("cat", "dog", "bird")]
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in _files(path)}
    contents = [p.read_bytes() for p in _files(path)]
    llm.close()
    modes |= {p.name: stat.S_IMODE(p.stat().st_mode) for p in _files(path)}
    return modes, contents + [p.read_bytes() for p in _files(path)]


@pytest.fixture
def predictor_dir(tmp_path: Path) -> Path:
    path = tmp_path / "pred"
    config = PredictorConfig(min_train_records=2, retrain_every=2, regressor=RegressorConfig(hidden=16, members=1))
    with LengthPredictor.create(path, config) as p:
        p.seed(["Tell me a story.", "Name a colour.", "Write a poem.", "Count to three."], [60, 2, 40, 5],
               tune=False)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    return path


def test_no_prompt_text_and_private_files_by_default(predictor_dir: Path) -> None:
    modes, contents = _serve_canaries(predictor_dir)
    assert {"history.sqlite3", "predictor.json", "regressor.safetensors"} <= set(modes)
    assert any(name.endswith("-wal") for name in modes)  # the live database's journal was checked too
    assert all(mode == 0o600 for mode in modes.values()), modes
    assert not any(CANARY.encode() in data for data in contents)
    with LengthPredictor.load(predictor_dir, background_training=False) as p:
        assert p.num_records == 4 + 3  # the requests were still learnt from


def test_text_is_stored_only_when_asked(predictor_dir: Path) -> None:
    modes, contents = _serve_canaries(predictor_dir, length_predictor_store_text=True)
    assert all(mode == 0o600 for mode in modes.values()), modes
    assert any(CANARY.encode() in data for data in contents)


def test_store_text_flag() -> None:
    from tokenslice.cli import build_parser
    from tokenslice.cli.args import engine_config_from_args

    def config(*flags: str) -> bool:
        return engine_config_from_args(build_parser().parse_args(["serve", *flags])).scheduler.length_predictor_store_text

    assert config() is False and config("--length-predictor-store-text") is True


def test_chat_requests_reach_the_predictor_in_the_clients_words(predictor_dir: Path) -> None:
    """Behind `serve`, the embedding predictor reads a chat's message contents, as it was seeded
    (prompts), not the chat template's rendering; a completion's prompt as sent."""
    import sqlite3

    import httpx

    from serverkit import HTTP_TIMEOUT_S, start_server

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Tell {CANARY} a story."}]
    with start_server("--policy", "srpt-predicted", "--length-predictor", str(predictor_dir),
                      "--length-predictor-store-text", "--kv-cache-blocks", "64", "--max-model-len", "256") as srv:
        for route, body in (("/v1/chat/completions", {"messages": messages}),
                            ("/v1/completions", {"prompt": f"Once {CANARY} sang."})):
            r = httpx.post(srv.url(route), json={"model": srv.server.settings.served_model_name, "max_tokens": 4,
                                                 "temperature": 0, **body}, timeout=HTTP_TIMEOUT_S)
            assert r.status_code == 200, r.text
    db = sqlite3.connect(str(predictor_dir / "history.sqlite3"))
    learnt = [row[0] for row in db.execute("SELECT prompt FROM records ORDER BY id").fetchall()[4:]]
    db.close()
    assert learnt == [f"Be brief.\nTell {CANARY} a story.", f"Once {CANARY} sang."]
