"""examples/grafana-dashboard.json: valid JSON whose every query names a series that a real
server's /metrics exposes (so a renamed metric cannot leave the dashboard silently empty)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest

from serverkit import start_server

DASHBOARD = Path(__file__).resolve().parents[1] / "examples" / "grafana-dashboard.json"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def test_every_query_names_an_exposed_metric() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"tokenslice:[a-z0-9_:]+", e)}
    assert len(used) >= 20
    with start_server("--no-engine-process") as srv:
        client = openai.OpenAI(base_url=srv.url("/v1"), api_key="x", max_retries=0, timeout=60)
        client.completions.create(model="builtin:tiny", prompt="hi", max_tokens=4, user="u1")  # per-user series
        with pytest.raises(openai.NotFoundError):  # and a rejection's
            client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
        exposed = {re.sub(r"\{.*\}", "", k) for k in srv.metrics()}
    missing = {n for n in used if n not in exposed and not any(n + s in exposed for s in HISTOGRAM_SUFFIXES)}
    assert not missing
    assert all(p["datasource"]["uid"] == "${DS_PROMETHEUS}" for p in dash["panels"])
