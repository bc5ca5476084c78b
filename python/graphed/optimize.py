"""graphed.optimize: check, advise, apply the recommended capture strategy,
verify numerics against eager, measure, and report. On any failure, or when
the graph is not 1.05x faster, the model and optimizer are left exactly as
they were and the report says why."""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import re
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from . import _C, _progress, fsdp, measure
from ._C import GraphedError
from ._experts import capturable_experts
from ._compiled import torch_compile_options, worth_compiling
from ._compiled_candidate import compiled_candidate, compiled_inference_candidate
from ._optimize_report import OptimizeReport, describe_graphed_work, graphed_work
from ._schedule import ScheduleRun, check_scheduler
from ._state import RngSnapshot, Snapshot, describe
from ._verify import _flatten, _guard_state, _max_diff, _Rejected, _StepSnapshot, _then, _verify_step
from .advise import (Advice, ProfileSettings, _copies, _outermost_module_calls, advise,
                     advise_training, eager_training_step)
from .capture import capture
from .train import StepSettings, TrainStep, batch_loss, check_batch_form, split_batch

Progress = Callable[[str], None]

logger = logging.getLogger(__name__)





# --- strategies -----------------------------------------------------------------
# Note [Strategy table]
# ~~~~~~~~~~~~~~~~~~~~~
# Each strategy advise() can recommend maps to how optimize applies it, for
# inference and for training. An applier returns (graphed callable, undo);
# undo() takes back whatever the applier changed in place (patched forwards),
# and is called before the snapshot is restored when anything fails.
# `in_place` appliers change the model itself, so eager is timed before they
# run rather than side by side. A strategy is applied only where its applier
# is available in this version; per-module graphs need
# graphed.make_graphed_callables, bucketed graphs graphed.auto.

Undo = Callable[[], None]


def _nothing() -> None:
    return None


def _capture_whole(fn: Callable[..., Any], args: Tuple[Any, ...]) -> Tuple[Callable, Undo]:
    return capture(fn, *args), _nothing


def _train_whole(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable,
                 batch: Any, step: StepSettings) -> Tuple[Callable, Undo]:
    return TrainStep.from_parts(model, optimizer, loss_fn, batch,
                                **step.from_parts_kwargs()), _nothing


def _graph_modules(model: nn.Module, run_once: Callable[[], Any],
                   amp: Optional[str] = None) -> Undo:
    """Replaces the outermost submodule calls of ``model`` by graphed ones
    (graphed.make_graphed_callables, torch's signature), in place."""
    import graphed

    calls = _outermost_module_calls(run_once, [model])
    modules, samples, seen = [], [], set()
    for module, args, kwargs in calls:
        if id(module) in seen:
            continue  # a module called twice keeps its first sample
        if kwargs:
            raise GraphedError(f"per-module capture passes positional arguments only; "
                               f"{type(module).__name__} was called with keywords {sorted(kwargs)}")
        seen.add(id(module))
        modules.append(module)
        samples.append(tuple(a.detach().clone().requires_grad_(a.requires_grad)
                             if isinstance(a, torch.Tensor) else a for a in args))
    had_forward = [("forward" in vars(m), vars(m).get("forward")) for m in modules]
    # Under amp the modules run inside the step's autocast: captured there too.
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp == "bf16"):
        graphed.make_graphed_callables(tuple(modules), tuple(samples))

    def undo() -> None:
        for module, (had, forward) in zip(modules, had_forward):
            if had:
                module.forward = forward
            elif "forward" in vars(module):
                del module.forward

    return undo


def _per_module(fn: Callable[..., Any], args: Tuple[Any, ...]) -> Tuple[Callable, Undo]:
    if not isinstance(fn, nn.Module):
        raise GraphedError("per-module capture needs an nn.Module, got " + describe(fn))
    return fn, _graph_modules(fn, lambda: fn(*args))


def _train_per_module(model: nn.Module, optimizer: torch.optim.Optimizer,
                      loss_fn: Optional[Callable], batch: Any,
                      step: StepSettings) -> Tuple[Callable, Undo]:
    sample = split_batch(batch, step.microbatches)[0]  # the shapes the modules will see

    def run_once() -> Any:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=step.amp == "bf16"):
            return batch_loss(model, loss_fn, sample)

    undo = _graph_modules(model, run_once, step.amp)
    return eager_training_step(model, optimizer, loss_fn, step), undo


