"""Exact snapshots of training state for graphed.advise and graphed.optimize.

``Snapshot.restore()`` puts a model, an optimizer and the random generators
back exactly as they were: the same tensor objects holding the same values,
the same ``.grad`` objects (or None), the same optimizer state dicts and
parameter groups, the same optimizer attributes, the same ``training`` flags.
``ValueSnapshot`` restores only tensor values, in place, for state that a
captured graph reads by address."""

from __future__ import annotations

from typing import Any, Iterable, List, Optional, Tuple

import torch
from torch import nn


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


class RngSnapshot:
    """The CPU and CUDA default generators' states."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


class Snapshot:
    """Everything about ``model`` and ``optimizer`` a capture or a trial run may change."""

    def __init__(self, model: Optional[nn.Module],
                 optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        self.rng = RngSnapshot()
        self.params: List[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor],
                                Optional[torch.Tensor]]] = []
        self.buffers: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.training: List[Tuple[nn.Module, bool]] = []
        with torch.no_grad():
            if model is not None:
                for p in model.parameters():
                    self.params.append((p, p.detach().clone(), p.grad, _clone(p.grad)))
                self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
                self.training = [(m, m.training) for m in model.modules()]
            self.optimizer = optimizer
            if optimizer is not None:
                self.groups = [(group, dict(group)) for group in optimizer.param_groups]
                self.group_list = list(optimizer.param_groups)
                self.state_object = optimizer.state
                self.state = [(p, state, dict(state)) for p, state in optimizer.state.items()]
                tensors = [v for _, _, items in self.state for v in items.values()]
                tensors += [v for _, items in self.groups for v in items.values()]
                self.optimizer_values = [(t, t.detach().clone()) for t in tensors
                                         if isinstance(t, torch.Tensor)]
                self.attributes = {k: v for k, v in vars(optimizer).items()
                                   if k not in ("state", "param_groups")}

    def restore(self) -> None:
        """Puts everything back; safe to call more than once."""
        with torch.no_grad():
            for p, value, grad, grad_value in self.params:
                p.copy_(value)
                if grad is not None:
                    grad.copy_(grad_value)
                p.grad = grad
            for b, value in self.buffers:
                b.copy_(value)
            for module, training in self.training:
                module.training = training
            optimizer = self.optimizer
            if optimizer is not None:
                for group, items in self.groups:
                    group.clear()
                    group.update(items)
                optimizer.param_groups[:] = self.group_list
                for _, state, items in self.state:
                    state.clear()
                    state.update(items)
                self.state_object.clear()
                self.state_object.update({p: state for p, state, _ in self.state})
                optimizer.state = self.state_object
                for tensor, value in self.optimizer_values:
                    tensor.copy_(value)
                for name in [k for k in vars(optimizer) if k not in ("state", "param_groups")]:
                    if name not in self.attributes:
                        delattr(optimizer, name)
                for name, value in self.attributes.items():
                    setattr(optimizer, name, value)
        self.rng.restore()


class ValueSnapshot:
    """The values of ``tensors`` and the random generators, restored in place."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        with torch.no_grad():
            self.values: List[Tuple[torch.Tensor, torch.Tensor]] = [
                (t, t.detach().clone()) for t in tensors]
        self.rng = RngSnapshot()

    def restore(self) -> None:
        with torch.no_grad():
            for tensor, value in self.values:
                tensor.copy_(value)
        self.rng.restore()


def describe(fn: Any) -> str:
    """``module `Net``` or ``function `step``` for reports."""
    if isinstance(fn, nn.Module):
        return f"module `{type(fn).__name__}`"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return f"function `{name}`" if name else "the function"


def first_cuda_device(*values: Any) -> Optional[torch.device]:
    """The device of the first CUDA tensor among ``values`` (nested containers,
    modules' parameters and optimizers' parameters), or None."""
    stack: List[Any] = list(values)
    while stack:
        value = stack.pop(0)
        if isinstance(value, torch.Tensor):
            if value.is_cuda:
                return value.device
        elif isinstance(value, nn.Module):
            stack.extend(value.parameters())
        elif isinstance(value, torch.optim.Optimizer):
            stack.extend(p for g in value.param_groups for p in g["params"])
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return None


def tensor_shapes(value: Any) -> Tuple[Any, ...]:
    """The (shape, dtype) of every tensor in a nested value, in order."""
    out: List[Any] = []
    stack: List[Any] = [value]
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            out.append((tuple(item.shape), str(item.dtype)))
        elif isinstance(item, dict):
            stack[:0] = [item[k] for k in sorted(item, key=str)]
        elif isinstance(item, (list, tuple)):
            stack[:0] = list(item)
    return tuple(out)

