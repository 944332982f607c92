"""`tokenslice view`: the live view's page over a `simulate --record-state` recording."""
from __future__ import annotations

import argparse
import sys
from typing import Any


def cmd_view(a: argparse.Namespace) -> int:
    import uvicorn

    from tokenslice.server.replay import create_replay_app

    print(f"indexing {a.file}", file=sys.stderr)
    app = create_replay_app(a.file)
    print(f"replaying {a.file} at http://{a.host}:{a.port}/dashboard", file=sys.stderr)
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level.lower(), access_log=False)
    return 0


def add_subcommand(sub: Any) -> None:
    v = sub.add_parser("view", help="serve the live view's page over a `simulate --record-state` file, with a time slider")
    v.add_argument("file", help="JSON lines written by `tokenslice simulate --record-state`")
    v.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    v.add_argument("--port", type=int, default=8000)
    v.set_defaults(func=cmd_view)
