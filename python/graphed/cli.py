"""The ``graphed`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from typing import List, Optional, TextIO


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
    check = commands.add_parser(
        "check",
        help="run a workload once and list everything that would break CUDA graph capture",
        description="Imports MODULE, calls FACTORY() to build the workload, runs it once eagerly "
        "under graphed.check and prints every operation that would break or spoil CUDA graph "
        "capture, with its inputs, source line, why and fix. FACTORY returns (fn, args) or "
        "(fn, args, kwargs). Works without a GPU: on CPU tensors it reports what would break on "
        "one. Exit code: 0 nothing found, 1 blockers found, 2 bad input (the factory cannot be "
        "imported, raises or returns something else, or the workload raises).",
    )
    check.add_argument("factory", metavar="MODULE:FACTORY",
                       help="e.g. my_pkg.workloads:make_step (the current directory is importable)")
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def _run_check(spec: str, as_json: bool, out: TextIO, err: TextIO) -> int:
    from .check import check
    from .factory import FactoryError, load_workload

    try:
        workload = load_workload(spec)
    except FactoryError as error:
        if error.details:
            print(error.details, file=err, end="")
        print(f"graphed check: {error}", file=err)
        return 2
    try:
        report = check(workload.fn, *workload.args, **workload.kwargs)
    except Exception as error:  # noqa: BLE001 - the workload is the user's code
        traceback.print_exc(file=err)
        print(f"graphed check: the workload of factory {spec!r} raised {type(error).__name__}: "
              f"{error}; the check runs it once eagerly, so it must run on this machine as the "
              "factory built it", file=err)
        return 2
    if as_json:
        json.dump({"factory": spec, **report.to_dict()}, out, indent=2)
        print(file=out)
    else:
        print(report, file=out)
    return 1 if report else 0


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``graphed`` command; returns the exit code."""
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from .demo import run

        return run(sys.stdout)
    if args.command == "check":
        return _run_check(args.factory, args.json, sys.stdout, sys.stderr)
    raise AssertionError(f"unhandled command {args.command!r}")
