"""graphed for PyTorch Lightning: ``Trainer(callbacks=[CUDAGraphs()])``.

``CUDAGraphs`` is a Lightning ``Callback`` that runs training (and
validation) through CUDA graphs:

- ``mode="step"``: the whole iteration (``training_step``, backward, clipping,
  the optimizer step, over every accumulated batch) is one graph, built by
  :func:`graphed.train.training_iteration` and :class:`graphed.TrainStep`;
- ``mode="modules"``: the module's repeated blocks are graphed by
  :func:`graphed.auto` and Lightning runs its own optimizer loop around them;
- ``mode="auto"`` (the default): ``"step"`` where its conditions hold,
  else ``"modules"``.

Whatever cannot be graphed runs as Lightning would run it without the
callback; the reason goes to the ``graphed.integrations.lightning`` logger and
to ``callback.fallbacks`` (``fallback="raise"`` raises
:class:`graphed.GraphedError` instead). This module is the only place graphed
imports Lightning (``lightning``, else ``pytorch_lightning``)."""

from __future__ import annotations

import dataclasses
import dis
import inspect
import logging
import time
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._C import GraphedError, InputMismatchError
from ..auto import auto as _auto, stats as _auto_stats
from ..capture import capture as _capture, graph_pool_handle as _graph_pool_handle
from ..train import TrainStep, _fusable, training_iteration

try:  # Lightning 2.x ships as `lightning`; `pytorch_lightning` is the older name.
    from lightning.pytorch import Callback as _Callback
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        from pytorch_lightning import Callback as _Callback
    except ImportError as error:
        raise ImportError(
            "graphed.integrations.lightning needs PyTorch Lightning: pip install lightning "
            "(or pytorch_lightning).") from error

__all__ = ["CUDAGraphs", "StepSettings", "step_conditions"]

logger = logging.getLogger("graphed.integrations.lightning")

MODES = ("auto", "step", "modules")
FALLBACKS = ("eager", "raise")
PRECISIONS = {"32-true": None, "32": None, "bf16-mixed": "bf16", "16-mixed": "fp16"}

# Note [Lightning's loop around a captured step]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Lightning 2.x trains a batch in TrainingEpochLoop.advance: hooks, then
# `epoch_loop.automatic_optimization.run(optimizer, batch_idx, kwargs)` (the
# closure: training_step, zero_grad, backward; and, unless the batch only
# accumulates, `optimizer_step` with clipping and the precision plugin), then
# the LR schedulers, logging, validation. Two places could take a captured
# step:
#  1. manual optimization: set `automatic_optimization = False` and replace
#     `training_step`. Lightning then stops stepping LR schedulers
#     (`_update_learning_rates` returns early for manual optimization),
#     rejects `gradient_clip_val` and `accumulate_grad_batches` at fit start,
#     counts `global_step` with another counter (checkpoints taken with one
#     resume with the other), and runs `training_step` under the precision
#     plugin's autocast, around the graph's own.
#  2. the automatic loop's `run`, replaced on that one loop object. Everything
#     around it stays Lightning's: LR schedulers with their interval and
#     frequency, `_should_accumulate`, the logger step, validation,
#     checkpoints, `global_step`.
# graphed takes 2. Its `run` keeps the batches of an accumulation window (the
# batches for which `fit_loop._should_accumulate()` is true return `{}`, as
# Lightning's skipped steps do) and, at the window's last batch, replays one
# graph with `microbatches=N` on the window's batches concatenated along
# dim 0, which splits back into exactly those batches. Lightning divides each
# batch's loss by `accumulate_grad_batches`, as the captured iteration does.
# It then advances `optim_progress` as `_optimizer_step` would (that is
# `global_step`) and logs again what `training_step` logged (Note [Logging
# from a graph]). A window the graph cannot take (a last partial batch, a
# window cut short by the end of the epoch, another shape) runs through
# Lightning's own closure and `run`, so it has exactly Lightning's semantics.
# What a replay cannot do is call Python per step: the per-step hooks around
# backward and the optimizer (`on_before_backward`, `on_after_backward`,
# `on_before_optimizer_step`, `on_before_zero_grad`, `optimizer_step`,
# `configure_gradient_clipping`...) must be Lightning's defaults, and
# `training_step` runs only while the graph is warmed up and captured: a
# `training_step` that reads `batch_idx`, `self.global_step` or
# `self.current_epoch`, or updates torchmetrics metrics, would be frozen, so
# those fall back. LR schedulers work because make_capturable turns each
# group's lr into a device tensor that torch's schedulers fill in place; a
# scheduler that assigns a new value is copied into that tensor before the
# replay, and a change to any other hyperparameter (momentum cycling) stops
# the graph with the reason.

# Note [Logging from a graph]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# `self.log(name, tensor)` in `training_step` feeds Lightning's result
# collection with device ops and Python bookkeeping that a replay would not
# run. While the step is warmed up and captured, `self.log` is replaced on the
# module by a recorder: each logged tensor is copied (its mean over the
# microbatches of an accumulation window) into a buffer the callback owns, so
# the captured graph writes each step's value there. After every replay the
# callback calls Lightning's real `self.log` with those buffers (Lightning
# clones them), with the arguments of the captured call: no `.item()` and no
# host sync per step. Python numbers logged are frozen at capture (the report
# says so); other values (torchmetrics objects) stop the capture. With
# accumulation Lightning would log each batch's value at the window's step;
# the graph logs their mean once, so epoch means agree and the step value is
# the window's mean.


