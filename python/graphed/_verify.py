"""How graphed.optimize compares a candidate with eager: outputs, losses and
parameters within rtol/atol, and the training state restored in place
between the verify steps, the timing and the next candidate."""

from __future__ import annotations

import copy
from typing import Any, Callable, List, Sequence, Tuple

import torch
from torch import nn

from ._schedule import ScheduleRun
from ._state import ValueSnapshot
from .train import training_state


class _Rejected(Exception):
    """A step decided not to apply graphs; the message says why."""


def _flatten(value: Any) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for k in sorted(value, key=str) for t in _flatten(value[k])]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flatten(v)]
    return []


def _max_diff(expected: Sequence[torch.Tensor], got: Sequence[torch.Tensor], rtol: float,
              atol: float, what: str) -> float:
    if len(expected) != len(got):
        raise _Rejected(f"the graphed {what} has {len(got)} tensors, eager {len(expected)}")
    worst = 0.0
    for index, (e, g) in enumerate(zip(expected, got)):
        if e.shape != g.shape:
            raise _Rejected(f"{what} tensor {index}: graphed shape {tuple(g.shape)}, eager "
                            f"{tuple(e.shape)}")
        diff = (e.float() - g.float()).abs()
        worst = max(worst, diff.max().item() if diff.numel() else 0.0)
        if not torch.allclose(g.float(), e.float(), rtol=rtol, atol=atol):
            raise _Rejected(f"graphed {what} differ from eager: tensor {index} has max |diff| "
                            f"{diff.max().item():.3g}, beyond rtol={rtol:g}, atol={atol:g}")
    return worst


class _StepSnapshot:
    """The values a training step changes, restored in place after verify and
    measure. An eager optimizer (per-block graphs) creates its state in the
    first step: its state_dict is restored too, so that state made by the
    verify steps does not carry over."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 guard_state: Sequence[torch.Tensor], eager_optimizer: bool) -> None:
        self._values = ValueSnapshot(training_state([model], [optimizer], guard_state))
        self._optimizer = optimizer
        self._state = copy.deepcopy(optimizer.state_dict()) if eager_optimizer else None

    def restore(self) -> None:
        self._values.restore()
        if self._state is not None:
            self._optimizer.load_state_dict(copy.deepcopy(self._state))


def _then(value: Any, action: Callable[[], None]) -> Any:
    action()
    return value


def _guard_state(step: Any) -> Sequence[torch.Tensor]:
    return step.guard.state() if getattr(step, "guard", None) is not None else []


def _verify_step(step: Callable[[Any], Any], model: nn.Module, batch: Any, steps: int,
                 schedule: ScheduleRun, expected: Tuple[List[Any], List[torch.Tensor], float],
                 rtol: float, atol: float) -> float:
    """Runs ``steps`` steps (the schedule stepped after each) and compares
    losses and parameters with the eager reference's; the schedule put back."""
    expected_losses, expected_params, reference_max_lr = expected
    got_losses = [_then(step(batch), schedule.step) for _ in range(steps)]
    got_params = [p.detach().clone() for p in model.parameters()]
    # An adaptive optimizer (Adam) moves a parameter by up to about its
    # learning rate per step however small the gradient, so rounding
    # differences between eager and graphed kernels (TF32, split-K) can
    # move a parameter by up to 2 x lr per step: parameters are compared
    # with that bound, losses with rtol/atol.
    step_bound = 2.0 * steps * max(schedule.max_lr, reference_max_lr)
    diff = max(_max_diff(expected_losses, got_losses, rtol, atol, "losses"),
               _max_diff(expected_params, got_params, rtol, max(atol, step_bound), "parameters"))
    schedule.restore()
    return diff
