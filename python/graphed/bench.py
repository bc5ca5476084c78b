"""The advice benchmark, installed with the package: for each DESIGN.md
workload, graphed.advise's predicted graphed time against the graphed method's
measured time, and the relative error. ``graphed bench`` runs it; the repo's
bench/run.py (the full side-by-side suite, not installed) adds its entries as
the ``advice`` section of its results, with the measured times of its own run."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional

import torch

from . import _C, measure, workloads
from .advise import Advice, ProfileSettings, advise, advise_training
from .capture import capture
from .plot import timeline_png
from .train import TrainStep

#: The prediction must be within this relative error of the measured time.
TOLERANCE = 0.15
#: The graphed method each workload's prediction is compared with.
GRAPHED_METHOD = {"mlp_inference": "graphed_capture", "gpt_train": "graphed_trainstep"}
GPT_LR = 1e-4


def _entry(advice: Advice, method: str, measured_ms: float,
           timeline: Optional[str]) -> Dict[str, Any]:
    error = (advice.predicted_ms - measured_ms) / measured_ms
    s = advice.summary
    return {
        "method": method,
        "predicted_ms": round(advice.predicted_ms, 4),
        "measured_ms": round(measured_ms, 4),
        "rel_error": round(error, 4),
        "within_tolerance": abs(error) <= TOLERANCE,
        "tolerance": TOLERANCE,
        "eager_ms": round(advice.eager_ms, 4),
        "predicted_speedup": round(advice.predicted_speedup, 3),
        "verdict": advice.verdict,
        "strategy": advice.strategy,
        "activities_per_iter": s["activities_per_iter"],
        "kernel_ms_per_iter": round(s["gpu_ms_per_iter"], 4),
        "replay_cost": {k: round(v, 4) if isinstance(v, float) else v
                        for k, v in advice.replay_cost.items()},
        "timeline": timeline,
    }


def _timed(fn: Callable[[], Any], quick: bool) -> float:
    iters, repeats = (10, 3) if quick else (20, 7)
    return measure.cuda_time_ms(fn, iters=iters, repeats=repeats)


def advice_entry(name: str, measured_ms: Optional[float] = None, plot_dir: Optional[str] = None,
                 quick: bool = False) -> Dict[str, Any]:
    """Advises workload ``name`` and compares the prediction with
    ``measured_ms`` (measured here when None). With ``plot_dir``, writes
    ``<name>_timeline.png`` there: the eager trace against the replays'."""
    workloads.configure_numerics()
    settings = ProfileSettings(timed_iters=5, timed_repeats=3) if quick else ProfileSettings()
    timeline = os.path.join(plot_dir, f"{name}_timeline.png") if plot_dir else None
    if name == "mlp_inference":
        model, x = workloads.mlp_inference()
        with torch.no_grad():
            advice = advise(model, x, settings=settings)
            if measured_ms is None or timeline:
                fast = capture(model, x)
                if measured_ms is None:
                    measured_ms = _timed(lambda: fast(x), quick)
                replays = _C.record_trace(lambda: fast(x), 3) if timeline else None
    elif name == "gpt_train":
        model, tokens, targets = workloads.gpt_train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=GPT_LR)
        batch = (tokens, targets)
        advice = advise_training(model, optimizer, workloads.gpt_loss, batch, settings=settings)
        if measured_ms is None or timeline:
            step = TrainStep.from_parts(model, optimizer, workloads.gpt_loss, batch)
            if measured_ms is None:
                measured_ms = _timed(lambda: step(batch), quick)
            replays = _C.record_trace(lambda: step(batch), 3) if timeline else None
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(GRAPHED_METHOD)}")
    if timeline:
        rows = [("eager", advice.trace), ("graphed", replays)]
        timeline_png(timeline, rows, f"{name}: GPU busy and idle, eager against graphed "
                                     f"({torch.cuda.get_device_name()})")
    return _entry(advice, GRAPHED_METHOD[name], measured_ms, timeline)


def run(names=None, plot_dir: Optional[str] = None, quick: bool = False,
        progress: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """advice_entry for each of ``names`` (default: all); failures are recorded, not raised."""
    import traceback

    results: Dict[str, Any] = {"device": torch.cuda.get_device_name(),
                               "torch": torch.__version__, "advice": {}}
    for name in names or list(GRAPHED_METHOD):
        if progress:
            progress(name)
        try:
            results["advice"][name] = advice_entry(name, plot_dir=plot_dir, quick=quick)
        except Exception:  # noqa: BLE001 - a broken workload must not hide the others
            results["advice"][name] = {"error": traceback.format_exc()}
    return results


def markdown(advice: Dict[str, Any]) -> str:
    """The advice section as a markdown table."""
    lines = ["### advice: predicted against measured graphed time", "",
             "| workload | method | predicted ms | measured ms | error | verdict | strategy |",
             "|---|---|---:|---:|---:|---|---|"]
    for name, entry in advice.items():
        if "error" in entry:
            lines.append(f"| {name} | FAILED | | | | | |")
            continue
        flag = "" if entry["within_tolerance"] else " (over 15%)"
        lines.append(f"| {name} | {entry['method']} | {entry['predicted_ms']:.4f} | "
                     f"{entry['measured_ms']:.4f} | {100 * entry['rel_error']:+.1f}%{flag} | "
                     f"{entry['verdict']} | {entry['strategy']} |")
    return "\n".join(lines) + "\n"