def _lightning_base(obj: Any, name: str) -> Optional[type]:
    """The Lightning base class named ``name`` (``LightningModule``, ``Callback``)
    in ``obj``'s MRO, from whichever Lightning package ``obj`` comes from."""
    for cls in type(obj).__mro__:
        if cls.__name__ == name and cls.__module__.split(".")[0] in ("lightning",
                                                                     "pytorch_lightning"):
            return cls
    return None


def _overridden(obj: Any, base: Optional[type], hook: str) -> bool:
    if base is None:
        return False
    own = getattr(type(obj), hook, None)
    return own is not None and own is not getattr(base, hook, None)


#: LightningModule hooks Lightning calls around backward and the optimizer step
#: each iteration; a replayed graph runs none of them (Note [Lightning's loop
#: around a captured step]).
MODULE_STEP_HOOKS = ("backward", "on_before_backward", "on_after_backward",
                     "on_before_optimizer_step", "configure_gradient_clipping", "optimizer_step",
                     "optimizer_zero_grad", "on_before_zero_grad")
#: Callback hooks of the same kind.
CALLBACK_STEP_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step",
                       "on_before_zero_grad")


def _code_of(fn: Callable[..., Any]) -> Optional[Any]:
    target = inspect.unwrap(getattr(fn, "__func__", fn))
    return getattr(target, "__code__", None)


def _nested_codes(code: Any) -> List[Any]:
    codes = [code]
    for const in code.co_consts:
        if inspect.iscode(const):
            codes += _nested_codes(const)
    return codes


def _parameter_reads(fn: Callable[..., Any], position: int) -> Optional[str]:
    """The name of ``fn``'s parameter at ``position`` (after ``self``) when the
    function's code reads it, else None."""
    code = _code_of(fn)
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    if code is None or len(params) <= position:
        return None
    name = params[position]
    skip = {"LOAD_ATTR", "LOAD_METHOD", "LOAD_GLOBAL", "LOAD_NAME", "LOAD_CONST",
            "LOAD_SUPER_ATTR"}
    for nested in _nested_codes(code):
        for ins in dis.get_instructions(nested):
            if not ins.opname.startswith("LOAD_") or ins.opname in skip:
                continue
            value = ins.argval
            if value == name or (isinstance(value, tuple) and name in value):
                return name
    return None


def _attribute_reads(fn: Callable[..., Any], names: Sequence[str]) -> List[str]:
    code = _code_of(fn)
    if code is None:
        return []
    found = set()
    for nested in _nested_codes(code):
        found |= set(nested.co_names) & set(names)
    return sorted(found)


def _frozen_reads(fn: Callable[..., Any], name: str) -> List[str]:
    """Why a graph of ``fn`` (a step taking ``(batch, batch_idx)``) would be
    wrong: it reads batch_idx, self.global_step or self.current_epoch, values a
    graph freezes at capture. Empty when it reads none."""
    reasons = []
    read = _parameter_reads(fn, 1)
    if read:
        reasons.append(f"{name} reads its argument `{read}`, which a graph would freeze at its "
                       "value during capture")
    attrs = _attribute_reads(fn, ("global_step", "current_epoch"))
    if attrs:
        reasons.append(f"{name} reads self.{', self.'.join(attrs)}, which a graph would freeze "
                       "at its value during capture")
    return reasons


def _metric_modules(module: nn.Module) -> List[str]:
    """Submodules that are torchmetrics metrics: their Python state (update
    counts, cached results) is not replayed by a graph."""
    found = []
    for name, sub in module.named_modules():
        if any(c.__name__ == "Metric" and c.__module__.startswith("torchmetrics")
               for c in type(sub).__mro__):
            found.append(name or type(sub).__name__)
    return found