@dataclass
class _Strategy:
    inference: Callable[..., Tuple[Callable, Undo]]
    training: Callable[..., Tuple[Callable, Undo]]
    needs: Optional[str] = None  # the graphed attribute the strategy relies on
    in_place: bool = False

    def missing(self) -> Optional[str]:
        import graphed

        return self.needs if self.needs and not hasattr(graphed, self.needs) else None


def _no_inference_per_block(fn: Callable[..., Any], args: Tuple[Any, ...]
                            ) -> Tuple[Callable, Undo]:
    raise _Rejected("per-block graphs are tried for training steps only")


def _train_per_block(model: nn.Module, optimizer: torch.optim.Optimizer,
                     loss_fn: Optional[Callable], batch: Any,
                     step_settings: StepSettings) -> Tuple[Callable, Undo]:
    """graphed.auto on the model, the optimizer eager: Note [Per-block graphs
    when the step cannot be captured]."""
    import graphed

    graphed.auto(model)
    step = eager_training_step(model, optimizer, loss_fn, step_settings)
    step.notes = graphed.auto_stats(model)["notes"]  # type: ignore[attr-defined]
    step.auto_model = model  # type: ignore[attr-defined]
    return step, lambda: graphed.auto_undo(model)


STRATEGIES: Dict[str, _Strategy] = {
    "full_capture": _Strategy(_capture_whole, _train_whole),
    "per_module": _Strategy(_per_module, _train_per_module, needs="make_graphed_callables",
                            in_place=True),
    "bucketed": _Strategy(_capture_whole, _train_whole, needs="auto"),
    "per_block": _Strategy(_no_inference_per_block, _train_per_block, needs="auto",
                           in_place=True),
}

# Note [Per-block graphs when the step cannot be captured]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A whole training step fails to capture when anything in it cannot be
# captured: a host read in the user's loop, or code inside a library around
# the blocks (transformers built gpt-oss's eager attention mask with a
# host-to-device copy of a scalar, until Note [An eager-attention mask a graph
# can hold] replaced it while capturing). Most of those sit outside the repeated
# blocks that hold the kernels, so instead of refusing, optimize tries
# graphed.auto on the model (per-block graphs of forward and backward, the
# optimizer eager; blocks that still cannot be captured run their own
# forward), verifies it against eager like any strategy after the warm-up
# steps auto needs, and keeps it only if it is faster. report.strategy is
# "per_block", report.reason says why the whole step could not be captured,
# report.notes what auto graphed, and report.parts, per block that cannot be
# captured either, the parts graphed in its place (Note [Graphing the parts
# of a block] in include/graphed/module_selection.h). graphed.auto_undo puts the
# model back when it is not kept (Note [Undoing graphed.auto]).


# --- the report -------------------------------------------------------------------


# --- optimize ----------------------------------------------------------------------


def _package_of(path: str) -> Optional[str]:
    """``transformers/integrations/moe.py`` for a file inside an installed
    package, else None."""
    for marker in ("/site-packages/", "/dist-packages/", "\\site-packages\\"):
        if marker in path:
            return path.split(marker, 1)[1].replace("\\", "/")
    return None


def _where_blockers_sit(blockers: Sequence[Dict[str, Any]]) -> str:
    """The reason optimize gives for blockers that stop it: where they are (the
    user's file, or an installed package's, named as the package's) and what
    to do about each kind."""
    places = []
    for blocker in blockers:
        path, line = blocker.get("file"), blocker.get("line")
        where = _package_of(path) if path else None
        if where is None and path:
            where = f"{path}"
        label = blocker.get("label") or blocker.get("op") or "an operation"
        if where:
            places.append((bool(blocker.get("in_installed_package")),
                           f"{label} at {where}:{line}"))
        else:
            places.append((False, label))
    in_packages = [text for inside, text in places if inside]
    in_user_code = [text for inside, text in places if not inside]
    if in_packages and not in_user_code:
        return ("capture blockers sit inside installed packages, not in your code: "
                f"{'; '.join(in_packages[:3])}. graphed has no capturable replacement for "
                "them: keep those modules out of the graphs (graphed.auto(modules=...) graphs "
                "the others), or report it to graphed with the lines above")
    listed = "; ".join(in_user_code[:3]) or "see the advice below"
    return (f"capture blockers sit inside the modules, in your code: {listed}; fix what "
            "graphed.check lists (see the advice below)")


