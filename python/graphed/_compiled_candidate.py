"""graphed.optimize's compiled candidate: the whole step over
torch.compile(model), built, verified and timed after the graphed one (Note [A
compiled candidate] in python/graphed/_compiled.py)."""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from . import measure
from ._compiled import CompileTimeout, time_limit
from ._optimize_report import OptimizeReport
from ._schedule import ScheduleRun
from ._verify import _flatten, _guard_state, _max_diff, _StepSnapshot, _then, _verify_step
from .advise import ProfileSettings
from .train import StepSettings, TrainStep, training_iteration


def _eager_random(options: Dict[str, Any]) -> Any:
    """While compiling: Inductor's random ops fall back to eager's (dropout
    masks from the same generator as the eager reference) unless ``options``
    set it; Note [A compiled candidate]."""
    inductor_options = options.get("options") or {}
    if options.get("backend", "inductor") != "inductor" or "fallback_random" in inductor_options:
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    return inductor_config.patch(fallback_random=True)


def compiled_candidate(report: OptimizeReport, model: nn.Module,
                        optimizer: torch.optim.Optimizer, loss_fn: Optional[Callable],
                        batch: Any, step_settings: StepSettings, options: Dict[str, Any],
                        timeout: Optional[float], back_to_start: Callable[[], None],
                        schedule: ScheduleRun,
                        eager: Callable[[Any], Any], expected: Tuple[Any, Any, float],
                        steps: int, settings: ProfileSettings
                        ) -> Tuple[Optional[TrainStep], Optional[_StepSnapshot]]:
    """The whole step over torch.compile(model), built, verified and timed
    (Note [A compiled candidate] in python/graphed/_compiled.py): the step
    and its snapshot when it is faster than the graphed candidate, else
    (None, None) with the model and optimizer restored."""
    entry = report.compiled
    entry["built"] = True
    started = time.perf_counter()
    step: Optional[TrainStep] = None
    captured: Optional[_StepSnapshot] = None
    try:
        compiled_model = torch.compile(model, **options)
        with time_limit(timeout, "building the compiled training step"), _eager_random(options):
            if _draws_random(model):
                # Inductor draws other random numbers than eager's dropout, even
                # through eager's generator: the graphs are verified against
                # the same compiled iteration run without graphs instead.
                expected = _compiled_reference(compiled_model, optimizer, loss_fn, batch,
                                               step_settings, steps, schedule)
                back_to_start()
                entry["verified_against"] = ("torch.compile(model) without graphs: its dropout "
                                             "draws other random numbers than eager's")
            step = TrainStep.from_parts(compiled_model, optimizer, loss_fn, batch,
                                        **step_settings.from_parts_kwargs())
        entry["compile_s"] = round(time.perf_counter() - started, 3)
        if timeout is not None and entry["compile_s"] > timeout:
            raise CompileTimeout(f"building the compiled training step took "
                                 f"{entry['compile_s']:.1f} s, past compile_timeout={timeout:g} s")
        captured = _StepSnapshot(model, optimizer, _guard_state(step), False)
        entry["max_abs_diff"] = _verify_step(step, model, batch, steps, schedule, expected,
                                             report.rtol, report.atol)
        captured.restore()
        compiled_step = step
        times = measure.compare_ms({"eager": lambda: eager(batch),
                                    "compiled": lambda: compiled_step(batch)},
                                   iters=settings.timed_iters, repeats=settings.timed_repeats)
        entry.update(ms=times["compiled"], eager_ms=times["eager"], graphed_ms=report.graphed_ms)
        if times["compiled"] < report.graphed_ms:
            entry["chosen"] = True
            report.graphed_ms, report.max_abs_diff = times["compiled"], entry["max_abs_diff"]
            report.notes += [n for n in getattr(step, "notes", []) if n not in report.notes]
            report.notes.append(
                f"the step is captured over torch.compile(model) (Inductor's fused kernels): "
                f"{times['compiled']:.3f} ms against {entry['graphed_ms']:.3f} ms without; "
                f"compiled and captured in {entry['compile_s']:.1f} s")
            return step, captured
    except Exception as error:  # noqa: BLE001 - a failed candidate leaves the graphed one
        entry["error"] = f"{type(error).__name__}: {error}"[:2000]
    entry.setdefault("compile_s", round(time.perf_counter() - started, 3))
    step = captured = None
    gc.collect()
    back_to_start()
    return None, None