def _optimizer_problem(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why ``optimizer`` cannot be captured (what make_capturable refuses), or
    None; it is not changed."""
    name = type(optimizer).__name__
    if not (_fusable(optimizer) or "capturable" in optimizer.defaults):
        return (f"the optimizer {name} keeps its step on the host and has no capturable mode; "
                "use fused Adam, AdamW or SGD (torch.optim.AdamW(..., fused=True)) or an "
                "optimizer with capturable=True")
    if isinstance(optimizer, torch.optim.SGD):
        for group in optimizer.param_groups:
            if group["momentum"] and group["dampening"]:
                return (f"SGD with momentum and dampening={group['dampening']} cannot be "
                        "captured; use dampening=0")
    return None


@dataclasses.dataclass
class StepSettings:
    """How the captured step reproduces the Trainer's configuration."""

    #: Batches per optimizer step (``accumulate_grad_batches``).
    microbatches: int = 1
    #: ``gradient_clip_val`` with the "norm" algorithm, else None.
    clip_grad_norm: Optional[float] = None
    #: graphed's ``amp``: None (32-true), "bf16" (bf16-mixed), "fp16" (16-mixed).
    amp: Optional[str] = None


def _device_problem(trainer: Any) -> Optional[str]:
    strategy = trainer.strategy
    device = getattr(strategy, "root_device", None)
    if device is None or device.type != "cuda":
        return (f"training runs on {device} and CUDA graphs need a CUDA device; use "
                "Trainer(accelerator='gpu')")
    if type(strategy).__name__ != "SingleDeviceStrategy":
        return (f"the strategy is {type(strategy).__name__}; CUDAGraphs supports one device "
                "(SingleDeviceStrategy). For DDP use graphed.TrainStep with "
                "graphed.distributed.prepare_ddp")
    return None


def step_conditions(trainer: Any, pl_module: Any, callback: Any = None, *,
                    require_cuda: bool = True) -> Tuple[Optional[StepSettings], List[str]]:
    """Whether ``mode="step"`` can capture this fit: ``(settings, [])`` when it
    can, else ``(None, reasons)``, each reason saying what was found and how to
    fix it. Reads the Trainer and module after the optimizers are configured
    (``on_fit_start``); changes nothing."""
    reasons: List[str] = []
    if require_cuda:
        problem = _device_problem(trainer)
        if problem:
            reasons.append(problem)
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    auto_loop = getattr(loop, "automatic_optimization", None)
    if auto_loop is None or not hasattr(getattr(auto_loop, "optim_progress", None), "optimizer"):
        reasons.append("this Lightning version's training loop has no "
                       "fit_loop.epoch_loop.automatic_optimization.optim_progress; CUDAGraphs "
                       "supports Lightning 2.x")
    if not pl_module.automatic_optimization:
        reasons.append("the module uses manual optimization (automatic_optimization=False); "
                       "its training_step calls the optimizer itself. Use graphed.TrainStep "
                       "inside it, or mode='modules'")
    optimizers = list(trainer.optimizers)
    if len(optimizers) != 1:
        reasons.append(f"configure_optimizers returned {len(optimizers)} optimizers; a captured "
                       "step takes exactly one")
    else:
        problem = _optimizer_problem(optimizers[0])
        if problem:
            reasons.append(problem)
    precision = str(trainer.precision)
    if precision not in PRECISIONS:
        reasons.append(f"precision={precision!r} is not supported by the captured step; use "
                       "'32-true', 'bf16-mixed' or '16-mixed'")
    clip_val = trainer.gradient_clip_val
    algorithm = getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm)
    clip = None
    if clip_val:
        if algorithm not in (None, "norm"):
            reasons.append(f"gradient_clip_algorithm={algorithm!r}; the captured step clips by "
                           "norm only. Use gradient_clip_algorithm='norm'")
        else:
            clip = float(clip_val)
    accumulate = trainer.accumulate_grad_batches
    if not isinstance(accumulate, int) or accumulate < 1:
        reasons.append(f"accumulate_grad_batches={accumulate!r}; expected an int >= 1")
    module_base = _lightning_base(pl_module, "LightningModule")
    hooks = [h for h in MODULE_STEP_HOOKS if _overridden(pl_module, module_base, h)]
    if hooks:
        reasons.append(f"{type(pl_module).__name__} overrides {', '.join(hooks)}, which Lightning "
                       "calls every step and a replayed graph cannot; remove the override(s) or "
                       "use mode='modules'")
    for cb in getattr(trainer, "callbacks", []):
        if cb is callback:
            continue
        if type(cb).__name__ == "GradientAccumulationScheduler":
            reasons.append("GradientAccumulationScheduler changes accumulate_grad_batches during "
                           "the fit; the captured step has a fixed number of microbatches")
            continue
        cb_hooks = [h for h in CALLBACK_STEP_HOOKS
                    if _overridden(cb, _lightning_base(cb, "Callback"), h)]
        if cb_hooks:
            reasons.append(f"callback {type(cb).__name__} implements {', '.join(cb_hooks)}, "
                           "which a replayed graph cannot call each step")
    step_fn = pl_module.training_step
    try:
        params = list(inspect.signature(step_fn).parameters)
    except (TypeError, ValueError):
        params = []
    if "dataloader_iter" in params:
        reasons.append("training_step takes dataloader_iter; a captured step needs the batch")
    reasons.extend(_frozen_reads(step_fn, "training_step"))
    metrics = _metric_modules(pl_module)
    if metrics:
        reasons.append(f"the module holds torchmetrics metrics ({', '.join(metrics[:3])}): their "
                       "Python state is not replayed by a graph")
    if reasons:
        return None, reasons
    return StepSettings(microbatches=accumulate, clip_grad_norm=clip,
                        amp=PRECISIONS[precision]), []


# --- batches ----------------------------------------------------------------------


