"""The `tokenslice` command. Each subcommand lives in a function `cmd_<name>`; flags are the
kebab-case names of config fields (docs/DESIGN.md)."""
from __future__ import annotations

import argparse
import logging
import sys

from tokenslice.cli import bench, generate, predictor, profile, report, serve, simulate, twin, view
from tokenslice.cli.args import Parser

# In `tokenslice --help` order: each module adds its subcommand's parser and its `cmd_<name>`.
SUBCOMMANDS = (generate, serve, view, simulate, report, profile, bench, twin, predictor)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="tokenslice", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.add_subcommand(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tokenslice.model.arch import ModelLoadError
    from tokenslice.request import InvalidRequestError

    try:
        return args.func(args)
    except (ModelLoadError, InvalidRequestError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
