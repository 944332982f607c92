"""The live view in a real browser (headless Chromium, tests/browserkit.py) against a real
`tokenslice serve` of stories260k under load: the page's counts are /metrics' within one
refresh, a preempted request shows as a preempted chip, and under --api-key the page asks for
the key and shows nothing until it has it. The loaded page's screenshot goes to the test's temporary
folder (docs/dashboard.png, which the README shows, is a copy of one: `pytest --basetemp=DIR` keeps
it at a known place)."""
from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import openai
import pytest
from playwright.sync_api import Page

from browserkit import chromium
from serverkit import RunningServer, serve_app, start_server, until, wait_idle
from tokenslice.cli import main
from tokenslice.server.replay import create_replay_app

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT.parent / "shared" / "models" / "stories260k"
DEADLINE_S = 120.0  # failure deadlines, not performance checks
# The preemption test's load is run one request at a time (one batch slot): a request answers only
# once the ones before it are done, and all of them together take minutes on a busy 2-core machine.
LOAD_DEADLINE_S = 600.0
# The page's count elements and the /metrics gauges they show.
COUNTS = {"running": "tokenslice:num_requests_running", "waiting": "tokenslice:num_requests_waiting",
          "preempted": "tokenslice:num_requests_preempted", "swapped": "tokenslice:num_requests_swapped"}
MAX_TOKENS = 480  # stories260k holds 512 positions
ON_HOST_CHIP = "#lanes .chip.state-on-host"
PREEMPTED_CHIP = "#lanes .chip.state-preempted, " + ON_HOST_CHIP


def _counts(m: dict[str, float]) -> dict[str, int]:
    return {name: int(m[gauge]) for name, gauge in COUNTS.items()}


def _dom(page: Page) -> tuple[int, dict[str, int]]:
    """The engine step the page shows, and its counts, read at one instant."""
    step, *values = page.evaluate("['engine-step', " + ", ".join(f"'count-{n}'" for n in COUNTS) +
                                  "].map((id) => Number(document.getElementById(id).textContent))")
    return int(step), dict(zip(COUNTS, map(int, values)))