def batch_signature(value: Any) -> Any:
    """What must be equal for a batch to replay a graph captured on another:
    container types, and shape, dtype and device of each tensor; other values
    themselves (or their repr when unhashable)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device)
    if isinstance(value, Mapping):
        return ("mapping", type(value).__name__,
                tuple((k, batch_signature(v)) for k, v in value.items()))
    if isinstance(value, (tuple, list)):
        return ("sequence", type(value).__name__, tuple(batch_signature(v) for v in value))
    try:
        hash(value)
        return ("value", value)
    except TypeError:
        return ("value", repr(value))


def describe_signature(signature: Any) -> str:
    """A batch signature (:func:`batch_signature`) as text for messages."""
    kind = signature[0]
    if kind == "tensor":
        return f"{list(signature[1])} {str(signature[2]).replace('torch.', '')}"
    if kind == "mapping":
        return "{" + ", ".join(f"{k!r}: {describe_signature(v)}" for k, v in signature[2]) + "}"
    if kind == "sequence":
        inner = ", ".join(describe_signature(v) for v in signature[2])
        return f"[{inner}]" if signature[1] == "list" else f"({inner})"
    return repr(signature[1])


def concat_batches(batches: Sequence[Any]) -> Any:
    """The batches of an accumulation window as one batch that
    ``graphed.train.split_batch`` splits back into exactly them: tensors
    concatenated along dim 0. Raises ValueError when the batches differ in
    signature or hold a tensor without a dim 0."""
    first = batches[0]
    if any(batch_signature(b) != batch_signature(first) for b in batches[1:]):
        raise ValueError("the batches of the window differ in shape, dtype or values")
    return _concat(batches)


def _concat(batches: Sequence[Any]) -> Any:
    first = batches[0]
    if len(batches) == 1:
        return first
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise ValueError("a zero-dimensional tensor cannot be split into microbatches")
        return torch.cat(list(batches), dim=0)
    if isinstance(first, Mapping):
        return type(first)({k: _concat([b[k] for b in batches]) for k in first})
    if isinstance(first, (tuple, list)):
        parts = [_concat([b[i] for b in batches]) for i in range(len(first))]
        return type(first)(parts) if isinstance(first, list) else tuple(parts)
    return first


# --- logging ----------------------------------------------------------------------


@dataclasses.dataclass
class _Logged:
    value: Any                 # the buffer the graph writes, or a frozen Python number
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]


class LogRecorder:
    """Stands in for ``LightningModule.log`` while a step is warmed up and
    captured, and logs the recorded values after each replay (Note [Logging
    from a graph])."""

    def __init__(self, microbatches: int = 1) -> None:
        self.microbatches = microbatches
        #: name -> what was logged, in the order training_step logged it.
        self.logged: Dict[str, _Logged] = {}
        #: Values frozen at capture (Python numbers), for the report.
        self.frozen: List[str] = []
        #: Index of the microbatch being recorded.
        self.index = 0

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        """Records ``self.log(name, value, ...)``; tensors are copied into the
        buffer of ``name`` (their mean over the microbatches)."""
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise GraphedError(
                    f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}; "
                    "Lightning logs single-element tensors. Log a reduced value (e.g. .mean()).")
            entry = self.logged.get(name)
            value = value.detach()
            n = self.microbatches
            dtype = value.dtype if n == 1 or not value.is_floating_point() else torch.float32
            if entry is None or not isinstance(entry.value, torch.Tensor):
                if n > 1 and not value.is_floating_point():
                    dtype = torch.float32
                buffer = torch.zeros_like(value, dtype=dtype)
                entry = self.logged[name] = _Logged(buffer, args, kwargs)
            entry.args, entry.kwargs = args, kwargs
            with torch.no_grad():
                if n == 1:
                    entry.value.copy_(value)
                elif self.index == 0:
                    entry.value.copy_(value.to(entry.value.dtype) / n)
                else:
                    entry.value.add_(value.to(entry.value.dtype) / n)
            return
        if isinstance(value, (bool, int, float)):
            if name not in self.frozen:
                self.frozen.append(name)
            self.logged[name] = _Logged(value, args, kwargs)
            return
        raise GraphedError(
            f"self.log({name!r}, ...) got a {type(value).__name__}; a captured step can log "
            "tensors and numbers. Log metric objects (torchmetrics) outside the captured step, "
            "or use CUDAGraphs(mode='modules').")

    def replay(self, log: Callable[..., None]) -> None:
        """Calls Lightning's ``log`` with every recorded name and its buffer."""
        for name, entry in self.logged.items():
            log(name, entry.value, *entry.args, **entry.kwargs)


class _Recording:
    """Installs a recorder as ``module.log`` for the duration of a call."""

    def __init__(self, module: nn.Module, recorder: LogRecorder) -> None:
        self.module, self.recorder = module, recorder

    def __enter__(self) -> None:
        object.__setattr__(self.module, "log", self.recorder.log)

    def __exit__(self, *exc: Any) -> None:
        self.module.__dict__.pop("log", None)


class TrainingStepModule(nn.Module):
    """``pl_module.training_step`` as a model for graphed's training iteration:
    ``forward(batch)`` returns the loss of one microbatch, with ``self.log``
    recorded (Note [Logging from a graph]). ``extra_args`` follow the batch
    (``batch_idx``, which the step does not read)."""

    def __init__(self, pl_module: nn.Module, recorder: LogRecorder,
                 extra_args: Tuple[Any, ...] = ()) -> None:
        super().__init__()
        self.pl_module = pl_module
        # Not a submodule attribute lookup: the recorder holds buffers only.
        object.__setattr__(self, "recorder", recorder)
        object.__setattr__(self, "extra_args", tuple(extra_args))
        object.__setattr__(self, "calls", 0)
        object.__setattr__(self, "outputs", {})

    def forward(self, batch: Any) -> torch.Tensor:
        recorder = self.recorder
        recorder.index = self.calls % recorder.microbatches
        object.__setattr__(self, "calls", self.calls + 1)
        module = self.pl_module
        previous = getattr(module, "_current_fx_name", None)
        module._current_fx_name = "training_step"
        try:
            with _Recording(module, recorder):
                output = module.training_step(batch, *self.extra_args)
        finally:
            module._current_fx_name = previous
        if isinstance(output, Mapping):
            loss = output.get("loss")
            self._record_outputs(output)
        else:
            loss = output
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            raise GraphedError(
                f"training_step returned {type(output).__name__}; a captured step needs the loss: "
                "a tensor with one element, or a dict with 'loss'. A step that returns None "
                "(skipping the batch) cannot be captured; use mode='modules'.")
        return loss

    def _record_outputs(self, output: Mapping) -> None:
        # Tensors training_step returns besides the loss: the last microbatch's.
        with torch.no_grad():
            for key, value in output.items():
                if key == "loss":
                    continue
                if isinstance(value, torch.Tensor):
                    buffer = self.outputs.get(key)
                    if not isinstance(buffer, torch.Tensor) or buffer.shape != value.shape:
                        buffer = self.outputs[key] = torch.empty_like(value.detach())
                    buffer.copy_(value.detach())
                else:
                    self.outputs[key] = value


# --- the captured step --------------------------------------------------------------


