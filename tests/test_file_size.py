"""docs/DESIGN.md, Layout: one concept per file, and no source file of the package over
MAX_LINES lines, so that each can be read whole."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tokenslice"
MAX_LINES = 500


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_source_file_is_over_the_limit() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert files
    over = [(path.relative_to(ROOT), n) for path in files if (n := line_count(path)) > MAX_LINES]
    if over:
        pytest.fail(f"source files over {MAX_LINES} lines (split them along their concerns):\n"
                    + "\n".join(f"{path}: {n} lines" for path, n in sorted(over, key=lambda x: -x[1])),
                    pytrace=False)
