"""graphed.advise: will CUDA graphs pay off here, by how much, and how to capture?

A trace of a few eager iterations through libtorch's Kineto profiler (no
Nsight needed) gives the kernels per iteration, their durations, how busy the
GPU is and how long it idles between kernels, and the host time per launch.
The graphed iteration time is predicted as the kernels' own time plus a
per-node replay cost measured on this GPU at start-up (Note [Predicting the
graphed time] in src/advice.cpp); the strategy follows the decision chart of
Note [Choosing a strategy]. The arithmetic lives in the C++ core; this module
adapts functions, modules and optimizers to it and formats the report."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import _C
from ._C import GraphedError
from ._state import Snapshot, describe, first_cuda_device, tensor_shapes
from .check import check as _check
from .train import StepSettings, batch_loss, check_batch_form, split_batch, training_iteration


@dataclass
class ProfileSettings:
    """How much graphed.advise runs: warm-up calls, timed calls (``timed_iters``
    back to back, ``timed_repeats`` rounds, the median kept) and traced calls."""

    warmup: int = 3
    timed_iters: int = 10
    timed_repeats: int = 5
    profiled_iters: int = 5


class Advice:
    """What graphed.advise found. ``str()`` is a markdown report, ``to_dict()``
    its JSON form; ``trace`` holds the eager trace (for timelines).

    Attributes: ``verdict`` ("graphs help", "won't help much", "already
    GPU-bound"), ``strategy`` ("full_capture", "per_module", "bucketed",
    "fix_blockers", "stay_eager"), ``eager_ms``, ``predicted_ms``,
    ``predicted_speedup``, ``helps_above`` (the speedup the verdict asks of
    graphs), ``summary`` (per-iteration figures of the trace),
    ``compiled`` (the step under torch.compile's fusion, replayed as graphs:
    ``predicted_ms``, ``fusible_ms``, ``fixed_ms``, ``fusible_kernels``,
    ``fixed_activities``; Note [Predicting a compiled step]),
    ``replay_cost``, ``reason``, ``notes``, ``blockers`` (graphed.check's
    findings as dicts), ``description``, ``training``, ``device``.
    """

    def __init__(self, data: Dict[str, Any], *, description: str, training: bool,
                 blockers: List[Dict[str, Any]], trace: Dict[str, Any], device: str) -> None:
        self._data = data
        self.description = description
        self.training = training
        self.blockers = blockers
        self.trace = trace
        self.device = device

    def __getattr__(self, name: str) -> Any:
        data = self.__dict__.get("_data", {})
        if name in data:
            return data[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @property
    def replay_cost(self) -> Dict[str, Any]:
        """The replay cost of this GPU the prediction used: ``per_node_us``,
        ``launch_us`` and the measurement behind them."""
        return self._data["replay_cost"]

    def to_dict(self) -> Dict[str, Any]:
        """The advice as a JSON-ready dict (without the raw trace)."""
        return {"description": self.description, "device": self.device,
                "training": self.training, **self._data, "blockers": self.blockers}

    def to_json(self, **kwargs: Any) -> str:
        """``to_dict()`` as JSON text; ``kwargs`` go to ``json.dumps``."""
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        return format_advice(self)

    def __repr__(self) -> str:
        return (f"<Advice for {self.description}: {self.verdict}, {self.strategy}, predicted "
                f"{self.predicted_ms:.3f} ms against {self.eager_ms:.3f} ms eager>")


def format_advice(advice: Advice, heading: str = "##") -> str:
    """The markdown report of ``advice``."""
    s = advice.summary
    cost = advice.replay_cost
    kind = "training iteration" if advice.training else "call"
    rows = [
        (f"eager {kind}", f"{advice.eager_ms:.3f} ms"),
        (f"predicted graphed {kind}", f"{advice.predicted_ms:.3f} ms ({advice.graphs} graph"
                                      f"{'s' if advice.graphs != 1 else ''})"),
        ("predicted speedup", f"{advice.predicted_speedup:.2f}x"),
    ]
    compiled = advice.to_dict().get("compiled")
    if compiled:
        rows.append((f"predicted compiled + graphed {kind}",
                     f"{compiled['predicted_ms']:.3f} ms (fusible kernels "
                     f"{compiled['fusible_ms']:.3f} ms of {s['gpu_ms_per_iter']:.3f} ms; Note "
                     "[Predicting a compiled step])"))
    rows += [
        ("GPU activities per iteration",
         f"{s['activities_per_iter']:.0f} ({s['kernels_per_iter']:.0f} kernels)"),
        ("kernel time per iteration", f"{s['gpu_ms_per_iter']:.3f} ms"),
        ("activity duration p50 / p90 / max",
         f"{s['duration_p50_us']:.1f} / {s['duration_p90_us']:.1f} / "
         f"{s['duration_max_us']:.1f} us"),
        ("activities under 50 us", f"{100 * s['small_fraction']:.0f}%"),
        ("GPU busy, eager", f"{100 * advice.eager_gpu_busy:.0f}% (kernel time / eager time); "
                            f"{100 * s['gpu_busy_fraction']:.0f}% under the profiler"),
        ("GPU idle per iteration (profiled)",
         f"{s['idle_ms_per_iter']:.3f} ms; gaps p50 {s['gap_p50_us']:.1f} us, "
         f"p90 {s['gap_p90_us']:.1f} us"),
        ("host time per launch call",
         f"{s['launch_call_us']:.1f} us ({s['launches_per_iter']:.0f} calls per iteration); "
         f"{s['host_us_per_activity']:.1f} us of host time per GPU activity"),
        ("replay cost on this GPU",
         f"{cost['per_node_us']:.2f} us per node + {cost['launch_us']:.1f} us per launch"),
    ]
    lines = [f"{heading} graphed advice: {advice.description}", "",
             f"**{advice.verdict}**: predicted {advice.predicted_speedup:.2f}x; strategy "
             f"**{advice.strategy}**", "", advice.reason, "", "| | |", "|---|---:|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    lines.append("")
    if advice.blockers:
        lines.append(f"Capture blockers ({len(advice.blockers)}), from graphed.check:")
        for finding in advice.blockers:
            where = f" at {finding['file']}:{finding['line']}" if finding.get("file") else ""
            lines.append(f"- {finding['label']}: `{finding['op']}`{where}: {finding['fix']}")
    else:
        lines.append("Capture blockers: none found by graphed.check.")
    if advice.notes:
        lines += ["", "Notes:"] + [f"- {note}" for note in advice.notes]
    lines += ["", f"Device: {advice.device}. Prediction: kernel time + "
                  f"{s['activities_per_iter']:.0f} nodes x {cost['per_node_us']:.2f} us + "
                  f"{advice.graphs} x {cost['launch_us']:.1f} us (Note [Predicting the graphed "
                  "time] in src/advice.cpp)."]
    return "\n".join(lines)


def _require_gpu(what: str) -> None:
    if not torch.cuda.is_available():
        raise GraphedError(
            f"{what} profiles the workload on the GPU, and this machine has none "
            "(torch.cuda.is_available() is False). graphed.check works without a GPU.")


def _outermost_module_calls(fn: Callable[[], Any], roots: Sequence[nn.Module]
                            ) -> List[Tuple[nn.Module, tuple, dict]]:
    """Runs ``fn()`` once and returns the outermost submodule calls of ``roots``
    (not the roots themselves) with their arguments: the modules a per-module
    capture would graph, e.g. a GPT's embedding, each block, norm and head."""
    calls: List[Tuple[nn.Module, tuple, dict]] = []
    depth = [0]
    handles = []
    submodules = {id(m): m for root in roots for m in root.modules() if m is not root}

    def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if depth[0] == 0:
            calls.append((module, args, kwargs))
        depth[0] += 1

    def after(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        depth[0] -= 1

    try:
        for module in submodules.values():
            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(module.register_forward_hook(after, with_kwargs=True))
        fn()
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _locate_blockers(fn: Callable[[], Any], roots: Sequence[nn.Module]) -> Tuple[bool, int]:
    """(blockers sit between modules, module calls a per-module capture graphs).
    Checks every outermost module call on its own: when each is clean, what
    graphed.check found in the whole lies in the code between them."""
    if not roots:
        return False, 0
    calls = _outermost_module_calls(fn, roots)
    for module, args, kwargs in calls:
        if _check(module, *args, **kwargs):
            return False, len(calls)
    return bool(calls), len(calls)


def _modules_of(fn: Any) -> List[nn.Module]:
    if isinstance(fn, nn.Module):
        return [fn]
    from .train import _referenced_objects

    return [o for o in _referenced_objects(fn) if isinstance(o, nn.Module)]


def _device_name(device: torch.device) -> str:
    return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"


@dataclass
class TrialCapture:
    """What a trial capture decided about graphed.check's findings (Note
    [Capture is the verdict] in src/safety_check.cpp): ``captured`` True when
    CUDA recorded the whole function, so that none of ``findings`` reached the
    graph; else ``error`` is the capture's message (the operation and line
    that broke it)."""

    captured: bool
    findings: List[Dict[str, Any]]
    error: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        return {"captured": self.captured, "error": self.error, "findings": self.findings}


def _try_capture(capture_once: Callable[[], Any], findings: List[Dict[str, Any]]
                 ) -> TrialCapture:
    """Runs ``capture_once()`` (a capture whose result is dropped at once);
    a CaptureError is the verdict, anything else propagates."""
    try:
        capture_once()
        return TrialCapture(True, findings)
    except _C.CaptureError as error:
        return TrialCapture(False, findings, str(error))
    finally:
        if torch.cuda.is_available():
            torch.cuda.synchronize()


def _blockers_after_trial(report: Any, trial: Optional[TrialCapture]) -> List[Dict[str, Any]]:
    """The findings that count for the advice: none when a trial capture met
    none of them."""
    if trial is not None and trial.captured:
        return []
    return [f.to_dict() for f in report.findings]


def _trial_notes(report: Any, trial: Optional[TrialCapture]) -> List[str]:
    notes = []
    if report.harmless:
        notes.append(f"graphed.check saw {len(report.harmless)} harmless operation(s) that look "
                     "like blockers (copies of zero bytes) and did not count them.")
    if trial is None:
        return notes
    where = ", ".join(sorted({f"{f['op']} at {f['file']}:{f['line']}" if f.get("file")
                              else f["op"] for f in trial.findings}))
    if trial.captured:
        notes.append(f"graphed.check found {len(trial.findings)} operation(s) inside installed "
                     f"packages ({where}); a trial capture met none of "
                     "them, so they do not count (Note [Capture is the verdict]).")
    else:
        lines = (trial.error or "").strip().splitlines()
        notes.append(f"A trial capture failed: {lines[0] if lines else 'no message'}")
    return notes


def _advise_traced(*, trace: Dict[str, Any], eager_ms: float, device: torch.device,
                   blockers: List[Dict[str, Any]], between: bool, module_graphs: int,
                   shapes_vary: bool, training: bool, description: str,
                   notes: Sequence[str] = (), trial: Optional[TrialCapture] = None,
                   check_verdict: str = "clean") -> Advice:
    cost = _C.replay_cost(device.index if device.index is not None else 0)
    data = _C.advise_trace(trace, cost, eager_ms, blockers=len(blockers),
                           blockers_between_modules=between, module_graphs=max(module_graphs, 1),
                           shapes_vary=shapes_vary, training=training)
    data["notes"] = list(data.get("notes", [])) + list(notes)
    data["check_verdict"] = check_verdict
    data["trial_capture"] = trial.to_dict() if trial is not None else None
    data["check_false_findings"] = trial.findings if trial is not None and trial.captured else []
    return Advice(data, description=description, training=training, blockers=blockers,
                  trace=trace, device=_device_name(device))


def advise(fn: Callable[..., Any], *args: Any, other_inputs: Sequence[Any] = (),
           settings: Optional[ProfileSettings] = None, **kwargs: Any) -> Advice:
    """Profile ``fn(*args, **kwargs)`` and advise on capturing it as a CUDA graph.

    Runs graphed.check once, then warms ``fn`` up, times it with CUDA events
    and traces a few iterations with the Kineto profiler. Returns an
    :class:`Advice`: kernels per iteration and their durations, GPU busy
    share and idle gaps, host time per launch, the predicted time of the
    captured function and the speedup, a verdict and a strategy. ``fn`` runs
    as called (grad mode as it is): advise an inference function under
    ``torch.no_grad()`` if that is how it runs.

    A module's parameters, buffers and ``training`` flags and the default
    random generators are restored afterwards.

    Args:
        other_inputs: further argument tuples ``fn`` will be called with; when
            their tensor shapes differ from ``args``, the strategy is bucketed.
        settings: how many calls to warm up, time and trace.
    """
    _require_gpu("graphed.advise")
    settings = settings or ProfileSettings()
    device = first_cuda_device(args, kwargs, fn) or torch.device("cuda", torch.cuda.current_device())
    modules = _modules_of(fn)
    snapshots = [Snapshot(m) for m in modules] or [Snapshot(None)]
    call = lambda: fn(*args, **kwargs)  # noqa: E731
    trial: Optional[TrialCapture] = None
    try:
        report = _check(fn, *args, **kwargs)
        if report.verdict == "try_capture":
            from .capture import capture

            trial = _try_capture(lambda: capture(fn, *args, **kwargs),
                                 [f.to_dict() for f in report.findings])
        blockers = _blockers_after_trial(report, trial)
        between, module_graphs = _locate_blockers(call, modules) if blockers else (False, 0)
        for snapshot in snapshots:
            snapshot.restore()
        trace, eager_ms = _C.profile(call, settings.warmup, settings.timed_iters,
                                     settings.timed_repeats, settings.profiled_iters)
    finally:
        for snapshot in snapshots:
            snapshot.restore()
    shapes = tensor_shapes(args)
    shapes_vary = any(tensor_shapes(other if isinstance(other, tuple) else (other,)) != shapes
                      for other in other_inputs)
    return _advise_traced(trace=trace, eager_ms=eager_ms, device=device, blockers=blockers,
                          between=between, module_graphs=module_graphs, shapes_vary=shapes_vary,
                          training=False, description=describe(fn),
                          notes=_trial_notes(report, trial), trial=trial,
                          check_verdict=report.verdict)


def step_settings(settings: Any = None) -> StepSettings:
    """``settings`` as StepSettings: None is the plain step, a string is an
    ``amp`` setting (the form these functions took before they took more)."""
    if settings is None or isinstance(settings, str):
        return StepSettings(amp=settings)
    if not isinstance(settings, StepSettings):
        raise GraphedError(f"Expected StepSettings, an amp string or None, got "
                           f"{type(settings).__name__}.")
    return settings


def eager_training_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                        loss_fn: Optional[Callable[..., torch.Tensor]],
                        settings: Any = None) -> Callable[[Any], torch.Tensor]:
    """The usual eager step, in plain PyTorch: ``zero_grad()``, then per
    microbatch forward, loss divided by the number of microbatches and
    backward; with ``skip_nonfinite`` nothing more (the model's buffers put
    back) when the loss or a gradient is not finite; clipping with
    ``torch.nn.utils.clip_grad_norm_``; ``step()``. Returns the mean loss.
    The batch is in any form of Note [Batch forms] (python/graphed/train.py),
    split as TrainStep splits it, the forward called as the user would (no
    arguments added). ``settings``: StepSettings, or None, or an ``amp``
    string ("bf16": forward and loss under bf16 autocast, as TrainStep's)."""
    settings = step_settings(settings)
    parts = settings.microbatches
    params = [p for group in optimizer.param_groups for p in group["params"]]
    buffers = list(model.buffers())

    def step(batch: Any) -> torch.Tensor:
        optimizer.zero_grad()
        saved = [b.detach().clone() for b in buffers] if settings.skip_nonfinite else []
        total: Optional[torch.Tensor] = None
        for part in split_batch(batch, parts):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=settings.amp == "bf16"):
                loss = batch_loss(model, loss_fn, part)
            loss = loss.float() / parts if parts > 1 else loss
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None
        if settings.skip_nonfinite:
            grads = [p.grad for p in params if p.grad is not None]
            finite = bool(torch.isfinite(total).all()) and all(
                bool(torch.isfinite(g).all()) for g in grads)
            if not finite:
                with torch.no_grad():
                    for buffer, value in zip(buffers, saved):
                        buffer.copy_(value)
                return total
        if settings.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, settings.clip_grad_norm)
        optimizer.step()
        return total

    step.__qualname__ = f"eager step of {type(model).__name__}"
    return step


