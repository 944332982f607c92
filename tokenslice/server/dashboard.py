"""The live view's page, `/dashboard`: static HTML/JS/CSS shipped in the package (server/static/,
no CDN, no build step). The same page serves a live server (`tokenslice serve`: it reads
/v1/state/stream) and a recording (`tokenslice view`: it reads /v1/replay); the route says which
in the page's `data-mode`. The page itself carries no data, so it stays open under --api-key."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"


def add_dashboard(app: FastAPI, mode: Literal["live", "replay"]) -> None:
    """Serve the page at /dashboard and its assets under /dashboard/static/."""
    page = (STATIC_DIR / "dashboard.html").read_text(encoding="utf-8").replace('data-mode="live"', f'data-mode="{mode}"')
    app.mount("/dashboard/static", StaticFiles(directory=STATIC_DIR), name="dashboard-static")

    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page)


__all__ = ["add_dashboard", "STATIC_DIR"]
