"""The ``graphed`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Any, Dict, List, Optional, TextIO

from ._progress import Progress


def version_text() -> str:
    """What ``graphed --version`` prints: graphed's version, the torch and CUDA
    its C++ core was built with, and the torch it runs with."""
    import platform

    import graphed

    info = graphed.build_info()
    nvtx = "on" if graphed.nvtx_enabled() else "off" if info["nvtx"] else "not built in"
    return "\n".join([
        f"graphed {info['version']}",
        f"  built with torch {info['torch']}, CUDA {info['cuda']}; NVTX ranges {nvtx}",
        f"  running on torch {info['runtime_torch']} (CUDA {info['runtime_cuda'] or 'none'}), "
        f"Python {platform.python_version()}",
    ])


class _VersionAction(argparse.Action):
    """--version: prints version_text() and exits."""

    def __init__(self, option_strings: List[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: Optional[str] = None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        print(version_text())
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphed",
        description="CUDA Graphs for PyTorch: check, advise, apply, verify.",
    )
    parser.add_argument("--version", action=_VersionAction,
                        help="print graphed's version, the torch and CUDA it was built with and "
                             "the torch it runs with, then exit")
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
                       help="e.g. my_pkg.workloads:make_step (the current directory is "
                            "importable) or path/to/train.py:make_step")
    check.add_argument("--json", action="store_true", help="print the report as JSON")

    workload_help = ("FACTORY returns an inference workload (fn, args) or (fn, args, kwargs), or a "
                     "training workload (model, optimizer, loss_fn, (inputs, targets)).")
    advise = commands.add_parser(
        "advise",
        help="profile a workload and predict what CUDA graphs would gain",
        description="Imports MODULE, calls FACTORY() to build the workload, checks it, profiles a "
        "few eager iterations with the Kineto profiler and prints the advice: kernels per "
        "iteration, GPU busy and idle time, the predicted graphed time and speedup, a verdict "
        "and a capture strategy. " + workload_help + " Needs a GPU. Exit code: 0 advice given, "
        "2 bad input (the factory cannot be imported, raises or returns something else, the "
        "workload raises) or no GPU.",
    )
    optimize = commands.add_parser(
        "optimize",
        help="check, advise, apply graphs, verify against eager and measure",
        description="Builds the workload with MODULE:FACTORY, then runs graphed.optimize: check, "
        "advise, apply the recommended strategy, verify numerics against eager, measure both and "
        "report. When graphs cannot be applied, do not match eager or are not 1.05x faster, "
        "nothing is changed and the report says why. " + workload_help + " Needs a GPU. Exit "
        "code: 0 applied, 1 not applied (the report says why), 2 bad input or no GPU.",
    )
    for command in (advise, optimize):
        command.add_argument("factory", metavar="MODULE:FACTORY",
                             help="e.g. my_pkg.workloads:make_step (the current directory is "
                                  "importable) or path/to/train.py:make_step")
        command.add_argument("--json", action="store_true", help="print the report as JSON")
        command.add_argument("--plot", metavar="FILE",
                             help="write a PNG timeline of GPU busy and idle time, eager against "
                                  "graphed (predicted for advise, measured for optimize)")
        # The settings of TrainStep.from_parts (graphed.train.StepSettings), training only.
        command.add_argument("--amp", choices=["bf16"],
                             help="training: forward and loss under bf16 autocast (fp32 "
                                  "master weights)")
        command.add_argument("--microbatches", type=int, default=1, metavar="N",
                             help="training: split the batch into N microbatches along dim 0 "
                                  "and accumulate their gradients")
        command.add_argument("--clip-grad-norm", type=float, metavar="MAX_NORM",
                             help="training: clip the gradients to this global norm before "
                                  "the optimizer step")
        command.add_argument("--skip-nonfinite", action="store_true",
                             help="training: a step whose loss or gradients are not finite "
                                  "changes nothing")
    optimize.add_argument("--compile", choices=["off", "on", "auto"], default="off",
                          help="also build the step (or call) over torch.compile(model) "
                               "(Inductor's fusion, captured by graphed) and keep the faster; "
                               "auto: only where advise predicts it pays (default: off)")
    bench = commands.add_parser(
        "bench",
        help="predicted against measured graphed time on the DESIGN.md workloads",
        description="Runs graphed's advice benchmark on mlp_inference and gpt_train: the time "
        "graphed.advise predicts for the graphed workload against the time measured, and the "
        "relative error (the target is 15%%). The full side-by-side suite against PyTorch's own "
        "graph paths is bench/run.py in graphed's repository. Needs a GPU. Exit code: 0 every "
        "prediction within 15%%, 1 otherwise or a workload failed, 2 no GPU.",
    )
    bench.add_argument("workloads", nargs="*", metavar="WORKLOAD",
                       help="mlp_inference and/or gpt_train (default: both)")
    bench.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    bench.add_argument("--plot-dir", metavar="DIR",
                       help="write <workload>_timeline.png files into DIR")
    bench.add_argument("--quick", action="store_true", help="fewer timed iterations")
    return parser


def _load(command: str, spec: str, err: TextIO):
    from .factory import FactoryError, load_any_workload

    try:
        return load_any_workload(spec)
    except FactoryError as error:
        if error.details:
            print(error.details, file=err, end="")
        print(f"graphed {command}: {error}", file=err)
        return None


def _need_gpu(command: str, err: TextIO) -> bool:
    import torch

    if torch.cuda.is_available():
        return True
    print(f"graphed {command}: profiling needs an NVIDIA GPU and this machine has none "
          "(torch.cuda.is_available() is False); `graphed check` works without one.", file=err)
    return False


def _workload_raised(command: str, spec: str, error: Exception, err: TextIO) -> int:
    traceback.print_exc(file=err)
    print(f"graphed {command}: the workload of factory {spec!r} raised {type(error).__name__}: "
          f"{error}; {command} runs it eagerly, so it must run on this machine as the factory "
          "built it", file=err)
    return 2


def _step_options(args: argparse.Namespace) -> Dict[str, Any]:
    """The training step's settings given on the command line (StepSettings' fields)."""
    return {"amp": args.amp, "microbatches": args.microbatches,
            "clip_grad_norm": args.clip_grad_norm, "skip_nonfinite": args.skip_nonfinite}


def _options_fit(command: str, spec: str, workload: Any, step: Dict[str, Any],
                 err: TextIO) -> bool:
    """Training settings need a training workload: says so and returns False otherwise."""
    from .factory import TrainingWorkload
    from .train import StepSettings

    try:
        settings = StepSettings(**step)
    except Exception as error:  # noqa: BLE001 - a GraphedError naming the option
        print(f"graphed {command}: {error}", file=err)
        return False
    if settings != StepSettings() and not isinstance(workload, TrainingWorkload):
        print(f"graphed {command}: {settings.describe()} applies to training workloads; factory "
              f"{spec!r} returned an inference workload (fn, args). Return (model, optimizer, "
              "loss_fn, batch), or drop the training options.", file=err)
        return False
    return True


def _run_advise(spec: str, as_json: bool, plot: Optional[str], out: TextIO, err: TextIO,
                step: Optional[Dict[str, Any]] = None) -> int:
    from .factory import TrainingWorkload

    step = step or {}
    workload = _load("advise", spec, err)
    if workload is None:
        return 2
    if not _options_fit("advise", spec, workload, step, err):
        return 2
    if not _need_gpu("advise", err):
        return 2
    from .advise import advise, advise_training

    progress = Progress(2, "graphed advise", file=err)
    try:
        progress("check and profile")
        if isinstance(workload, TrainingWorkload):
            advice = advise_training(workload.model, workload.optimizer, workload.loss_fn,
                                     workload.batch, **step)
        else:
            advice = advise(workload.fn, *workload.args, **workload.kwargs)
    except Exception as error:  # noqa: BLE001 - the workload is the user's code
        progress.close()
        return _workload_raised("advise", spec, error, err)
    if plot:
        from .plot import predicted_trace, timeline_png

        progress("plot")
        cost = advice.replay_cost
        timeline_png(plot, [("eager", advice.trace),
                            ("graphed (predicted)",
                             predicted_trace(advice.trace, cost["per_node_us"], cost["launch_us"]))],
                     f"graphed advise: {advice.description}")
    progress.close()
    _emit(advice, spec, plot, as_json, out)
    return 0


def _emit(result, spec: str, plot: Optional[str], as_json: bool, out: TextIO) -> None:
    """Prints an advice or optimize report: JSON (with the factory and the
    plot's path) or text followed by the plot's path."""
    if as_json:
        json.dump({"factory": spec, **result.to_dict(), "plot": plot}, out, indent=2)
        print(file=out)
    else:
        print(result, file=out)
        if plot:
            print(f"\nTimeline: {plot}", file=out)


def _run_optimize(spec: str, as_json: bool, plot: Optional[str], out: TextIO,
                  err: TextIO, step: Optional[Dict[str, Any]] = None,
                  compile_mode: str = "off") -> int:
    from .factory import TrainingWorkload

    step = step or {}
    workload = _load("optimize", spec, err)
    if workload is None:
        return 2
    if not _options_fit("optimize", spec, workload, step, err):
        return 2
    if not _need_gpu("optimize", err):
        return 2
    from .optimize import optimize

    progress = Progress(6, "graphed optimize", file=err)
    compile = {"off": False, "on": True, "auto": "auto"}[compile_mode]
    if isinstance(workload, TrainingWorkload):
        report = optimize(workload.model, workload.optimizer, workload.loss_fn,
                          sample_batch=workload.batch, progress=progress, compile=compile,
                          **step)
    elif workload.kwargs:
        progress.close()
        print(f"graphed optimize: factory {spec!r} returned keyword arguments "
              f"{sorted(workload.kwargs)}; optimize passes positional arguments only: return "
              "(fn, args) or (model, optimizer, loss_fn, batch)", file=err)
        return 2
    else:
        report = optimize(workload.fn, sample_batch=workload.args, progress=progress,
                          compile=compile)
    if plot and report.advice is not None:
        from .plot import timeline_png

        progress("plot")
        timeline_png(plot, [("eager", report.advice.trace), ("graphed", report.graphed_trace)],
                     f"graphed optimize: {report.description}")
    progress.close()
    _emit(report, spec, plot, as_json, out)
    return 0 if report.applied else 1


def _run_bench(names: List[str], json_path: Optional[str], plot_dir: Optional[str],
               quick: bool, out: TextIO, err: TextIO) -> int:
    from . import bench

    unknown = sorted(set(names) - set(bench.GRAPHED_METHOD))
    if unknown:
        print(f"graphed bench: unknown workload(s) {', '.join(unknown)}; choose from "
              f"{', '.join(bench.GRAPHED_METHOD)}", file=err)
        return 2
    if not _need_gpu("bench", err):
        return 2
    if plot_dir:
        os.makedirs(plot_dir, exist_ok=True)
    names = names or list(bench.GRAPHED_METHOD)
    progress = Progress(len(names), "graphed bench", file=err)
    results = bench.run(names, plot_dir=plot_dir, quick=quick, progress=progress)
    progress.close()
    if json_path:
        with open(json_path, "w") as handle:
            json.dump(results, handle, indent=2)
    print(bench.markdown(results["advice"]), file=out)
    failed = [name for name, entry in results["advice"].items()
              if "error" in entry or not entry["within_tolerance"]]
    for name in failed:
        print(f"graphed bench: {name}: " + results["advice"][name].get(
            "error", "prediction error over 15%"), file=err)
    return 1 if failed else 0


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
    if args.command == "advise":
        return _run_advise(args.factory, args.json, args.plot, sys.stdout, sys.stderr,
                           _step_options(args))
    if args.command == "optimize":
        return _run_optimize(args.factory, args.json, args.plot, sys.stdout, sys.stderr,
                             _step_options(args), args.compile)
    if args.command == "bench":
        return _run_bench(args.workloads, args.json, args.plot_dir, args.quick, sys.stdout,
                          sys.stderr)
    raise AssertionError(f"unhandled command {args.command!r}")