def _copies(model: nn.Module, optimizer: torch.optim.Optimizer
            ) -> Tuple[nn.Module, torch.optim.Optimizer]:
    try:
        return copy.deepcopy((model, optimizer))
    except Exception as error:  # noqa: BLE001 - any deepcopy failure has one remedy
        raise GraphedError(
            f"graphed needs a copy of the {type(model).__name__} model and its "
            f"{type(optimizer).__name__} to trace training steps without changing yours, but "
            f"copy.deepcopy failed: {type(error).__name__}: {error}. Make the model deep-copyable "
            "(no open files, locks or generators among its attributes).") from error


def advise_training(model: nn.Module, optimizer: torch.optim.Optimizer,
                    loss_fn: Optional[Callable[..., torch.Tensor]], sample_batch: Any, *,
                    settings: Optional[ProfileSettings] = None,
                    amp: Optional[str] = None, microbatches: int = 1,
                    clip_grad_norm: Optional[float] = None,
                    skip_nonfinite: bool = False) -> Advice:
    """Advice on capturing a whole training iteration with graphed.TrainStep.

    The trace is of the iteration TrainStep.from_parts captures (gradients
    dropped rather than zeroed, the optimizer fused or capturable), run eagerly
    on copies of ``model`` and ``optimizer``, so the prediction is of what the
    graph will run; the eager time is of the usual step (``zero_grad()``,
    forward, backward, ``step()``) with ``optimizer`` as configured, on other
    copies. ``model`` and ``optimizer`` are not touched. ``amp``,
    ``microbatches``, ``clip_grad_norm`` and ``skip_nonfinite`` are
    TrainStep.from_parts' settings (StepSettings), given to both steps.
    ``sample_batch`` is ``(inputs, targets)``, or a dict of model arguments
    (``loss_fn=None``: the model's own loss); see Note [Batch forms] in
    python/graphed/train.py.

    When graphed.check's findings are ones a capture may never meet (inside
    installed packages such as transformers), a trial capture of the step on
    further copies decides (Note [Capture is the verdict] in
    src/safety_check.cpp): the advice then predicts what will be captured,
    ``advice.trial_capture`` says what happened and
    ``advice.check_false_findings`` lists what the capture never met.
    """
    _require_gpu("graphed.advise_training")
    step = StepSettings(amp=amp, microbatches=microbatches, clip_grad_norm=clip_grad_norm,
                        skip_nonfinite=skip_nonfinite)
    settings = settings or ProfileSettings()
    check_batch_form(sample_batch, loss_fn)
    device = first_cuda_device(sample_batch, model) or torch.device(
        "cuda", torch.cuda.current_device())
    rng = Snapshot(None)
    trial: Optional[TrialCapture] = None
    try:
        eager_model, eager_optimizer = _copies(model, optimizer)
        eager = eager_training_step(eager_model, eager_optimizer, loss_fn, step)
        for _ in range(settings.warmup):
            eager(sample_batch)
        eager_ms = _C.time_ms(lambda: eager(sample_batch), settings.timed_iters,
                              settings.timed_repeats, 0)

        graph_model, graph_optimizer = _copies(model, optimizer)
        iteration, _ = training_iteration(graph_model, graph_optimizer, loss_fn, sample_batch,
                                          **step.from_parts_kwargs())
        report = _check(iteration, sample_batch)
        if report.verdict == "try_capture":
            trial = _trial_training_capture(model, optimizer, loss_fn, sample_batch, report, step)
        blockers = _blockers_after_trial(report, trial)
        between, module_graphs = (_locate_blockers(lambda: iteration(sample_batch), [graph_model])
                                  if blockers else (False, 0))
        for _ in range(settings.warmup):
            iteration(sample_batch)
        trace = _C.record_trace(lambda: iteration(sample_batch), settings.profiled_iters)
    finally:
        rng.restore()
    notes = list(getattr(iteration, "notes", [])) + _trial_notes(report, trial)
    return _advise_traced(trace=trace, eager_ms=eager_ms, device=device, blockers=blockers,
                          between=between, module_graphs=2 * module_graphs, shapes_vary=False,
                          training=True, description=f"training step of {describe(model)}",
                          notes=notes, trial=trial, check_verdict=report.verdict)


def _trial_training_capture(model: nn.Module, optimizer: torch.optim.Optimizer,
                            loss_fn: Optional[Callable[..., torch.Tensor]], sample_batch: Any,
                            report: Any, step: Optional[StepSettings] = None
                            ) -> TrialCapture:
    """TrainStep.from_parts on copies of ``model`` and ``optimizer``, released
    at once: does the step capture although graphed.check found something?"""
    from .train import TrainStep

    trial_model, trial_optimizer = _copies(model, optimizer)

    def capture_once() -> None:
        TrainStep.from_parts(trial_model, trial_optimizer, loss_fn, sample_batch,
                             **step_settings(step).from_parts_kwargs()).release()

    try:
        return _try_capture(capture_once, [f.to_dict() for f in report.findings])
    finally:
        del trial_model, trial_optimizer
