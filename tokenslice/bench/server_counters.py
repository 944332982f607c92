"""A server's Prometheus /metrics as the benchmark client reads it (docs/DESIGN.md, "Metrics").

`/metrics` is scraped before and after a run; the difference of every counter (and histogram
`_sum` / `_count`) with the given prefix is kept, whatever the server exposes. Between runs,
`wait_idle` reads the gauges until the server has no live request. No torch here.
"""
from __future__ import annotations

import re
import time
from collections.abc import Mapping

import httpx

from tokenslice.bench.client_config import CONTROL_TIMEOUT_S, ClientConfig
from tokenslice.bench.metrics import COUNTER_KEYS

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_counters(text: str, prefix: str) -> dict[str, float]:
    """Counters (`*_total`) and histogram `_sum` / `_count` samples whose name starts with
    `prefix`, summed over labels; also `name{labels}` for labelled samples. Gauges and
    `_created` timestamps are left out: only what accumulates can be differenced."""
    kinds: dict[str, str] = {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            kinds[name] = kind.strip()
            continue
        m = _SAMPLE.match(line)
        if not m or not m.group(1).startswith(prefix):
            continue
        name, labels, value = m.groups()
        family = next((name[:-len(s)] for s in ("_total", "_sum", "_count") if name.endswith(s)), None)
        # Exposition formats differ on whether the TYPE line names the family or the sample.
        if family is None or (kinds.get(family) or kinds.get(name)) not in ("counter", "histogram", "summary"):
            continue
        try:
            v = float(value)
        except ValueError:
            continue
        if labels:
            out[name + labels] = v
        out[name] = out.get(name, 0.0) + v
    return out


async def scrape_counters(http: httpx.AsyncClient, cfg: ClientConfig) -> dict[str, float] | None:
    """The server's counters, or None when it has no Prometheus /metrics."""
    try:
        r = await http.get(cfg.root + "/metrics", timeout=CONTROL_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    return parse_counters(r.text, cfg.metrics_prefix) if r.status_code == 200 else None


def counter_deltas(before: Mapping[str, float] | None, after: Mapping[str, float] | None) -> dict[str, float]:
    if before is None or after is None:
        return {}
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def counters_as_metrics(deltas: Mapping[str, float], prefix: str = "tokenslice:") -> dict[str, float]:
    """Results-file counter keys (COUNTER_KEYS) from scraped deltas, matched by name:
    `tokenslice:num_preemptions_total` -> preemptions, `tokenslice:kv_swap_in_bytes_total` ->
    swap_in_bytes, and so on for whatever counters the server adds; plus the server's mean queue
    time (arrival to first scheduled) from its histogram."""
    out: dict[str, float] = {}
    for name, value in deltas.items():
        if "{" in name or not name.startswith(prefix) or not name.endswith("_total"):
            continue
        base = name[len(prefix):-len("_total")]
        for candidate in (base, base.removeprefix("num_"), base.removeprefix("kv_")):
            if candidate in COUNTER_KEYS:
                out[candidate] = value
    qsum, qcount = deltas.get(prefix + "request_queue_time_seconds_sum"), deltas.get(
        prefix + "request_queue_time_seconds_count")
    if qsum is not None and qcount:
        out["server_mean_queue_s"] = qsum / qcount
    return out


def wait_idle(cfg: ClientConfig, timeout_s: float = 120.0) -> bool:
    """Wait until a tokenslice server reports no live request (after a run whose clients timed
    out, the server may still be finishing their aborts). False if it never did or cannot say."""
    deadline = time.monotonic() + timeout_s
    gauges = ("num_requests_running", "num_requests_waiting", "num_requests_preempted")
    while time.monotonic() < deadline:
        try:
            text = httpx.get(cfg.root + "/metrics", timeout=CONTROL_TIMEOUT_S).text
        except httpx.HTTPError:
            return False
        values = [float(m.group(3)) for line in text.splitlines()
                  if (m := _SAMPLE.match(line)) and any(m.group(1) == cfg.metrics_prefix + g for g in gauges)]
        if not values:
            return False
        if all(v == 0 for v in values):
            return True
        time.sleep(0.1)
    return False


__all__ = ["parse_counters", "scrape_counters", "counter_deltas", "counters_as_metrics", "wait_idle"]
