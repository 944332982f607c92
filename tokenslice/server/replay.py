"""`tokenslice view FILE`: the live view's page over a recording of `tokenslice simulate
--record-state` (JSON lines, one snapshot each; bench/record_state.py), with a time slider.

A paper-scale recording is hundreds of MB, so the page never reads it whole: it loads the index
(`GET /v1/replay/index`: runs, their snapshot times and history numbers; server/replay_index.py)
and then the pages of snapshots the slider needs (`GET /v1/replay?run=R&start=I&stop=J`, or by
simulated time with `from=T0&to=T1`). `GET /v1/replay` alone still answers the whole file."""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import FileResponse, RedirectResponse, Response

from tokenslice.server.dashboard import add_dashboard
from tokenslice.server.replay_index import index_recording

NDJSON = "application/x-ndjson"


def create_replay_app(path: str | Path) -> FastAPI:
    recording = Path(path)
    if not recording.is_file():
        raise ValueError(f"no such recording: {recording}")
    index = index_recording(recording)
    app = FastAPI(title="tokenslice view", docs_url=None, redoc_url=None, openapi_url=None)
    add_dashboard(app, "replay")

    @app.get("/")
    async def root() -> RedirectResponse:
        return RedirectResponse("/dashboard")

    @app.get("/v1/replay/index")
    async def replay_index() -> dict:
        return index.summary()

    @app.get("/v1/replay", response_model=None)
    async def replay(run: int | None = Query(None, ge=0), start: int | None = Query(None, ge=0),
                     stop: int | None = Query(None, ge=0), from_: float | None = Query(None, alias="from"),
                     to: float | None = Query(None)) -> Response | FileResponse:
        if run is None:
            if (start, stop, from_, to) != (None, None, None, None):
                raise HTTPException(400, "a page of snapshots needs run=")
            return FileResponse(recording, media_type=NDJSON)
        if run >= len(index.runs):
            raise HTTPException(404, f"no run {run}: the recording has {len(index.runs)}")
        runs = index.runs[run]
        if from_ is not None or to is not None:
            if start is not None or stop is not None:
                raise HTTPException(400, "ask by index (start, stop) or by time (from, to), not both")
            start, stop = runs.range_for_times(-float("inf") if from_ is None else from_,
                                               float("inf") if to is None else to)
        n = len(runs.offsets)
        start = 0 if start is None else min(start, n)
        stop = n if stop is None else min(stop, n)
        return Response(index.read(run, start, max(start, stop)), media_type=NDJSON,
                        headers={"X-Snapshots": f"{start}-{max(start, stop)}/{n}"})

    return app


__all__ = ["create_replay_app"]
