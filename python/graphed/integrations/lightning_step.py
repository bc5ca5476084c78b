"""The step mode of :class:`graphed.integrations.lightning.CUDAGraphs`, apart
from the callback: whether a fit can be captured (:func:`step_conditions`,
:class:`StepSettings`), batch signatures and the concatenation of an
accumulation window (:func:`batch_signature`, :func:`describe_signature`,
:func:`concat_batches`), ``self.log`` recorded under capture
(:class:`LogRecorder`), and the captured step itself
(:class:`TrainingStepModule`, :class:`StepEngine`, :class:`GraphedTraining`).

Nothing here imports Lightning: it reads the Trainer and module it is given.
``graphed.integrations.lightning`` re-exports every name."""

from __future__ import annotations

import dataclasses
import dis
import inspect
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .. import distributed
from .._C import GraphedError
from ..train import TrainStep, _fusable, training_iteration

__all__ = ["GraphedTraining", "LogRecorder", "StepEngine", "StepSettings", "TrainingStepModule",
           "batch_signature", "concat_batches", "ddp_problems", "ddp_wrapper",
           "describe_signature", "is_ddp_strategy", "step_conditions"]

#: Lightning's precision -> graphed's ``amp`` (what the captured step supports).
PRECISIONS = {"32-true": None, "32": None, "bf16-mixed": "bf16", "16-mixed": "fp16"}


# --- conditions -------------------------------------------------------------------


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


def is_ddp_strategy(strategy: Any) -> bool:
    """Whether ``strategy`` is Lightning's DDPStrategy (``strategy="ddp"``,
    ``"ddp_spawn"``, ...; not its subclasses such as DeepSpeed's)."""
    return type(strategy).__name__ == "DDPStrategy" and hasattr(strategy, "_setup_model")


def _device_problem(trainer: Any, *, ddp: bool = False) -> Optional[str]:
    """Why the Trainer's devices rule graphed out; ``ddp``: the step mode,
    which captures DDPStrategy's all-reduces (Note [DDP in Lightning's
    captured step])."""
    strategy = trainer.strategy
    device = getattr(strategy, "root_device", None)
    if device is None or device.type != "cuda":
        return (f"training runs on {device} and CUDA graphs need a CUDA device; use "
                "Trainer(accelerator='gpu')")
    if is_ddp_strategy(strategy):
        if ddp:
            return None
        return ("the strategy is DDPStrategy and mode='modules' (graphed.auto) supports one "
                "device (SingleDeviceStrategy): its graphed backward does not hand DDP's "
                "gradient hooks what they all-reduce. Use CUDAGraphs(mode='step'), which "
                "captures DDP's all-reduces with the step")
    if type(strategy).__name__ != "SingleDeviceStrategy":
        return (f"the strategy is {type(strategy).__name__}; CUDAGraphs supports one device "
                "(SingleDeviceStrategy) and DDP (strategy='ddp', mode='step'). Use one of "
                "those, or graphed.TrainStep with graphed.distributed.prepare_ddp")
    return None


def ddp_wrapper(trainer: Any) -> Optional[nn.Module]:
    """The DistributedDataParallel DDPStrategy wrapped the module in, or None
    (another strategy)."""
    strategy = trainer.strategy
    if not is_ddp_strategy(strategy):
        return None
    found = distributed.find_ddp([strategy.model]) if isinstance(strategy.model, nn.Module) \
        else []
    return found[0] if found else None


def ddp_problems(trainer: Any) -> List[str]:
    """What stops the step mode from capturing DDPStrategy's all-reduces
    (empty for another strategy): each problem of
    :func:`graphed.distributed.framework_ddp_problems`, with its fix."""
    strategy = trainer.strategy
    if not is_ddp_strategy(strategy):
        return []
    wrapper = ddp_wrapper(trainer)
    if wrapper is None:
        return [f"the strategy is DDPStrategy but its model is a "
                f"{type(strategy.model).__name__}, not a DistributedDataParallel; CUDAGraphs "
                "captures DDPStrategy's model as Lightning wraps it for fitting"]
    return [distributed.describe_problem(p).rstrip(".")
            for p in distributed.framework_ddp_problems(wrapper)]


def step_conditions(trainer: Any, pl_module: Any, callback: Any = None, *,
                    require_cuda: bool = True) -> Tuple[Optional[StepSettings], List[str]]:
    """Whether ``mode="step"`` can capture this fit: ``(settings, [])`` when it
    can, else ``(None, reasons)``, each reason saying what was found and how to
    fix it. Reads the Trainer and module after the optimizers are configured
    (``on_fit_start``); changes nothing."""
    reasons: List[str] = []
    if require_cuda:
        problem = _device_problem(trainer, ddp=True)
        if problem:
            reasons.append(problem)
    reasons.extend(ddp_problems(trainer))
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
    (``batch_idx``, which the step does not read). With ``wrapper`` (the
    DistributedDataParallel around ``pl_module``) training_step is called
    through the wrapper's forward, as Lightning's strategy calls it, so that
    DDP prepares its all-reduces (Note [DDP in Lightning's captured step])."""

    def __init__(self, pl_module: nn.Module, recorder: LogRecorder,
                 extra_args: Tuple[Any, ...] = (), wrapper: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.pl_module = pl_module
        # A submodule: the TrainStep finds the DDP among its modules.
        self.wrapper = wrapper
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
                output = self._training_step(batch)
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

    def _training_step(self, batch: Any) -> Any:
        module, wrapper = self.pl_module, self.wrapper
        if wrapper is None:
            return module.training_step(batch, *self.extra_args)
        # Lightning's forward redirection: the wrapper's forward calls
        # module.forward, which runs training_step once and puts forward back.
        original = module.__dict__.get("forward")

        def redirected(*args: Any, **kwargs: Any) -> Any:
            _restore_forward(module, original)
            return module.training_step(*args, **kwargs)

        object.__setattr__(module, "forward", redirected)
        try:
            return wrapper(batch, *self.extra_args)
        finally:
            _restore_forward(module, original)

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


def _restore_forward(module: nn.Module, original: Any) -> None:
    if original is None:
        module.__dict__.pop("forward", None)
    else:
        object.__setattr__(module, "forward", original)


# --- the captured step --------------------------------------------------------------


class StepEngine:
    """What the callback needs of a captured step, apart from the capture:
    the module's ``training_step`` as a loss (:class:`TrainingStepModule`),
    the batch signature, the optimizer's hyperparameters at capture, and the
    gradient and lr tensors the graph reads. :class:`GraphedTraining` adds the
    graph; the CPU tests add an eager step with the same semantics."""

    def __init__(self, pl_module: nn.Module, optimizer: torch.optim.Optimizer,
                 settings: StepSettings, sample_batch: Any,
                 extra_args: Tuple[Any, ...], wrapper: Optional[nn.Module] = None) -> None:
        self.optimizer = optimizer
        self.settings = settings
        self.recorder = LogRecorder(settings.microbatches)
        self.adapter = TrainingStepModule(pl_module, self.recorder, extra_args, wrapper)
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
                 warmup: int, wrapper: Optional[nn.Module] = None) -> None:
        super().__init__(pl_module, optimizer, settings, sample_batch, extra_args, wrapper)
        # Under DDP: at least COLLECTIVE_WARMUP_ITERS (Note [DDP built by a
        # framework] in python/graphed/distributed.py).
        self.warmup = distributed.collective_warmup([self.adapter], warmup)
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
        self.step_graph = TrainStep(self.iteration, (sample_batch,), warmup=self.warmup,
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
