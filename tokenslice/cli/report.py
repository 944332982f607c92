"""`tokenslice report`: tables and figures from `simulate` or `bench` results files."""
from __future__ import annotations

import argparse
from typing import Any


def cmd_report(a: argparse.Namespace) -> int:
    from pathlib import Path

    from tokenslice.bench.report import format_summary, format_table, load_results, plot_results

    results = load_results(a.results)
    stems = [Path(p).stem for p in a.results]
    names = stems if len(set(stems)) == len(stems) else list(a.results)
    print(format_summary(results, names))
    print(format_table(results, names))
    if a.plot:
        print(f"wrote {plot_results(results, a.plot, names)}")
    return 0


def add_subcommand(sub: Any) -> None:
    r = sub.add_parser("report", help="tables and figures from one or more results files")
    r.add_argument("results", nargs="+", help="results .json files (merged)")
    r.add_argument("--plot", default=None, help="write a PNG figure")
    r.set_defaults(func=cmd_report)
