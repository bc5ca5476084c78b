"""The ``graphed`` command line."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphed",
        description="CUDA Graphs for PyTorch: check, advise, apply, verify.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser(
        "demo",
        help="run a launch-bound MLP eagerly and as a captured graph; print the speedup",
        description="Runs the mlp_inference workload of DESIGN.md eagerly and captured, checks "
        "that outputs match, and prints the speedup and the ratio to the kernel-time floor. "
        "Without a GPU it says so, shows what it would run, and exits 0.",
    )
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``graphed`` command; returns the exit code."""
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from .demo import run

        return run(sys.stdout)
    raise AssertionError(f"unhandled command {args.command!r}")
