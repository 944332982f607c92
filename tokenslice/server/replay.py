"""`tokenslice view FILE`: the live view's page over a recording of `tokenslice simulate
--record-state` (JSON lines, one snapshot each; bench/record_state.py). The page reads the whole
file from /v1/replay and plays it with a time slider."""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, RedirectResponse

from tokenslice.server.dashboard import add_dashboard


def create_replay_app(path: str | Path) -> FastAPI:
    recording = Path(path)
    if not recording.is_file():
        raise ValueError(f"no such recording: {recording}")
    app = FastAPI(title="tokenslice view", docs_url=None, redoc_url=None, openapi_url=None)
    add_dashboard(app, "replay")

    @app.get("/")
    async def root() -> RedirectResponse:
        return RedirectResponse("/dashboard")

    @app.get("/v1/replay")
    async def replay() -> FileResponse:
        return FileResponse(recording, media_type="application/x-ndjson")

    return app


__all__ = ["create_replay_app"]