class StepEngine:
    """What the callback needs of a captured step, apart from the capture:
    the module's ``training_step`` as a loss (:class:`TrainingStepModule`),
    the batch signature, the optimizer's hyperparameters at capture, and the
    gradient and lr tensors the graph reads. :class:`GraphedTraining` adds the
    graph; the CPU tests add an eager step with the same semantics."""

    def __init__(self, pl_module: nn.Module, optimizer: torch.optim.Optimizer,
                 settings: StepSettings, sample_batch: Any,
                 extra_args: Tuple[Any, ...]) -> None:
        self.optimizer = optimizer
        self.settings = settings
        self.recorder = LogRecorder(settings.microbatches)
        self.adapter = TrainingStepModule(pl_module, self.recorder, extra_args)
        self.signature = batch_signature(sample_batch)
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.grads: List[Optional[torch.Tensor]] = []
        self.lrs: List[Any] = []
        self.hyper: List[Dict[str, Any]] = []

    def captured(self) -> None:
        """Records, after capture, the tensors and values the graph holds."""
        self.grads = [p.grad for p in self.params]
        self.lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.hyper = [self._hyperparameters(g) for g in self.optimizer.param_groups]

    @staticmethod
    def _hyperparameters(group: Dict[str, Any]) -> Dict[str, Any]:
        return {k: v for k, v in group.items()
                if k not in ("params", "lr") and not isinstance(v, torch.Tensor)}

    def matches(self, batch: Any) -> bool:
        """Whether ``batch`` can replay the graph."""
        return batch_signature(batch) == self.signature

    def changed_hyperparameter(self) -> Optional[str]:
        """The first non-lr hyperparameter changed since capture, or None."""
        for i, group in enumerate(self.optimizer.param_groups):
            now = self._hyperparameters(group)
            for key, value in self.hyper[i].items():
                if now.get(key) != value:
                    return f"param_groups[{i}][{key!r}] ({value!r} -> {now.get(key)!r})"
        return None

    def sync_learning_rates(self) -> None:
        """A scheduler that assigned a new lr (instead of filling the tensor) is
        copied into the tensor the graph reads."""
        for group, lr in zip(self.optimizer.param_groups, self.lrs):
            current = group["lr"]
            if isinstance(lr, torch.Tensor) and current is not lr:
                with torch.no_grad():
                    lr.copy_(current) if isinstance(current, torch.Tensor) else lr.fill_(current)
                group["lr"] = lr

    def restore_grads(self) -> None:
        """Points ``.grad`` back at the graph's gradient buffers."""
        for p, g in zip(self.params, self.grads):
            if p.grad is not g:
                p.grad = g

    def outputs(self) -> Dict[str, Any]:
        """What training_step returned besides the loss (the graph's buffers)."""
        return dict(self.adapter.outputs)

    def stats(self) -> Dict[str, Any]:
        """Statistics of the step (none without a graph)."""
        return {}

    def release(self) -> None:
        """Frees what the step holds (nothing without a graph)."""


class GraphedTraining(StepEngine):
    """The captured iteration of one LightningModule: a :class:`graphed.TrainStep`
    over :func:`graphed.train.training_iteration` with the module's
    ``training_step`` as its loss (the C++ core owns the order of operations)."""

    def __init__(self, pl_module: nn.Module, optimizer: torch.optim.Optimizer,
                 settings: StepSettings, sample_batch: Any, extra_args: Tuple[Any, ...],
                 warmup: int) -> None:
        super().__init__(pl_module, optimizer, settings, sample_batch, extra_args)
        device = self.params[0].device
        for group in optimizer.param_groups:
            # A checkpoint can bring lr back as a CPU tensor; make_capturable
            # moves floats only.
            if isinstance(group["lr"], torch.Tensor) and group["lr"].device != device:
                group["lr"] = float(group["lr"])
        self.iteration, guard = training_iteration(
            self.adapter, optimizer, None, (sample_batch,), microbatches=settings.microbatches,
            clip_grad_norm=settings.clip_grad_norm, amp=settings.amp)
        self.adapter.calls = 0
        self.step_graph = TrainStep(self.iteration, (sample_batch,), warmup=warmup,
                                    modules=[self.adapter], optimizers=[optimizer],
                                    state=guard.state(), guard=guard)
        self.captured()
        # torch.optim's fused step reads optimizer.found_inf where GradScaler puts
        # it; the graph does not need the attribute, and an eager step must not
        # read the guard's flag of an earlier step.
        for attribute in ("found_inf", "grad_scale"):
            if hasattr(optimizer, attribute):
                delattr(optimizer, attribute)

    def step(self, batch: Any) -> torch.Tensor:
        """Replays one optimizer step on ``batch`` (the window's batches
        concatenated) and returns the mean loss."""
        self.restore_grads()
        self.sync_learning_rates()
        return self.step_graph.step((batch,))

    def stats(self) -> Dict[str, Any]:
        """The TrainStep's graph statistics."""
        return self.step_graph.stats()

    def release(self) -> None:
        """Frees the graph."""
        self.step_graph.release()


# --- the callback -------------------------------------------------------------------


