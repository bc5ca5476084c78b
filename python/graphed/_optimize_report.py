"""graphed.optimize's report: what it applied, why, the times and numerics it
measured, the advice behind the choice, as markdown (``str()``) and JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _C
from .advise import Advice, format_advice
from .train import StepSettings


def graphed_work(trace: Optional[Dict[str, Any]]) -> Dict[str, float]:
    """OptimizeReport.graphed_work from a trace of the applied step (empty
    without one, or without the launch calls that tell the two apart)."""
    if not trace or not trace.get("launches") or not trace.get("iterations"):
        return {}
    summary = _C.summarize_trace(trace)
    total = summary["activities_per_iter"]
    if not total:
        return {}
    in_graphs = summary["graphed_activities_per_iter"]
    return {"activities_per_step": total, "in_graphs": in_graphs,
            "launched_eagerly": total - in_graphs, "fraction_in_graphs": in_graphs / total}


def describe_graphed_work(work: Dict[str, float]) -> str:
    """``"21% (340 of 1617 GPU activities per step; ...)"``."""
    return (f"{100 * work['fraction_in_graphs']:.0f}% ({work['in_graphs']:.0f} of "
            f"{work['activities_per_step']:.0f} GPU activities per step; the other "
            f"{work['launched_eagerly']:.0f} are launched one by one from eager code)")


@dataclass
class OptimizeReport:
    """What graphed.optimize did. True when graphs were applied; then ``fn``
    (inference) or ``step`` (training; call ``step(batch)``) is what to run.
    ``str()`` is a markdown report, ``to_dict()``/``to_json()`` its JSON form."""

    description: str
    training: bool
    applied: bool = False
    strategy: Optional[str] = None
    reason: str = ""
    error: Optional[str] = None
    advice: Optional[Advice] = None
    eager_ms: Optional[float] = None
    graphed_ms: Optional[float] = None
    max_abs_diff: Optional[float] = None
    rtol: float = 1e-3
    atol: float = 1e-4
    verify_steps: int = 0
    #: Training form: the step's settings (StepSettings' fields: amp,
    #: microbatches, clip_grad_norm, skip_nonfinite), as verified and applied.
    step_settings: Dict[str, Any] = field(default_factory=dict)
    #: Training form: the class name of the scheduler stepped after each
    #: verify step, or None.
    scheduler: Optional[str] = None
    #: Training form with compile=...: the compiled candidate (Note [A
    #: compiled candidate]): ``built``, ``why`` (built or not), ``chosen``,
    #: ``options``; once built ``compile_s``, ``ms``, ``eager_ms`` (its own
    #: side-by-side eager time), ``graphed_ms`` (the graphed candidate's),
    #: ``max_abs_diff``, or ``error``.
    compiled: Dict[str, Any] = field(default_factory=dict)
    #: graphed.check's findings that a trial capture never met (Note [Capture
    #: is the verdict] in src/safety_check.cpp): false alarms on this model.
    check_false_findings: List[Dict[str, Any]] = field(default_factory=list)
    #: What graphed changed to apply graphs (e.g. use_cache=False for training).
    notes: List[str] = field(default_factory=list)
    #: per_block only: per module that cannot be captured, the parts graphed
    #: in its place and those that run eagerly, with why (graphed.auto's
    #: ``stats()["parts"]``, Note [Graphing the parts of a block]).
    parts: Dict[str, Any] = field(default_factory=dict)
    #: How much of the applied step's GPU work its graphs run, from a trace of
    #: it (Note [Work in graphs and work launched eagerly] in src/advice.cpp):
    #: ``activities_per_step`` (kernels, copies, sets), ``in_graphs``,
    #: ``launched_eagerly``, ``fraction_in_graphs``; empty when not traced.
    graphed_work: Dict[str, float] = field(default_factory=dict)
    fn: Optional[Callable[..., Any]] = field(default=None, repr=False)
    graphed_trace: Optional[Dict[str, Any]] = field(default=None, repr=False)

    @property
    def step(self) -> Optional[Callable[..., Any]]:
        """The captured training step (``step(batch)`` returns the loss), or
        None when nothing was applied; the same object as ``fn``."""
        return self.fn

    @property
    def speedup(self) -> Optional[float]:
        """Measured eager time over graphed time, or None when not measured."""
        if self.eager_ms and self.graphed_ms:
            return self.eager_ms / self.graphed_ms
        return None

    @property
    def prediction_error(self) -> Optional[float]:
        """(predicted - measured) / measured graphed time."""
        if self.advice is None or not self.graphed_ms:
            return None
        predicted = self.advice.predicted_ms
        if self.compiled.get("chosen"):
            predicted = self.advice.to_dict()["compiled"]["predicted_ms"]
        return (predicted - self.graphed_ms) / self.graphed_ms

    def __bool__(self) -> bool:
        return self.applied

    def to_dict(self) -> Dict[str, Any]:
        """The report as a JSON-ready dict (the advice included, traces not)."""
        return {
            "description": self.description, "training": self.training,
            "applied": self.applied, "strategy": self.strategy, "reason": self.reason,
            "error": self.error, "eager_ms": self.eager_ms, "graphed_ms": self.graphed_ms,
            "speedup": self.speedup, "prediction_error": self.prediction_error,
            "max_abs_diff": self.max_abs_diff, "rtol": self.rtol, "atol": self.atol,
            "verify_steps": self.verify_steps, "step_settings": self.step_settings,
            "scheduler": self.scheduler, "compiled": self.compiled,
            "check_false_findings": self.check_false_findings, "notes": self.notes,
            "parts": self.parts, "graphed_work": self.graphed_work,
            "advice": self.advice.to_dict() if self.advice is not None else None,
        }

    def to_json(self, **kwargs: Any) -> str:
        """``to_dict()`` as JSON text; ``kwargs`` go to ``json.dumps``."""
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        state = "applied" if self.applied else "NOT applied"
        lines = [f"# graphed optimize: {self.description}", "",
                 f"**{state}** ({self.strategy or 'no strategy'}): {self.reason}", ""]
        rows: List[Tuple[str, str]] = []
        if self.eager_ms is not None:
            rows.append(("eager", f"{self.eager_ms:.3f} ms"))
        if self.graphed_ms is not None:
            rows.append(("graphed, measured", f"{self.graphed_ms:.3f} ms"))
        if self.speedup is not None:
            rows.append(("speedup, measured", f"{self.speedup:.2f}x"))
        if self.advice is not None:
            rows.append(("graphed, predicted", f"{self.advice.predicted_ms:.3f} ms"))
        if self.compiled:
            rows.append(("compiled candidate", _compiled_row(self.compiled)))
        if self.graphed_work:
            rows.append(("GPU work in graphs", describe_graphed_work(self.graphed_work)))
        if self.prediction_error is not None:
            rows.append(("prediction error", f"{100 * self.prediction_error:+.1f}%"))
        if self.max_abs_diff is not None:
            what = f"{self.verify_steps} steps: losses and parameters" if self.training \
                else "outputs"
            if self.training and self.step_settings:
                what += ", " + StepSettings(**self.step_settings).describe()
            if self.training and self.scheduler is not None:
                what += f", {self.scheduler} stepped after each"
            rows.append((f"numerics vs eager ({what})",
                         f"max |diff| {self.max_abs_diff:.3g} (rtol {self.rtol:g}, "
                         f"atol {self.atol:g})"))
        if rows:
            lines += ["| | |", "|---|---:|"] + [f"| {a} | {b} |" for a, b in rows] + [""]
        if self.notes:
            lines += [f"- {note}" for note in self.notes] + [""]
        if self.check_false_findings:
            lines.append(f"graphed.check found {len(self.check_false_findings)} operation(s) that "
                         "the capture never met (false findings on this model):")
            lines += [f"- `{f['op']}`" + (f" at {f['file']}:{f['line']}" if f.get("file") else "")
                      for f in self.check_false_findings]
            lines.append("")
        if self.error:
            lines += ["```", self.error.rstrip(), "```", ""]
        if self.advice is not None:
            lines.append(format_advice(self.advice, heading="##"))
        return "\n".join(lines)


def _compiled_row(entry: Dict[str, Any]) -> str:
    if not entry.get("built"):
        return entry.get("why", "not built")
    if "error" in entry:
        return f"failed after {entry.get('compile_s', 0):.1f} s: {entry['error'][:300]}"
    verdict = "chosen" if entry.get("chosen") else "not chosen"
    return (f"{entry.get('ms', float('nan')):.3f} ms against {entry.get('graphed_ms', 0):.3f} ms "
            f"graphed ({verdict}; built in {entry.get('compile_s', 0):.1f} s)")
