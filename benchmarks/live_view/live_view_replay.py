"""What replaying a large recording costs the viewer: `tokenslice view`'s index of the file, and
the page's time to show a snapshot of 1,000 live requests.

Setup, fixed before any result was seen:
  * `tokenslice simulate --profile opt-13b@a100-40gb --workload synthetic-fixed --policy
    skip-join-mlfq --rates 2000 --num-requests N --record-state FILE --record-state-interval-s S`
    (a burst: all N requests live at once);
  * the index (server/replay_index.py) built `--repeats` times, best time;
  * `tokenslice view FILE` in its own process; Debian's headless chromium (Playwright) loads
    /dashboard, then moves the slider to the last snapshot with the most live requests and times, in
    the page, from the slider's input event to that snapshot drawn: first with its page fetched
    and parsed (a fresh page load each repeat), then again from the page's cache (the slider
    moved away and back). Median of `--repeats`.

    PYTHONPATH=. .venv/bin/python benchmarks/live_view/live_view_replay.py \
        --out benchmarks/live_view/results/live_view_replay.json
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from playwright.sync_api import Page, sync_playwright

from tokenslice.cli import main as cli
from tokenslice.server.replay_index import index_recording

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
# Slider to snapshot i, then wait (a MutationObserver, no polling) until the page says it shows it.
SHOW_MS = """async ([i, total]) => {
  const slider = document.getElementById("replay-slider"), label = document.getElementById("replay-time");
  const want = `${i + 1} / ${total} `;
  const drawn = new Promise((resolve) => {
    const seen = new MutationObserver(() => { if (label.textContent.startsWith(want)) { seen.disconnect(); resolve(); } });
    seen.observe(label, { childList: true, characterData: true, subtree: true });
  });
  const t0 = performance.now();
  slider.value = String(i);
  slider.dispatchEvent(new Event("input"));
  await drawn;
  return performance.now() - t0;
}"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _show(page: Page, i: int, total: int) -> float:
    return float(page.evaluate(SHOW_MS, [i, total]))


def run(num_requests: int, interval_s: float, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "state.jsonl"
        assert cli(["simulate", "--profile", "opt-13b@a100-40gb", "--workload", "synthetic-fixed", "--policy",
                    "skip-join-mlfq", "--rates", "2000", "--num-requests", str(num_requests), "--record-state",
                    str(path), "--record-state-interval-s", str(interval_s), "--quiet"]) == 0
        index_s = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            index = index_recording(path)
            index_s.append(time.perf_counter() - t0)
        (run0,) = index.runs
        lines = index.read(0, 0, len(run0.offsets)).splitlines()
        live = [len(json.loads(line)["requests"]) for line in lines]
        # The last snapshot with the most live requests: far from the first page, which the page
        # loads at once.
        i, total = max(range(len(live)), key=lambda k: (live[k], k)), len(live)
        port = _free_port()
        server = subprocess.Popen([sys.executable, "-m", "tokenslice.cli", "--log-level", "WARNING", "view", str(path),
                                   "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(base + "/v1/replay/index", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    assert server.poll() is None and time.monotonic() < deadline, "tokenslice view did not start"
                    time.sleep(0.1)
            first, cached = [], []
            with tempfile.TemporaryDirectory() as profile, sync_playwright() as pw:
                ctx = pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True,
                                                            args=FLAGS, viewport={"width": 1280, "height": 800})
                try:
                    for _ in range(repeats):
                        page = ctx.new_page()
                        page.goto(base + "/dashboard")
                        page.wait_for_function("document.getElementById('replay-time').textContent.startsWith('1 / ')")
                        first.append(_show(page, i, total))
                        _show(page, max(0, i - 1), total)
                        cached.append(_show(page, i, total))
                        page.close()
                finally:
                    ctx.close()
        finally:
            server.terminate()
            server.wait(30)
        return {"num_requests": num_requests, "interval_s": interval_s, "file_bytes": path.stat().st_size,
                "snapshots": total, "live_at_shown": live[i], "index_s": min(index_s),
                "show_first_ms": statistics.median(first), "show_cached_ms": statistics.median(cached)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--interval-s", type=float, default=1.0, help="simulated seconds between snapshots")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    result = run(a.num_requests, a.interval_s, a.repeats)
    print(f"{result['file_bytes'] / 2**20:.1f} MB, {result['snapshots']} snapshots: index {result['index_s']:.2f} s; "
          f"a snapshot of {result['live_at_shown']} live requests shown in {result['show_first_ms']:.0f} ms "
          f"(its page fetched) / {result['show_cached_ms']:.0f} ms (cached)")
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
