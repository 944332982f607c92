"""A real browser for the page tests: Debian's headless Chromium (/usr/bin/chromium) driven by
Playwright, which uses that binary and downloads none. `make test` installs the package when it
is missing; without it these tests fail, they never skip."""
from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from playwright.sync_api import BrowserContext, sync_playwright

CHROMIUM = Path("/usr/bin/chromium")
DEADLINE_MS = 60_000  # every browser call fails after this (a failure deadline, not a performance check)
# A closed network: nothing the browser would fetch on its own (updates, sync, QUIC probes).
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


@contextmanager
def chromium(width: int = 1280, height: int = 800) -> Iterator[BrowserContext]:
    """Headless Chromium (headless=True passes --headless) with a fresh profile in a temporary
    directory; closed on exit."""
    assert CHROMIUM.exists(), f"{CHROMIUM} is missing: `make test` installs it, or `apt-get install chromium`"
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile, sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(profile, executable_path=str(CHROMIUM), headless=True,
                                                    args=FLAGS, timeout=DEADLINE_MS,
                                                    viewport={"width": width, "height": height})
        ctx.set_default_timeout(DEADLINE_MS)
        try:
            yield ctx
        finally:
            ctx.close()