def _draws_random(model: nn.Module) -> bool:
    """True when a module of ``model`` in training mode applies dropout."""
    for module in model.modules():
        if not module.training:
            continue
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        for name in ("attention_dropout", "dropout_p", "attn_dropout", "dropout"):
            value = getattr(module, name, None)
            if isinstance(value, float) and value > 0:
                return True
    return False


def _compiled_reference(compiled_model: nn.Module, optimizer: torch.optim.Optimizer,
                        loss_fn: Optional[Callable], batch: Any, step_settings: StepSettings,
                        steps: int, schedule: ScheduleRun
                        ) -> Tuple[List[Any], List[torch.Tensor], float]:
    """The iteration TrainStep will capture, over the compiled model, run
    ``steps`` times without graphs: the losses, parameters and largest
    learning rate the compiled candidate must reproduce. Compiles the model
    (the capture after it reuses the compiled code)."""
    iteration, _ = training_iteration(compiled_model, optimizer, loss_fn, batch,
                                      **step_settings.from_parts_kwargs())
    losses = [_then(iteration(batch).detach().clone(), schedule.step) for _ in range(steps)]
    params = [p.detach().clone() for p in compiled_model.parameters()]
    return losses, params, schedule.max_lr


def compiled_inference_candidate(report: OptimizeReport, model: Any, args: Tuple[Any, ...],
                                 graphed_fn: Callable[..., Any], expected: List[torch.Tensor],
                                 options: Dict[str, Any],
                                 timeout: Optional[float], settings: ProfileSettings
                                 ) -> Optional[Callable[..., Any]]:
    """graphed.capture over torch.compile(model), built, verified against the
    eager outputs and timed side by side with the graphed candidate (both
    live: inference graphs own no gradients): the compiled capture when it is
    faster, else None. Runs under torch.no_grad()."""
    from .capture import capture

    entry = report.compiled
    entry["built"] = True
    started = time.perf_counter()
    try:
        compiled_model = torch.compile(model, **options)
        with time_limit(timeout, "building the compiled capture"), _eager_random(options):
            fast = capture(compiled_model, *args)
        entry["compile_s"] = round(time.perf_counter() - started, 3)
        if timeout is not None and entry["compile_s"] > timeout:
            raise CompileTimeout(f"building the compiled capture took {entry['compile_s']:.1f} "
                                 f"s, past compile_timeout={timeout:g} s")
        entry["max_abs_diff"] = _max_diff(expected, _flatten(fast(*args)), report.rtol,
                                          report.atol, "outputs")
        times = measure.compare_ms({"eager": lambda: model(*args),
                                    "graphed": lambda: graphed_fn(*args),
                                    "compiled": lambda: fast(*args)},
                                   iters=settings.timed_iters, repeats=settings.timed_repeats)
        entry.update(ms=times["compiled"], eager_ms=times["eager"], graphed_ms=times["graphed"])
        if times["compiled"] < times["graphed"]:
            entry["chosen"] = True
            report.eager_ms, report.graphed_ms = times["eager"], times["compiled"]
            report.max_abs_diff = entry["max_abs_diff"]
            report.notes.append(
                f"captured over torch.compile(model) (Inductor's fused kernels): "
                f"{times['compiled']:.3f} ms against {times['graphed']:.3f} ms without; "
                f"compiled and captured in {entry['compile_s']:.1f} s")
            return fast
    except Exception as error:  # noqa: BLE001 - a failed candidate leaves the graphed one
        entry["error"] = f"{type(error).__name__}: {error}"[:2000]
    entry.setdefault("compile_s", round(time.perf_counter() - started, 3))
    gc.collect()
    return None