class CUDAGraphs(_Callback):
    """A Lightning callback that trains through CUDA graphs.

    ``Trainer(callbacks=[graphed.integrations.lightning.CUDAGraphs()])``.

    Args:
        mode: ``"step"``: the whole iteration (training_step, backward,
            clipping, optimizer step, all accumulated batches) replays as one
            graph; ``"modules"``: :func:`graphed.auto` graphs the module's
            repeated blocks and Lightning's own loop runs around them;
            ``"auto"``: ``"step"`` where its conditions hold
            (:func:`step_conditions`), else ``"modules"``.
        warmup: eager iterations before capture.
        validation: capture ``validation_step`` too (one graph per batch
            signature) where the step mode is used.
        fallback: ``"eager"`` runs what cannot be graphed as Lightning would,
            logging the reason and recording it in :attr:`fallbacks`;
            ``"raise"`` raises :class:`graphed.GraphedError` instead.
        modules, buckets, memory_budget: passed to :func:`graphed.auto` in
            modules mode.

    Conditions of the step mode: one CUDA device, automatic optimization, one
    optimizer that :func:`graphed.make_capturable` accepts (fused
    Adam/AdamW/SGD or one with ``capturable``), precision ``32-true``,
    ``bf16-mixed`` or ``16-mixed`` (graphed's own loss scaling, with
    GradScaler's defaults), ``gradient_clip_val`` by norm, any
    ``accumulate_grad_batches``, Lightning's default per-step hooks, and a
    ``training_step`` that does not read ``batch_idx``,
    ``self.global_step`` or ``self.current_epoch``. ``training_step`` runs
    only during warm-up and capture: Python side effects in it happen then
    only. Values it logs with ``self.log`` are logged after every replay
    without a host sync (with accumulation, their mean over the window).
    Batches of another shape (a last partial batch) run eagerly, as
    Lightning would, and are counted in :attr:`report`. See Note
    [Lightning's loop around a captured step] in this file.
    """

    def __init__(self, mode: str = "auto", *, warmup: int = 3, validation: bool = True,
                 fallback: str = "eager", modules: Any = None, buckets: Any = None,
                 memory_budget: Any = None) -> None:
        if mode not in MODES:
            raise GraphedError(f"Expected mode to be one of {', '.join(map(repr, MODES))}, got "
                               f"{mode!r}.")
        if fallback not in FALLBACKS:
            raise GraphedError(f"Expected fallback to be 'eager' or 'raise', got {fallback!r}.")
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
            raise GraphedError(f"Expected warmup to be an int >= 1, got {warmup!r}.")
        if mode == "step" and any(v is not None for v in (modules, buckets, memory_budget)):
            raise GraphedError(
                "modules=, buckets= and memory_budget= configure graphed.auto, which only "
                "mode='modules' (or 'auto') uses; mode='step' captures the whole step. Drop them "
                "or use mode='modules'.")
        self.mode = mode
        self.warmup = warmup
        self.validation = bool(validation)
        self.fallback = fallback
        self.auto_options = {"modules": modules, "buckets": buckets,
                             "memory_budget": memory_budget}
        #: Every fallback: dicts with ``what``, ``reason``, ``to`` and ``count``.
        self.fallbacks: List[Dict[str, Any]] = []
        self._reset()

    # Tests on CPU replace the engine (the captured step) and lift the CUDA
    # requirement; everything around it is the same code.
    _require_cuda = True

    def _reset(self) -> None:
        self.active: str = "eager"
        self._settings: Optional[StepSettings] = None
        self._engine: Any = None
        self._engine_failed = False
        self._window: List[Tuple[int, Any]] = []
        self._loop: Any = None
        self._module: Any = None
        self._trainer: Any = None
        self._auto_forwards: List[nn.Module] = []
        self._auto_class: Optional[type] = None
        self._eval_graphs: Dict[Any, Any] = {}
        self._eval_seen: Dict[Any, int] = {}
        self._eval_failed: set = set()
        self._eval_pool: Any = None
        # eval_graphs counts captures: teardown frees the graphs, the report stays.
        self._counts = {"graphed_steps": 0, "eager_steps": 0, "eval_graphs": 0,
                        "eval_replays": 0, "eval_eager": 0, "capture_s": 0.0}
        self._notes: List[str] = []
        self._final_stats: Dict[str, Any] = {}

    # -- reporting ------------------------------------------------------------------

    def _fall_back(self, what: str, reason: str, to: str = "eager") -> None:
        """Records (and logs, the first time) a fallback; raises with
        fallback='raise'."""
        for entry in self.fallbacks:
            if entry["what"] == what and entry["reason"] == reason and entry["to"] == to:
                entry["count"] += 1
                break
        else:
            self.fallbacks.append({"what": what, "reason": reason, "to": to, "count": 1})
            logger.warning("CUDAGraphs: %s runs %s: %s", what, to, reason)
        if self.fallback == "raise" and to != "modules":
            raise GraphedError(
                f"CUDAGraphs cannot graph {what}: {reason}. (fallback='raise'; pass "
                "fallback='eager' to run it eagerly instead.)")

    @property
    def report(self) -> Dict[str, Any]:
        """What the callback did: requested and active mode, step settings,
        graphed and eager steps, validation replays, fallbacks with reasons,
        notes, and the graphs' statistics."""
        result: Dict[str, Any] = {
            "mode": self.mode, "active": self.active,
            "settings": dataclasses.asdict(self._settings) if self._settings else None,
            **self._counts,
            "fallbacks": [dict(f) for f in self.fallbacks], "notes": list(self._notes)}
        if self._engine is not None and not self._final_stats:
            try:
                result["step_graph"] = self._engine.stats()
            except Exception:  # noqa: BLE001 - released or a test double
                pass
        result.update(self._final_stats)
        return result

    # -- Lightning hooks ------------------------------------------------------------

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Chooses the mode from the Trainer and module (optimizers exist now)
        and installs it."""
        self._reset()
        self._trainer, self._module = trainer, pl_module
        problem = _device_problem(trainer) if self._require_cuda else None
        if problem:
            self._fall_back("training", problem)
            return
        settings, reasons = (None, [])
        if self.mode in ("auto", "step"):
            settings, reasons = step_conditions(trainer, pl_module, self,
                                                require_cuda=self._require_cuda)
        if settings is not None:
            self._install_step(trainer, pl_module, settings)
            return
        if self.mode == "step":
            for reason in reasons:
                self._fall_back("the training step", reason)
            return
        for reason in reasons:
            self._fall_back("the training step", reason, to="modules")
        self._install_modules(pl_module)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Puts back everything the callback replaced and frees the graphs;
        :attr:`report` keeps their statistics."""
        if self._module is None:
            return
        if self._loop is not None:
            self._loop.__dict__.pop("run", None)
            self._loop = None
        self._module.__dict__.pop("validation_step", None)
        if self._engine is not None:
            try:
                self._final_stats["step_graph"] = self._engine.stats()
                self._engine.restore_grads()
                self._engine.release()
            except Exception:  # noqa: BLE001 - a test double without graphs
                pass
        if self._auto_class is not None:
            self._final_stats["modules"] = _auto_stats(self._module)
            self._undo_auto(self._module)
        self._eval_graphs.clear()
        self._module = None

    # -- step mode ------------------------------------------------------------------

    def _install_step(self, trainer: Any, pl_module: Any, settings: StepSettings) -> None:
        self.active = "step"
        self._settings = settings
        self._loop = trainer.fit_loop.epoch_loop.automatic_optimization
        original = type(self._loop).run.__get__(self._loop)
        self._original_run = original

        def run(optimizer: Any, batch_idx: int, kwargs: Any) -> Dict[str, Any]:
            return self._run(optimizer, batch_idx, kwargs)

        # An instance attribute: only this Trainer's loop changes, and teardown
        # removes it (Note [Lightning's loop around a captured step]).
        self._loop.__dict__["run"] = run
        if self.validation:
            self._install_validation(pl_module, settings)

    def _run(self, optimizer: Any, batch_idx: int, kwargs: Any) -> Dict[str, Any]:
        if self.active != "step":
            return self._original_run(optimizer, batch_idx, kwargs)
        self._window.append((batch_idx, kwargs))
        if self._trainer.fit_loop._should_accumulate():
            return {}
        window, self._window = self._window, []
        return self._step_window(optimizer, window)

    def _step_window(self, optimizer: Any, window: List[Tuple[int, Any]]) -> Dict[str, Any]:
        settings = self._settings
        batches = [kw["batch"] for _, kw in window]
        what = f"the optimizer step at global_step {self._trainer.global_step}"
        if len(window) != settings.microbatches:
            self._fall_back("an accumulation window", f"it has {len(window)} of "
                            f"{settings.microbatches} batches (the end of an epoch)")
            return self._eager_window(optimizer, window)
        try:
            batch = concat_batches(batches)
        except ValueError as error:
            self._fall_back(what, f"its batches cannot be stacked into one window ({error})")
            return self._eager_window(optimizer, window)
        if self._engine is None:
            if self._engine_failed:
                return self._eager_window(optimizer, window)
            if not self._build_engine(optimizer, batch, window[0][1]):
                return self._eager_window(optimizer, window)
        elif not self._engine.matches(batch):
            self._fall_back("a batch of another shape", "the training graph was captured on "
                            f"{describe_signature(self._engine.signature)}, this batch is "
                            f"{describe_signature(batch_signature(batch))} (use drop_last=True "
                            "to keep every batch on the graph)")
            return self._eager_window(optimizer, window)
        changed = self._engine.changed_hyperparameter()
        if changed:
            self._fall_back("training", f"the optimizer's {changed} changed after capture and "
                            "the graph holds the old value (only lr may change, e.g. by an LR "
                            "scheduler)")
            self._stop_step_mode()
            return self._eager_window(optimizer, window)
        try:
            loss = self._engine.step(batch)
        except InputMismatchError as error:
            self._fall_back(what, f"the graph refused the batch: {error}")
            return self._eager_window(optimizer, window)
        # What Lightning's _optimizer_step and zero_grad count; the step
        # counter is trainer.global_step.
        progress = self._loop.optim_progress.optimizer
        progress.zero_grad.increment_ready()
        progress.zero_grad.increment_started()
        progress.zero_grad.increment_completed()
        progress.step.increment_ready()
        progress.step.increment_completed()
        self._counts["graphed_steps"] += 1
        self._relog(self._engine.recorder, "training_step")
        return {"loss": loss, **self._engine.outputs()}

    def _build_engine(self, optimizer: Any, batch: Any, kwargs: Any) -> bool:
        extra = tuple(v for k, v in kwargs.items() if k != "batch")
        fused = [g.get("fused") for g in optimizer.param_groups]
        started = time.perf_counter()
        try:
            self._engine = self._make_engine(self._module, optimizer, self._settings, batch,
                                             extra)
        except Exception as error:  # noqa: BLE001 - any capture failure falls back
            self._engine_failed = True
            reason = f"capture failed: {type(error).__name__}: {error}"
            if self.fallback == "raise":
                raise GraphedError(f"CUDAGraphs cannot capture the training step: {reason}") \
                    from error
            self._stop_step_mode()
            if self.mode == "auto":
                self._fall_back("the training step", reason, to="modules")
                self._install_modules(self._module)
            else:
                self._fall_back("the training step", reason)
            return False
        self._counts["capture_s"] += time.perf_counter() - started
        if fused != [g.get("fused") for g in optimizer.param_groups]:
            self._notes.append(f"{type(optimizer).__name__} switched to its fused implementation "
                               "(graphed.make_capturable), which a captured step needs")
        notes = getattr(self._engine, "recorder", None)
        if notes is not None and notes.frozen:
            self._notes.append(f"logged Python numbers frozen at capture: {', '.join(notes.frozen)}")
        return True

    def _make_engine(self, pl_module: Any, optimizer: Any, settings: StepSettings, batch: Any,
                     extra_args: Tuple[Any, ...]) -> Any:
        """The captured step (a :class:`GraphedTraining`)."""
        return GraphedTraining(pl_module, optimizer, settings, batch, extra_args, self.warmup)

    def _stop_step_mode(self) -> None:
        self.active = "eager"
        self._module.__dict__.pop("validation_step", None)

    def _eager_window(self, optimizer: Any, window: List[Tuple[int, Any]]) -> Dict[str, Any]:
        """The window through Lightning's own closure and loop: the earlier
        batches accumulate, the last one steps."""
        for batch_idx, kwargs in window[:-1]:
            closure = self._loop._make_closure(kwargs, optimizer, batch_idx)
            closure()
            closure.consume_result()
        batch_idx, kwargs = window[-1]
        result = self._original_run(optimizer, batch_idx, kwargs)
        self._counts["eager_steps"] += 1
        if self._engine is not None:
            self._engine.restore_grads()
        return result

    def _relog(self, recorder: LogRecorder, fx_name: str) -> None:
        module = self._module
        previous = getattr(module, "_current_fx_name", None)
        module._current_fx_name = fx_name
        try:
            recorder.replay(type(module).log.__get__(module))
        finally:
            module._current_fx_name = previous

    # -- validation -----------------------------------------------------------------

    def _install_validation(self, pl_module: Any, settings: StepSettings) -> None:
        fn = pl_module.validation_step
        base = _lightning_base(pl_module, "LightningModule")
        if not _overridden(pl_module, base, "validation_step"):
            return
        reasons = _frozen_reads(fn, "validation_step")
        if reasons:
            for reason in reasons:
                self._fall_back("validation", reason)
            return
        original = fn
        amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(settings.amp)

        def validation_step(batch: Any, *rest: Any, **kwargs: Any) -> Any:
            return self._validation_step(original, amp, batch, rest, kwargs)

        object.__setattr__(pl_module, "validation_step", validation_step)

    def _validation_step(self, original: Callable[..., Any], amp: Optional[torch.dtype],
                         batch: Any, rest: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        # batch_idx (rest[0]) is not read (checked); dataloader_idx is part of the key.
        key = (batch_signature(batch), tuple(batch_signature(r) for r in rest[1:]),
               tuple(sorted((k, batch_signature(v)) for k, v in kwargs.items())))
        entry = self._eval_graphs.get(key)
        if entry is None:
            seen = self._eval_seen.get(key, 0)
            self._eval_seen[key] = seen + 1
            if seen < 1 or key in self._eval_failed:  # a signature's first call runs eagerly
                self._counts["eval_eager"] += 1
                return original(batch, *rest, **kwargs)
            entry = self._capture_eval(original, amp, batch, rest, kwargs, key)
            if entry is None:
                self._counts["eval_eager"] += 1
                return original(batch, *rest, **kwargs)
        graph, recorder = entry
        try:
            output = graph(batch)
        except InputMismatchError as error:
            self._fall_back("a validation batch", f"the graph refused it: {error}")
            self._counts["eval_eager"] += 1
            return original(batch, *rest, **kwargs)
        self._counts["eval_replays"] += 1
        recorder.replay(type(self._module).log.__get__(self._module))
        return output

    def _capture_eval(self, original: Callable[..., Any], amp: Optional[torch.dtype], batch: Any,
                      rest: Tuple[Any, ...], kwargs: Dict[str, Any], key: Any) -> Any:
        recorder = LogRecorder(1)
        module = self._module

        def evaluate(b: Any) -> Any:
            # Lightning's autocast around validation_step keeps a cache of cast
            # weights; a capture that found the casts cached would replay stale
            # weights, so the graph's forward runs with the cache off.
            with _Recording(module, recorder), _autocast(amp):
                return original(b, *rest, **kwargs)

        if self._eval_pool is None:
            self._eval_pool = _graph_pool_handle()
        try:
            graph = _capture(evaluate, batch, warmup=1, pool=self._eval_pool, clone_outputs=True)
        except Exception as error:  # noqa: BLE001 - any capture failure falls back
            self._eval_failed.add(key)
            if not isinstance(error, GraphedError) and self.fallback == "raise":
                raise
            self._fall_back("validation batches of shape "
                            f"{describe_signature(key[0])}",
                            f"capture failed: {type(error).__name__}: {error}")
            return None
        entry = (graph, recorder)
        self._eval_graphs[key] = entry
        self._counts["eval_graphs"] += 1
        return entry

    # -- modules mode ---------------------------------------------------------------

    def _install_modules(self, pl_module: Any) -> None:
        if self._require_cuda and _device_problem(self._trainer):
            return
        had_forward = {id(m) for m in pl_module.modules() if "forward" in m.__dict__}
        cls = type(pl_module)
        try:
            _auto(pl_module, warmup=self.warmup, fallback=self.fallback,
                  **{k: v for k, v in self.auto_options.items() if v is not None})
        except GraphedError as error:
            self._fall_back("the module's blocks", f"graphed.auto refused them: {error}")
            return
        self._auto_class = cls
        self._auto_forwards = [m for m in pl_module.modules()
                               if "forward" in m.__dict__ and id(m) not in had_forward]
        self.active = "modules"

    def _undo_auto(self, pl_module: Any) -> None:
        for m in self._auto_forwards:
            m.__dict__.pop("forward", None)
        for attribute in ("_graphed_auto_manager", "_graphed_auto_notes"):
            pl_module.__dict__.pop(attribute, None)
        pl_module.__class__ = self._auto_class
        self._auto_class = None
        self._auto_forwards = []


class _autocast:
    """CUDA autocast to ``dtype`` with its cache off, or nothing."""

    def __init__(self, dtype: Optional[torch.dtype]) -> None:
        self.context = (torch.autocast("cuda", dtype=dtype, cache_enabled=False)
                        if dtype is not None else None)

    def __enter__(self) -> None:
        if self.context is not None:
            self.context.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.context is not None:
            self.context.__exit__(*exc)