class MetricsWatch:
    """Reads /metrics over and over on a thread: the counts it reported at each engine step.
    The engine core sends its counts only after a step, so one step has one set of counts."""

    def __init__(self, srv: RunningServer) -> None:
        self.srv = srv
        self.by_step: dict[int, dict[str, int]] = {}
        self.clashes: list[tuple[int, dict[str, int], dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-watch", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            m = self.srv.metrics()
            step, counts = int(m["tokenslice:engine_steps_total"]), _counts(m)
            if self.by_step.setdefault(step, counts) != counts:
                self.clashes.append((step, self.by_step[step], counts))

    def __enter__(self) -> MetricsWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(DEADLINE_S)


def _drawn(page: Page) -> int:
    return int(page.evaluate("Number(document.body.dataset.drawn || 0)"))


def _wait_fresh(srv: RunningServer, page: Page) -> None:
    """Until the page shows a snapshot the engine took after this call. /v1/state answers the
    latest snapshot (or the one being taken), so any later one was asked for after now."""
    seq = httpx.get(srv.url("/v1/state"), timeout=DEADLINE_S).json()["seq"]
    page.wait_for_function(f"Number(document.body.dataset.seq || 0) > {seq}")


def _capture(page: Page, selector: str, screenshot: Path) -> bool:
    """Pause the page; if it shows `selector`, save the screenshot; resume."""
    page.click("#pause")
    try:
        shown = page.query_selector(selector) is not None
        if shown:
            page.screenshot(path=str(screenshot))
        return shown
    finally:
        page.click("#pause")


def _load(srv: RunningServer, pool: ThreadPoolExecutor) -> list[Future]:
    """Twenty long requests of low priority, then, once one has a third of its tokens, three of
    high priority that preempt it (one batch slot) and, as they grow, push its KV to host."""
    client = openai.OpenAI(base_url=srv.url("/v1"), api_key="x", max_retries=0, timeout=LOAD_DEADLINE_S)
    model = str(STORIES)

    def one(prompt: str, priority: int) -> int:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                      extra_body={"ignore_eos": True, "priority": priority})
        return r.usage.completion_tokens

    low = [pool.submit(one, f"Once upon a time {i}", 2) for i in range(20)]

    def holds_kv() -> bool:  # enough that the urgent one's growth must evict it (10 of 40 blocks)
        state = httpx.get(srv.url("/v1/state"), timeout=DEADLINE_S).json()
        return any(r["state"] == "running" and r["output_tokens"] >= MAX_TOKENS // 3 for r in state["requests"])

    until(holds_kv)
    return low + [pool.submit(one, f"The dog ran {i}", -1) for i in range(3)]


@pytest.mark.timeout(LOAD_DEADLINE_S + 300)  # the load, plus the server's and the browser's start
def test_page_counts_match_metrics_and_show_a_preemption(tmp_path: Path) -> None:
    # One batch slot under `priority`: an urgent arrival preempts the running request, and a
    # pool of 40 blocks (less than two requests' KV) sends the preempted one's KV to host.
    flags = ["--model", str(STORIES), "--policy", "priority", "--preemption", "reactive-swap",
             "--max-batch-size", "1", "--kv-cache-blocks", "40", "--host-kv-blocks", "256",
             "--no-enable-prefix-caching"]
    screenshot = tmp_path / "dashboard.png"
    errors: list[str] = []
    with start_server(*flags) as srv, chromium() as browser, ThreadPoolExecutor(32) as pool:
        page = browser.new_page()
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(srv.url("/dashboard"))
        page.wait_for_selector("#view", state="visible")
        futures = _load(srv, pool)
        try:
            # Within one refresh: each snapshot the page draws names its engine step, and the
            # page's counts must be what /metrics reported at that step.
            matched, seen, preempted_id, on_host = 0, [], None, False
            deadline = time.monotonic() + DEADLINE_S
            with MetricsWatch(srv) as watch:
                while (matched < 5 or preempted_id is None or not on_host) and time.monotonic() < deadline \
                        and not all(f.done() for f in futures):
                    page.wait_for_function(f"Number(document.body.dataset.drawn) > {_drawn(page)}")
                    step, shown = _dom(page)
                    seen.append((step, shown))
                    if step in watch.by_step:
                        assert shown == watch.by_step[step], (step, shown, watch.by_step[step])
                        matched += shown["running"] > 0 and shown["waiting"] + shown["preempted"] + shown["swapped"] > 0
                    chip = page.query_selector(PREEMPTED_CHIP)
                    if chip is not None and preempted_id is None:
                        preempted_id = chip.get_attribute("data-id")
                        title = chip.get_attribute("title") or ""
                        assert int(re.search(r"(\d+) preemptions", title).group(1)) >= 1, title
                        _capture(page, PREEMPTED_CHIP, screenshot)
                    if not on_host and page.query_selector(ON_HOST_CHIP):  # a better picture: its KV on host
                        on_host = _capture(page, ON_HOST_CHIP, screenshot)
            assert watch.clashes == []
            assert matched >= 5 and preempted_id is not None, (matched, preempted_id, seen, sorted(watch.by_step))
            assert screenshot.stat().st_size > 0
        finally:
            tokens = [f.result(timeout=LOAD_DEADLINE_S) for f in futures]
        assert tokens == [MAX_TOKENS] * len(futures)
        idle = wait_idle(srv)
        assert idle["tokenslice:num_preemptions_total"] >= 1
        _wait_fresh(srv, page)
        step, shown = _dom(page)
        assert shown == dict.fromkeys(COUNTS, 0) and step == idle["tokenslice:engine_steps_total"]
        page.close()
    assert errors == []


def test_page_under_a_key_asks_for_it_and_shows_no_data_without_it() -> None:
    key = "browser-key-5150"
    with start_server("--api-key", key, "--kv-cache-blocks", "64") as srv, chromium() as browser:
        page = browser.new_page()
        page.goto(srv.url("/dashboard"))
        page.wait_for_selector("#key-prompt", state="visible")
        assert page.is_hidden("#view")
        assert _drawn(page) == 0  # no snapshot reached the page
        assert page.query_selector_all("#lanes *") == []
        assert "API key" in (page.text_content("#status") or "")
        page.fill("#key-input", key)
        page.click("#key-submit")
        page.wait_for_selector("#view", state="visible")
        page.wait_for_function("Number(document.body.dataset.drawn || 0) > 0")
        assert page.is_hidden("#key-prompt") and page.text_content("#status").startswith("live")
        page.close()


# ---- replay: `tokenslice view` of a `simulate --record-state` recording ------------------------
def _record(path: Path, *flags: str) -> list[dict]:
    assert main(["simulate", "--profile", "opt-13b@a100-40gb", "--workload", "synthetic-fixed",
                 "--policy", "skip-join-mlfq", "--record-state", str(path), "--quiet", *flags]) == 0
    return [json.loads(line) for line in path.read_text().splitlines()]


def _show(page: Page, index: int, total: int) -> None:
    """Move the time slider to snapshot `index` and wait until the page shows it."""
    page.eval_on_selector("#replay-slider", "(el, i) => { el.value = String(i); el.dispatchEvent(new Event('input')); }",
                          index)
    page.wait_for_function(f"document.getElementById('replay-time').textContent.startsWith('{index + 1} / {total} ')")


def _mlfq_lane(snap: dict, rid: str) -> str:
    (level,) = [q["level"] for q in snap["queues"]["queues"] if rid in {r["id"] for r in q["requests"]}]
    return f"q{level}"


def test_chips_are_kept_across_snapshots_and_move_between_lanes(tmp_path: Path) -> None:
    """One element per request id for the whole replay: a request demoted to the next MLFQ level
    is the same node, now in the other lane and coloured by its new state."""
    snaps = _record(tmp_path / "state.jsonl", "--rates", "8", "--num-requests", "30", "--kv-cache-blocks", "60")
    moves = [(i, r["id"]) for i, (a, b) in enumerate(zip(snaps, snaps[1:]))
             for r in b["requests"] if r["id"] in {x["id"] for x in a["requests"]}
             and _mlfq_lane(a, r["id"]) != _mlfq_lane(b, r["id"])]
    assert moves, "the recording has no demotion"
    i, rid = moves[0]
    errors: list[str] = []
    with serve_app(create_replay_app(tmp_path / "state.jsonl")) as srv, chromium() as browser:
        page = browser.new_page()
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(srv.url("/dashboard"))
        _show(page, i, len(snaps))
        chip = f'#lanes .chip[data-id="{rid}"]'
        page.eval_on_selector(chip, "el => { window.watched = el; }")
        assert page.eval_on_selector(chip, "el => el.closest('.lane').dataset.lane") == _mlfq_lane(snaps[i], rid)
        _show(page, i + 1, len(snaps))
        after = page.eval_on_selector(chip, "el => [el === window.watched, el.closest('.lane').dataset.lane, el.className]")
        (state,) = [r["state"] for r in snaps[i + 1]["requests"] if r["id"] == rid]
        assert after == [True, _mlfq_lane(snaps[i + 1], rid), "chip state-" + state.replace(" ", "-")]
        page.close()
    assert errors == []


def test_a_thousand_live_requests_show_as_counts(tmp_path: Path) -> None:
    """A burst of 1,000 requests: lanes of more than 200 show counts by state that add up, and
    the page draws such a snapshot without error."""
    path = tmp_path / "state.jsonl"
    snaps = _record(path, "--rates", "2000", "--num-requests", "1000", "--record-state-interval-s", "3")
    assert path.stat().st_size > 16 << 20  # several of the page's 4 MB pages
    i = max(range(len(snaps)), key=lambda k: len(snaps[k]["requests"]))
    assert len(snaps[i]["requests"]) == 1000
    crowded = {f"q{q['level']}": len(q["requests"]) for q in snaps[i]["queues"]["queues"] if len(q["requests"]) > 200}
    assert crowded
    errors: list[str] = []
    fetched: list[str] = []
    with serve_app(create_replay_app(path)) as srv, chromium() as browser:
        page = browser.new_page()
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: fetched.append(r.url))
        page.goto(srv.url("/dashboard"))
        _show(page, i, len(snaps))
        for lane, n in crowded.items():
            counts = page.eval_on_selector_all(f'#lanes .lane[data-lane="{lane}"] .crowd .chip',
                                               "els => els.map((el) => Number(el.dataset.count))")
            assert sum(counts) == n
            assert page.query_selector_all(f'#lanes .lane[data-lane="{lane}"] .chip[data-id]') == []
        assert "1000 live" in page.text_content("#scheduler")
        _show(page, len(snaps) - 1, len(snaps))
        # Only the index and pages of snapshots: the first, the slider's, and the one after each.
        pages = [parse_qs(urlsplit(u).query) for u in fetched if urlsplit(u).path == "/v1/replay"]
        assert [u for u in fetched if "/v1/replay" in u and "/v1/replay?" not in u] == [srv.url("/v1/replay/index")]
        assert all(set(q) == {"run", "start", "stop"} for q in pages) and 2 <= len(pages) <= 5
        assert sum(min(int(q["stop"][0]), len(snaps)) - int(q["start"][0]) for q in pages) < len(snaps)
        page.close()
    assert errors == []