def _compiled_speedup(advice: Advice,
                      compile_choice: Tuple[str, Optional[Dict[str, Any]]]) -> Optional[float]:
    """advise's predicted speedup of the compiled step over eager, where a
    compiled candidate may be built (compile= not off), else None."""
    compiled = advice.to_dict().get("compiled")
    if compile_choice[0] == "off" or not compiled or not compiled.get("predicted_ms"):
        return None
    return advice.eager_ms / compiled["predicted_ms"]


def _choose(advice: Advice, force: bool,
            compile_choice: Tuple[str, Optional[Dict[str, Any]]] = ("off", None)) -> str:
    strategy = advice.strategy
    if strategy == "fix_blockers":
        trial = advice.trial_capture
        if trial is not None and not trial["captured"]:
            lines = (trial["error"] or "").strip().splitlines()
            raise _Rejected("a trial capture failed, so graphs cannot be applied as the code "
                            f"stands: {lines[0] if lines else 'no message'} (the advice below "
                            "lists what graphed.check found)")
        kinds = {f.get("severity") for f in advice.blockers}
        if "spoils_replay" in kinds:
            raise _Rejected("graphed.check found operations that would freeze values into the "
                            "graph (a capture would succeed and replay stale data); fix what it "
                            "lists (see the advice below)")
        raise _Rejected(_where_blockers_sit(advice.blockers))
    if strategy == "stay_eager":
        # Graphs alone would not pay, but Inductor's fusion may: a GPU-bound
        # step is where fewer kernels matter most (Note [A compiled candidate]).
        # The compiled prediction must clear the bar graphs alone missed
        # (AdviceInputs::helps_above).
        compiled = _compiled_speedup(advice, compile_choice)
        bar = advice.to_dict().get("helps_above", 1.2)
        if not force and (compiled is None or compiled < bar):
            also = ("" if compiled is None else
                    f", {compiled:.2f}x compiled")
            raise _Rejected(f"{advice.verdict}: predicted {advice.predicted_speedup:.2f}x"
                            f"{also}; pass force=True to apply graphs anyway")
        return "full_capture"
    missing = STRATEGIES[strategy].missing()
    if missing:
        raise _Rejected(f"the recommended strategy {strategy} needs graphed.{missing}, which this "
                        "version of graphed does not have")
    return strategy


def _per_block_note(model: nn.Module, why: str, work: Dict[str, float]
                    ) -> Tuple[str, Dict[str, Any]]:
    """What per-block graphs graphed and left eager, and how much of the
    step's GPU work that puts in graphs, for report.notes; auto's
    ``stats()["parts"]`` for report.parts."""
    import graphed

    stats = graphed.auto_stats(model)
    blocks = {n: m for n, m in stats["modules"].items() if "part_of" not in m}
    graphed_names = [n for n, m in blocks.items() if m.get("replays", 0) > 0]
    eager = {f["module"]: f["reason"] for f in stats["fallbacks"] if f["module"] in blocks}
    text = (f"per-block graphs (graphed.auto, the optimizer eager): {len(graphed_names)} of "
            f"{len(blocks)} blocks graphed")
    if eager:
        first, reason = next(iter(eager.items()))
        text += (f"; {len(eager)} run eagerly, e.g. {first or '<root>'}: "
                 f"{reason.splitlines()[0][:300]}")
    parts = stats["parts"]
    if parts:
        graphed_parts = sorted({_kind(n) for p in parts.values() for n in p["graphed"]})
        eager_parts = {_kind(n): r for p in parts.values() for n, r in p["eager"].items()}
        text += (f"; in place of {len(parts)} module(s) that cannot be captured, their parts: "
                 f"graphed {', '.join(graphed_parts) or 'none'}")
        if eager_parts:
            kind, reason = next(iter(eager_parts.items()))
            text += (f"; eager {', '.join(eager_parts)} (e.g. {kind}: "
                     f"{reason.splitlines()[0][:200]}) and the code between the parts")
    if work:
        text += f". Graphs run {describe_graphed_work(work)}"
    return text + f". The whole step could not be captured: {why}", parts


