"""A learning-rate scheduler through graphed.optimize's verification.

``optimize(..., scheduler=s)`` verifies the step the user trains with,
schedule included: after each verify step ``s.step()`` runs, as in the
user's loop, and the eager reference steps a copy of ``s`` bound to the
reference optimizer. Afterwards the scheduler and the learning rates are put
back, so the first step the user runs is the one they would have run
without graphed. A schedule reaches a captured step without recapture: the
captured optimizer's learning rate is a device tensor that
``LRScheduler.step`` fills in place (Note [Capturable optimizers] in
include/graphed/optim.h)."""

from __future__ import annotations

import copy
import warnings
from typing import Any, List, Optional

import torch

from ._C import GraphedError


def check_scheduler(scheduler: Any, optimizer: Optional[torch.optim.Optimizer]) -> None:
    """Raises unless ``scheduler`` is None or a scheduler of ``optimizer``."""
    if scheduler is None:
        return
    if optimizer is None:
        raise GraphedError(
            f"Expected no scheduler in optimize's inference form, got "
            f"{type(scheduler).__name__}. A scheduler belongs to the training form, "
            "optimize(model, optimizer, loss_fn, sample_batch=..., scheduler=...).")
    if not callable(getattr(scheduler, "step", None)) or \
            getattr(scheduler, "optimizer", None) is not optimizer:
        raise GraphedError(
            f"Expected a learning-rate scheduler of the optimizer passed to optimize (an "
            f"object with .step() and .optimizer that is that optimizer), got "
            f"{type(scheduler).__name__}. Build it on the same optimizer: "
            "torch.optim.lr_scheduler.X(optimizer, ...).")


class ScheduleRun:
    """Steps a scheduler after each verify step and puts it back afterwards;
    does nothing for ``scheduler=None``."""

    def __init__(self, scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
        self.scheduler = scheduler
        self._optimizer = optimizer
        self._state = copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None
        self._lrs: List[Any] = [_copy_lr(g["lr"]) for g in optimizer.param_groups]
        self.max_lr = max(float(lr) for lr in self._lrs)

    def for_copy(self, optimizer_copy: torch.optim.Optimizer) -> "ScheduleRun":
        """The same schedule over a copy of the optimizer (the eager reference):
        the scheduler deep-copied with every reference to the original
        optimizer replaced by the copy, chained and sequential schedulers too."""
        if self.scheduler is None:
            return ScheduleRun(None, optimizer_copy)
        twin = copy.deepcopy(self.scheduler, {id(self._optimizer): optimizer_copy})
        return ScheduleRun(twin, optimizer_copy)

    def step(self) -> None:
        """One scheduler step, as after each step of the user's loop."""
        if self.scheduler is None:
            return
        with warnings.catch_warnings():
            # torch warns when it cannot see optimizer.step() calls (a graph's are
            # replayed, not called); the order in the loop is the user's.
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()
        self.max_lr = max(self.max_lr, max(float(g["lr"]) for g in
                                           self._optimizer.param_groups))

    def restore(self) -> None:
        """The scheduler's state and each group's learning rate as they were."""
        if self.scheduler is None:
            return
        self.scheduler.load_state_dict(copy.deepcopy(self._state))
        with torch.no_grad():
            for group, lr in zip(self._optimizer.param_groups, self._lrs):
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"].copy_(lr)
                else:
                    group["lr"] = _copy_lr(lr)


def _copy_lr(lr: Any) -> Any:
    return lr.detach().clone() if isinstance(lr, torch.Tensor) else lr
