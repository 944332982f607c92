"""The config dataclasses are the one source of engine defaults: flat settings (the CLI's flags,
LLM's keywords) route to the section that has the field."""
from __future__ import annotations

from dataclasses import fields

import pytest

from tokenslice.config import DTYPES, OFFLOAD_DTYPES, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig


def test_from_options_routes_each_setting_to_its_section() -> None:
    cfg = EngineConfig.from_options(model="m", dtype="float32", block_size=8, offload_dtype="int8",
                                    max_batch_size=3, eviction_amortization=0.0, profile="p")
    assert (cfg.model.model, cfg.model.dtype) == ("m", "float32")
    assert (cfg.cache.block_size, cfg.cache.offload_dtype) == (8, "int8")
    assert (cfg.scheduler.max_batch_size, cfg.scheduler.eviction_amortization) == (3, 0.0)
    assert cfg.profile == "p"
    assert cfg.cache.swap_space_gb == CacheConfig().swap_space_gb  # untouched: the default
    assert EngineConfig.from_options() == EngineConfig()


def test_from_options_refuses_unknown_settings() -> None:
    with pytest.raises(TypeError, match="max_batch"):
        EngineConfig.from_options(max_batch=3)


def test_option_names_cover_every_section_field() -> None:
    names = set(EngineConfig.option_names())
    for cls in (ModelConfig, CacheConfig, SchedulerConfig):
        assert {f.name for f in fields(cls)} <= names


def test_enumerated_fields_are_validated() -> None:
    assert ModelConfig.dtype in DTYPES and CacheConfig.offload_dtype in OFFLOAD_DTYPES
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig.from_options(dtype="fp8").validate()
    with pytest.raises(ValueError, match="offload_dtype"):
        EngineConfig.from_options(offload_dtype="fp8").validate()
    with pytest.raises(ValueError, match="preemption"):
        EngineConfig.from_options(preemption="swap").validate()


def test_llm_refuses_unknown_keywords_before_loading() -> None:
    from tokenslice.llm import LLM

    with pytest.raises(TypeError, match="max_batch"):
        LLM("/nonexistent/model-dir", max_batch=3)


def test_cli_engine_flags_default_to_the_config() -> None:
    from tokenslice.cli import build_parser
    from tokenslice.cli.args import engine_config_from_args

    for cmd in (["serve"], ["generate", "--prompt", "x"]):
        assert engine_config_from_args(build_parser().parse_args(cmd)) == EngineConfig()
    args = build_parser().parse_args(["serve", "--max-batch-size", "3", "--offload-dtype", "int8",
                                      "--mlfq-num-queues", "4", "--dtype", "float32"])
    cfg = engine_config_from_args(args)
    assert (cfg.scheduler.max_batch_size, cfg.cache.offload_dtype) == (3, "int8")
    assert (cfg.scheduler.mlfq_num_queues, cfg.model.dtype) == (4, "float32")


def test_cli_help_shows_defaults_but_not_the_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenslice.cli import build_parser

    monkeypatch.setenv("TOKENSLICE_API_KEY", "not-for-help")
    parser = build_parser()
    for cmd in ("serve", "bench"):
        sub = parser._subparsers._group_actions[0].choices[cmd]  # type: ignore[union-attr]
        text = sub.format_help()
        assert "not-for-help" not in text
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    assert f"(default: {SchedulerConfig.eviction_amortization})" in " ".join(serve.format_help().split())