def _kind(name: str) -> str:
    """``blocks.3.attn`` -> ``blocks.*.attn``: one entry per repeated part."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _no_progress(stage: str) -> None:
    return None


class _LoggedStages:
    """Calls ``progress(stage)`` and logs each stage at DEBUG."""

    def __init__(self, progress: Progress, what: str) -> None:
        self._progress = progress
        self._what = what

    def __call__(self, stage: str) -> None:
        logger.debug("optimize %s: %s", self._what, stage)
        self._progress(stage)


def optimize(model: Any, optimizer: Optional[torch.optim.Optimizer] = None,
             loss_fn: Optional[Callable[..., torch.Tensor]] = None, *, sample_batch: Any,
             rtol: float = 1e-3, atol: float = 1e-4, verify_steps: int = 3,
             force: bool = False, settings: Optional[ProfileSettings] = None,
             progress: Union[Progress, bool, None] = None,
             amp: Optional[str] = None, microbatches: int = 1,
             clip_grad_norm: Optional[float] = None,
             skip_nonfinite: bool = False, scheduler: Any = None,
             compile: Union[bool, str, Dict[str, Any]] = False,
             compile_timeout: Optional[float] = 600.0) -> OptimizeReport:
    """Make ``model`` (or a training step of it) run as CUDA graphs, if that pays.

    Inference form, ``optimize(model, sample_batch=x)``: ``model`` is a module or
    function, ``sample_batch`` its input (a tensor or a tuple of arguments); it
    runs under ``torch.no_grad()``. Training form, ``optimize(model, optimizer,
    loss_fn, sample_batch=(inputs, targets))``: the step is zero-grad, forward,
    ``loss_fn(model(inputs), targets)``, backward, ``optimizer.step()``. A
    dict batch calls ``model(**batch)``, and with ``loss_fn=None`` the loss is
    the model's own (``output.loss``: transformers models given ``labels``),
    e.g. ``optimize(hf_model, optimizer, None, sample_batch={"input_ids": ids,
    "labels": ids})``; see Note [Batch forms] in python/graphed/train.py.

    Steps: graphed.check and graphed.advise (advise_training); where the
    check's findings may never meet a capture (inside installed packages such
    as transformers), a trial capture decides (Note [Capture is the verdict]
    in src/safety_check.cpp) and ``report.check_false_findings`` lists what it
    never met; apply the recommended strategy (graphed.capture,
    graphed.TrainStep, or per-module graphs where available); verify outputs
    (inference) or ``verify_steps`` losses and the parameters after them
    (training) against eager within ``rtol``/``atol``; time eager and graphed
    side by side; report. ``report.notes`` says what graphed changed to apply
    graphs (``use_cache=False`` in a transformers training step).

    Training form, the step's settings, as :meth:`graphed.TrainStep.from_parts`
    takes them, in the eager reference and in the graphs alike (the eager
    reference is plain PyTorch: graphed.advise.eager_training_step):
    ``amp="bf16"``, forward and loss under bf16 autocast, the weights and
    optimizer as they are (fp32 master weights, the usual mixed precision);
    ``microbatches``, the batch split along dim 0 and the gradients
    accumulated; ``clip_grad_norm``, ``torch.nn.utils.clip_grad_norm_``'s
    clipping before the optimizer step; ``skip_nonfinite``, a step whose loss
    or gradients are not finite changes nothing; ``scheduler``, a learning-rate
    scheduler of ``optimizer``: each verify step is followed by
    ``scheduler.step()`` (the eager reference steps a copy of it), and the
    scheduler and learning rates are put back afterwards. A schedule reaches
    the applied step without recapture (its learning rate is a device tensor
    the scheduler fills in place): keep calling ``scheduler.step()`` in your
    loop.

    ``compile`` (whole captures: a training step or an inference call):
    ``False`` (the default) captures the model as it is; ``True`` or a dict
    of torch.compile's arguments also builds the step (or the call) over
    ``torch.compile(model)`` (Inductor's fused kernels, captured by
    graphed), verifies it against the same eager reference, times it, and
    keeps the faster; ``"auto"`` does so only where
    advise predicts the compiled step at least 8% faster (Note [Predicting a
    compiled step] in src/compile_estimate.cpp). Modes that record CUDA graphs
    of their own (reduce-overhead, max-autotune) are refused.
    ``compile_timeout`` (seconds, None for no limit) bounds building the
    compiled candidate. ``report.compiled`` says what was built, its time,
    its build time and the choice (Note [A compiled candidate] in
    python/graphed/_compiled.py).

    Returns an :class:`OptimizeReport`, true when graphs were applied: use
    ``report.fn(*args)`` or ``report.step(batch)``. When anything fails, the
    numerics differ or the graph is not 1.05x faster (unless ``force``), the model,
    optimizer and random generators are restored exactly and ``report.reason``
    says why. After a training step is applied, the optimizer is fused or
    capturable and each ``.grad`` is the graph's buffer (see TrainStep); the
    weights and optimizer state are those you passed in.

    ``progress``: by default (None) a progress bar of the stages is drawn on
    stderr when it is a terminal (tqdm's or rich's when installed; never with
    ``GRAPHED_PROGRESS=0``); False draws none; a callable is called as
    ``progress(stage)`` as each stage starts instead. The stages and the
    outcome are also logged to the ``graphed.optimize`` logger.
    """
    settings = settings or ProfileSettings()
    fsdp.refuse("graphed.optimize", model,
                "its eager reference trains a deep copy of the model, and FSDP2 modules cannot be "
                "copied (their parameters are shards of a process group's tensors).")
    if optimizer is not None:
        if not isinstance(model, nn.Module):
            raise GraphedError(
                "The training form is optimize(model, optimizer, loss_fn, sample_batch=(inputs, "
                f"targets)) with an nn.Module model; got model {type(model).__name__}.")
        check_batch_form(sample_batch, loss_fn)
    step = StepSettings(amp=amp, microbatches=microbatches, clip_grad_norm=clip_grad_norm,
                        skip_nonfinite=skip_nonfinite)
    check_scheduler(scheduler, optimizer)
    compile_choice = torch_compile_options(compile, "training step", allow_auto=True)
    if optimizer is None and step != StepSettings():
        raise GraphedError(
            f"{step.describe()} applies to the training form of optimize (with an optimizer); "
            "for inference, call optimize inside torch.autocast instead of passing amp.")
    bar: Optional[_progress.Progress] = None
    if progress is None or progress is True:
        bar = _progress.Progress(4 if optimizer is None else 5, "graphed.optimize",
                                 show=True if progress is True else None)
        progress = bar
    elif progress is False:
        progress = _no_progress
    elif not callable(progress):
        raise TypeError(f"progress must be None, a bool or a callable, got "
                        f"{type(progress).__name__}")
    stages = _LoggedStages(progress, "inference" if optimizer is None else "training step")
    try:
        if optimizer is None:
            report = _optimize_inference(model, sample_batch, rtol, atol, force, settings, stages,
                                         compile_choice, compile_timeout)
        else:
            report = _optimize_training(model, optimizer, loss_fn, sample_batch, rtol, atol,
                                        verify_steps, force, settings, stages, step, scheduler,
                                        compile_choice, compile_timeout)
    finally:
        if bar is not None:
            bar.close()
    if report.applied:
        logger.info("optimize %s: applied %s", report.description, report.reason)
    else:
        logger.info("optimize %s: not applied: %s", report.description, report.reason)
    return report


def _build_compiled(report: OptimizeReport,
                    compile_choice: Tuple[str, Optional[Dict[str, Any]]]) -> bool:
    """Whether to build the compiled candidate (Note [A compiled candidate]);
    records the decision and its reason in ``report.compiled``."""
    choice, options = compile_choice
    if choice == "off":
        return False
    build, why = worth_compiling(choice, report.advice)
    if build and report.strategy != "full_capture":
        build, why = False, (f"not built: the {report.strategy} strategy runs eager code between "
                             "graphs; compile applies to a whole capture")
    report.compiled = {"built": False, "why": why, "chosen": False, "options": options}
    return build


# Note [A candidate must be clearly faster]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# optimize keeps graphs only when they beat eager by MIN_SPEEDUP. A graphed
# step that is 2% faster in optimize's own measurement is not faster for the
# user: on the GPU machine's loaded host the same step times several percent
# apart from one measurement to the next (the hand-written MoE's per-block
# graphs measured 1.06x inside optimize and 0.935x in the benchmark that ran
# right after it, session 24), and graphs that do not pay still cost their
# memory, their replay-order rules and their fallbacks. The per-block case
# meets this most: where a loop that no graph can hold is most of the step,
# graphing the rest gains a few percent at best. force=True keeps any
# candidate that matches eager.
MIN_SPEEDUP = 1.05


def _reject_if_slower(report: OptimizeReport, force: bool) -> None:
    """The graphed candidate (the one kept) must beat eager clearly, unless
    forced (Note [A candidate must be clearly faster])."""
    if report.graphed_ms * MIN_SPEEDUP > report.eager_ms and not force:
        speedup = report.eager_ms / report.graphed_ms
        raise _Rejected(f"the graph is not clearly faster: {report.graphed_ms:.3f} ms against "
                        f"{report.eager_ms:.3f} ms eager ({speedup:.2f}x; optimize keeps graphs "
                        f"{MIN_SPEEDUP:.2f}x faster or more, force=True keeps them anyway)")


def _fail(report: OptimizeReport, error: BaseException) -> None:
    if isinstance(error, _Rejected):
        report.reason = str(error)
    else:
        report.reason = f"{type(error).__name__}: {error}"
        report.error = traceback.format_exc()
    report.applied = False
    report.fn = None


# Note [Timing candidates by time, not by count]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# optimize times each candidate side by side with eager in rounds of
# ``timed_iters`` calls (median of ``timed_repeats`` rounds). A round of 10
# calls is right for the launch-bound steps graphs are for (a millisecond or
# a few), but a 25 ms step (timm ConvNeXt-T at batch 16) then spends half a
# second per method and measurement, several seconds of optimize's run where
# its whole budget is that of torch.compile's first steps (issue 26). Once
# advise has timed the eager step, a round is cut to about
# TIMED_MS_PER_ROUND of eager time (never under MIN_TIMED_ITERS calls): a
# round of four 25 ms steps is still a thousand times the clock's
# resolution, and the repeats, not the round's length, carry the noise.
TIMED_MS_PER_ROUND = 100.0
MIN_TIMED_ITERS = 3


def timing_settings(settings: ProfileSettings, eager_ms: Optional[float]) -> ProfileSettings:
    """``settings`` with ``timed_iters`` cut to about TIMED_MS_PER_ROUND of
    eager time per round (Note [Timing candidates by time, not by count])."""
    if not eager_ms or eager_ms <= 0 or settings.timed_iters <= MIN_TIMED_ITERS:
        return settings
    iters = max(MIN_TIMED_ITERS, min(settings.timed_iters,
                                     math.ceil(TIMED_MS_PER_ROUND / eager_ms)))
    return dataclasses.replace(settings, timed_iters=iters)


def _trace_replays(fn: Callable[[], Any]) -> Optional[Dict[str, Any]]:
    try:
        return _C.record_trace(fn, 3)
    except Exception:  # noqa: BLE001 - e.g. the caller profiles already; timelines are optional
        return None


def _optimize_inference(model: Any, sample_batch: Any, rtol: float, atol: float, force: bool,
                        settings: ProfileSettings, progress: Progress,
                        compile_choice: Tuple[str, Optional[Dict[str, Any]]] = ("off", None),
                        compile_timeout: Optional[float] = None) -> OptimizeReport:
    args = sample_batch if isinstance(sample_batch, tuple) else (sample_batch,)
    report = OptimizeReport(describe(model), training=False, rtol=rtol, atol=atol)
    snapshot = Snapshot(model if isinstance(model, nn.Module) else None)
    undo: Undo = _nothing
    try:
        with torch.no_grad():
            progress("check and advise")
            report.advice = advise(model, *args, settings=settings)
            settings = timing_settings(settings, report.advice.eager_ms)
            report.check_false_findings = list(report.advice.check_false_findings)
            report.strategy = _choose(report.advice, force, compile_choice)
            strategy = STRATEGIES[report.strategy]
            expected = [t.clone() for t in _flatten(model(*args))]
            if strategy.in_place:
                report.eager_ms = measure.cuda_time_ms(lambda: model(*args),
                                                       iters=settings.timed_iters,
                                                       repeats=settings.timed_repeats)
            progress(f"apply {report.strategy}")
            fast, undo = strategy.inference(model, args)
            progress("verify")
            report.max_abs_diff = _max_diff(expected, _flatten(fast(*args)), rtol, atol, "outputs")
            progress("measure")
            if strategy.in_place:
                report.graphed_ms = measure.cuda_time_ms(lambda: fast(*args),
                                                         iters=settings.timed_iters,
                                                         repeats=settings.timed_repeats)
            else:
                times = measure.compare_ms({"eager": lambda: model(*args),
                                            "graphed": lambda: fast(*args)},
                                           iters=settings.timed_iters,
                                           repeats=settings.timed_repeats)
                report.eager_ms, report.graphed_ms = times["eager"], times["graphed"]
            build_compiled = _build_compiled(report, compile_choice)
            if not build_compiled:
                _reject_if_slower(report, force)
            else:
                progress("compiled candidate")
                faster = compiled_inference_candidate(report, model, args, fast, expected,
                                                      compile_choice[1], compile_timeout,
                                                      settings)
                fast = faster or fast
                _reject_if_slower(report, force)  # the faster of the two beats eager
            report.graphed_trace = _trace_replays(lambda: fast(*args))
            report.graphed_work = graphed_work(report.graphed_trace)
        report.applied, report.fn = True, fast
        report.reason = (f"{report.strategy}: {report.speedup:.2f}x faster than eager, outputs "
                         "match")
        if report.compiled.get("chosen"):
            report.reason += "; captured over torch.compile(model), faster than without"
        snapshot.rng.restore()
    except Exception as error:  # noqa: BLE001 - every failure is reported, state restored
        _fail(report, error)
        undo()
        snapshot.restore()
    return report


def _optimize_training(model: nn.Module, optimizer: torch.optim.Optimizer,
                       loss_fn: Callable[..., torch.Tensor], batch: Any, rtol: float,
                       atol: float, verify_steps: int, force: bool, settings: ProfileSettings,
                       progress: Progress, step_settings: StepSettings,
                       scheduler: Any = None,
                       compile_choice: Tuple[str, Optional[Dict[str, Any]]] = ("off", None),
                       compile_timeout: Optional[float] = None) -> OptimizeReport:
    report = OptimizeReport(f"training step of {describe(model)}", training=True, rtol=rtol,
                            atol=atol, verify_steps=verify_steps,
                            step_settings=step_settings.from_parts_kwargs(),
                            scheduler=None if scheduler is None else type(scheduler).__name__)
    snapshot = Snapshot(model, optimizer)
    schedule = ScheduleRun(scheduler, optimizer)
    undo: Undo = _nothing
    try:
        progress("check and advise")
        report.advice = advise_training(model, optimizer, loss_fn, batch, settings=settings,
                                        **step_settings.from_parts_kwargs())
        settings = timing_settings(settings, report.advice.eager_ms)
        report.check_false_findings = list(report.advice.check_false_findings)
        whole_step_blocked: Optional[str] = None
        try:
            report.strategy = _choose(report.advice, force, compile_choice)
        except _Rejected as rejected:
            if report.advice.strategy != "fix_blockers":
                raise
            # Note [Per-block graphs when the step cannot be captured].
            whole_step_blocked, report.strategy = str(rejected), "per_block"
        strategy = STRATEGIES[report.strategy]
        # graphed.auto warms each block up (3 calls) and captures on the next;
        # the parts of a block that cannot be captured take as long again, per
        # level (Note [Graphing the parts of a block]): three levels here.
        warm_steps = 12 if report.strategy == "per_block" else 0
        steps = warm_steps + verify_steps

        progress("eager reference")
        reference_model, reference_optimizer = _copies(model, optimizer)
        # The reference runs the kernels the graphs will (transformers' experts
        # on graphed's grouped GEMM where torch's cannot be captured): verify
        # compares graphs with eager, not one GEMM with another, which routing
        # to experts would turn into other experts within a few steps.
        capturable_experts(reference_model)
        eager = eager_training_step(reference_model, reference_optimizer, loss_fn,
                                    step_settings)
        reference_schedule = schedule.for_copy(reference_optimizer)
        rng = RngSnapshot()
        expected_losses = [_then(eager(batch), reference_schedule.step) for _ in range(steps)]
        expected_params = [p.detach().clone() for p in reference_model.parameters()]
        rng.restore()

        progress(f"apply {report.strategy}")
        step, undo = strategy.training(model, optimizer, loss_fn, batch, step_settings)
        report.notes = list(getattr(step, "notes", []))
        captured = _StepSnapshot(model, optimizer, _guard_state(step),
                                 eager_optimizer=report.strategy == "per_block")

        progress("verify")
        expected = (expected_losses, expected_params, reference_schedule.max_lr)
        report.max_abs_diff = _verify_step(step, model, batch, steps, schedule, expected,
                                           rtol, atol)
        captured.restore()

        progress("measure")
        times = measure.compare_ms({"eager": lambda: eager(batch), "graphed": lambda: step(batch)},
                                   iters=settings.timed_iters, repeats=settings.timed_repeats)
        report.eager_ms, report.graphed_ms = times["eager"], times["graphed"]
        build_compiled = _build_compiled(report, compile_choice)
        if whole_step_blocked is not None:
            # Said whether or not the graphs are kept: what per-block graphs
            # reach, and what stays eager, is the answer to "why so little".
            note, report.parts = _per_block_note(step.auto_model, whole_step_blocked, {})
            report.notes.append(note)
        if not build_compiled:
            try:
                _reject_if_slower(report, force)
            except _Rejected as slower:
                if whole_step_blocked is None:
                    raise
                raise _Rejected(f"per_block: {slower}. The whole step could not be captured "
                                f"({whole_step_blocked}); report.notes and report.parts say "
                                "what the per-block graphs held and what stays eager") from None
        captured.restore()
        if build_compiled:
            # Note [A compiled candidate] in python/graphed/_compiled.py.
            progress("compiled candidate")
            step = captured = None  # the graphed candidate's graphs and buffers go
            gc.collect()

            def back_to_reference_start() -> None:
                snapshot.restore()
                rng.restore()  # the verify steps start where the eager reference started
                schedule.restore()

            back_to_reference_start()
            step, captured = compiled_candidate(
                report, model, optimizer, loss_fn, batch, step_settings, compile_choice[1],
                compile_timeout, back_to_reference_start, schedule, eager, expected, steps,
                settings)
            if step is None:  # the graphed candidate wins: captured again, as verified
                _reject_if_slower(report, force)
                step, undo = strategy.training(model, optimizer, loss_fn, batch, step_settings)
                captured = _StepSnapshot(model, optimizer, _guard_state(step), False)
            _reject_if_slower(report, force)  # the faster of the two beats eager
        report.graphed_trace = _trace_replays(lambda: step(batch))
        report.graphed_work = graphed_work(report.graphed_trace)
        captured.restore()
        report.applied, report.fn = True, step
        report.reason = (f"{report.strategy}: {report.speedup:.2f}x faster than eager; "
                         f"{steps} steps match eager")
        if report.compiled.get("chosen"):
            report.reason += "; the step runs over torch.compile(model), faster than without"
        if whole_step_blocked is not None:
            # The same note, now with the share of the step's GPU work in graphs.
            report.notes[report.notes.index(note)], report.parts = _per_block_note(
                step.auto_model, whole_step_blocked, report.graphed_work)
            report.reason += f" (the whole step could not be captured: {whole_step_blocked})"
    except Exception as error:  # noqa: BLE001 - every failure is reported, state restored
        _fail(report, error)
        undo()
        snapshot.restore()
        schedule.restore()
    return report
