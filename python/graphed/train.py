"""graphed.TrainStep: a whole training iteration captured as one CUDA graph.

The iteration (zero-grad, forward and backward over every microbatch, clipping,
the optimizer step) is captured once; ``step(batch)`` copies the batch into
static buffers and replays it, returning the loss as a device tensor without a
host sync. This module adapts torch objects (modules, optimizers) to the C++
core, which does the capture, the state snapshot and the replay."""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import _C, distributed, fp8, fsdp
from ._experts import capturable_experts
from ._C import GraphedError

logger = logging.getLogger(__name__)

_FUSED_KINDS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def _device_of(optimizer: torch.optim.Optimizer) -> torch.device:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params:
        raise GraphedError(f"{type(optimizer).__name__} has no parameters to train.")
    cpu = [i for i, p in enumerate(params) if not p.is_cuda]
    if cpu:
        raise GraphedError(
            f"{type(optimizer).__name__} parameter {cpu[0]} is on {params[cpu[0]].device}; a "
            "captured training step runs on the GPU. Move the model to the GPU (model.cuda()) "
            "before creating the optimizer.")
    return params[0].device


def _fusable(optimizer: torch.optim.Optimizer) -> bool:
    if type(optimizer) not in _FUSED_KINDS:
        return False
    dtypes = {torch.float32, torch.float16, torch.bfloat16, torch.float64}
    for group in optimizer.param_groups:
        if group.get("differentiable", False):
            return False
        for p in group["params"]:
            if p.dtype not in dtypes or p.is_sparse:
                return False
    return True


def _initial_state(optimizer: torch.optim.Optimizer, group: Dict[str, Any],
                   p: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The state a first step of ``optimizer`` starts from (see Note [Capturable
    optimizers] in include/graphed/optim.h)."""
    zeros = lambda: torch.zeros_like(p, memory_format=torch.preserve_format)  # noqa: E731
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        state = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                 "exp_avg": zeros(), "exp_avg_sq": zeros()}
        if group.get("amsgrad", False):
            state["max_exp_avg_sq"] = zeros()
        return state
    if isinstance(optimizer, torch.optim.SGD):
        return {"momentum_buffer": zeros()} if group.get("momentum", 0) else {}
    return {}


def make_capturable(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Prepares a torch.optim optimizer for capture, in place, and returns it.

    Adam, AdamW and SGD switch to their fused implementations (one kernel per
    dtype); other optimizers with a ``capturable`` flag get it set. The learning
    rate becomes a device tensor that LR schedulers update in place, so they keep
    working without recapture; step counters move to the device; state that a
    first step would create lazily is created now, with the values it would start
    from. Raises GraphedError for optimizers that cannot be captured."""
    device = _device_of(optimizer)
    name = type(optimizer).__name__
    fused = _fusable(optimizer)
    if not fused and "capturable" not in optimizer.defaults:
        raise GraphedError(
            f"{name} cannot be captured in a CUDA graph: it keeps its step on the host and has "
            "no `capturable` mode. Use Adam, AdamW or SGD (run fused), or an optimizer with "
            "capturable=True (Adamax, NAdam, RAdam, RMSprop, Rprop, ASGD, Adadelta).")
    for group in optimizer.param_groups:
        if isinstance(optimizer, torch.optim.SGD) and group["momentum"] and group["dampening"]:
            raise GraphedError(
                f"SGD with momentum and dampening={group['dampening']} cannot be captured: its "
                "first step copies the gradient into the momentum buffer undamped, a branch a "
                "replayed graph cannot take. Use dampening=0.")
        if fused:
            group["fused"] = True
            group["foreach"] = False
        if "capturable" in group:
            group["capturable"] = True
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state.update(_initial_state(optimizer, group, p))
            step = state.get("step")
            if isinstance(step, torch.Tensor) and not step.is_cuda:
                state["step"] = step.to(device=device, dtype=torch.float32)
    if fused:
        optimizer._step_supports_amp_scaling = True
    # Warm-up runs the step eagerly on purpose; torch would warn about it.
    optimizer._warned_capturable_if_run_uncaptured = True
    return optimizer


def _referenced_objects(fn: Callable[..., Any]) -> List[Any]:
    """Objects ``fn`` can reach directly: closure cells, the globals its code
    names, and ``self`` for a bound method."""
    objects: List[Any] = []
    target = getattr(fn, "__func__", fn)
    if hasattr(fn, "__self__"):
        objects.append(fn.__self__)
        objects.extend(vars(fn.__self__).values() if hasattr(fn.__self__, "__dict__") else [])
    for cell in getattr(target, "__closure__", None) or ():
        with contextlib.suppress(ValueError):
            objects.append(cell.cell_contents)
    code = getattr(target, "__code__", None)
    if code is not None:
        module_globals = getattr(target, "__globals__", {})
        objects.extend(module_globals[name] for name in code.co_names if name in module_globals)
    return objects


def find_training_objects(fn: Callable[..., Any], modules: Optional[Iterable[nn.Module]],
                          optimizers: Optional[Iterable[torch.optim.Optimizer]]
                          ) -> Tuple[List[nn.Module], List[torch.optim.Optimizer]]:
    """The modules and optimizers a step function updates: those given, else those
    it references directly."""
    found = _referenced_objects(fn) if modules is None or optimizers is None else []
    if modules is None:
        modules = [o for o in found if isinstance(o, nn.Module)]
    if optimizers is None:
        optimizers = [o for o in found if isinstance(o, torch.optim.Optimizer)]
    modules, optimizers = list(modules), list(optimizers)
    if not modules and not optimizers:
        raise GraphedError(
            "TrainStep could not find the model and optimizer the step function updates (it "
            "looks at the function's closure and the globals it names). Pass them: "
            "TrainStep(step_fn, batch, modules=[model], optimizers=[optimizer]), so that "
            "capture can restore them after warm-up.")
    return modules, optimizers


def _unique(tensors: Iterable[Optional[torch.Tensor]]) -> List[torch.Tensor]:
    seen, result = set(), []
    for t in tensors:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            result.append(t)
    return result


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    tensors = [v for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor)]
    tensors += [v for group in optimizer.param_groups for k, v in group.items()
                if k != "params" and isinstance(v, torch.Tensor)]
    return tensors


def training_state(modules: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
                   extra: Iterable[torch.Tensor] = ()) -> List[torch.Tensor]:
    """Every tensor a training iteration changes, for the capture's snapshot."""
    tensors: List[Optional[torch.Tensor]] = []
    for module in modules:
        for p in module.parameters():
            tensors += [p, p.grad]
        tensors += list(module.buffers())
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                tensors += [p, p.grad]
        tensors += _optimizer_tensors(optimizer)
    tensors += list(extra)
    return _unique(tensors)


_FIRST_STEP_VALUES = {"step": 0.0, "mu_product": 1.0}


def _reset_lazy_state(optimizers: Sequence[torch.optim.Optimizer], known: set) -> None:
    """Optimizers we cannot pre-initialise create state in warm-up; give the state
    that did not exist before the value a first step starts from."""
    with torch.no_grad():
        for optimizer in optimizers:
            for state in optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and id(value) not in known:
                        value.fill_(_FIRST_STEP_VALUES.get(key, 0.0))


# --- batches and losses ---------------------------------------------------------
# Note [Batch forms]
# ~~~~~~~~~~~~~~~~~~
# A training step takes its batch in one of the forms users write:
#  - ``(inputs, targets)`` with a ``loss_fn``: ``loss_fn(model(*inputs), targets)``
#    (``inputs`` a tensor or a tuple of positional arguments);
#  - a dict (Hugging Face style: ``input_ids``, ``attention_mask``, ``labels``):
#    ``model(**batch)``, the loss taken from the output (``output.loss``), or
#    ``loss_fn(output, batch)`` when a loss function is given;
#  - with ``loss_fn=None``, a tuple or a tensor too: ``model(*batch)`` or
#    ``model(batch)``, the loss taken from the output.
# A model whose forward takes ``use_cache`` (transformers' causal LMs and
# encoder-decoders) would build a key/value cache in every training forward,
# an object no graph can replay and training never reads: graphed's step
# passes ``use_cache=False`` unless the batch sets it, and says so in its
# ``notes``. The eager steps graphed measures against run as the user's would.


def _forward_parameters(model: nn.Module) -> Dict[str, inspect.Parameter]:
    target = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    try:
        return dict(inspect.signature(target.forward).parameters)
    except (TypeError, ValueError):
        return {}


def takes_use_cache(model: nn.Module) -> bool:
    """Whether the forward takes ``use_cache``: by name, or through ``**kwargs``
    of a model whose config has ``use_cache`` (transformers' causal LMs that
    hand their keyword arguments down to the base model, e.g. granite-moe-hybrid)."""
    parameters = _forward_parameters(model)
    if "use_cache" in parameters:
        return True
    target = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    has_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return has_kwargs and getattr(getattr(target, "config", None), "use_cache", None) is not None


def training_forward_kwargs(model: nn.Module, batch: Any) -> Tuple[Dict[str, Any], List[str]]:
    """Keyword arguments graphed adds to a training forward, and notes saying
    why (see Note [Batch forms]): ``use_cache=False`` where the forward takes
    ``use_cache`` and the batch does not set it."""
    if not takes_use_cache(model):
        return {}, []
    if isinstance(batch, dict) and "use_cache" in batch:
        return {}, []
    return {"use_cache": False}, [
        f"use_cache=False for the graphed step: {type(model).__name__}.forward would otherwise "
        "build a key/value cache in every training forward, which training never reads and a "
        "graph cannot replay"]


def loss_from_output(output: Any, model: nn.Module) -> torch.Tensor:
    """The loss a model returned itself: ``output.loss`` (transformers'
    ``ModelOutput``), ``output["loss"]``, the first element of a tuple, or the
    output when it is a single-element tensor."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)) and output:
        loss = output[0]
    if loss is None and isinstance(output, torch.Tensor):
        loss = output
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        raise GraphedError(
            f"With loss_fn=None the loss comes from the model's output, but "
            f"{type(model).__name__} returned {type(output).__name__} without one (expected "
            "output.loss, output['loss'], a tuple starting with the loss, or a single-element "
            "tensor). Put the labels in the batch (e.g. batch['labels'] for transformers models) "
            "or pass loss_fn.")
    return loss


def batch_loss(model: nn.Module, loss_fn: Optional[Callable[..., torch.Tensor]], batch: Any,
               extra_kwargs: Optional[Dict[str, Any]] = None) -> torch.Tensor:
    """The loss of one forward on ``batch`` in any of the forms of Note
    [Batch forms]; ``extra_kwargs`` go to the forward as keyword arguments."""
    extra = extra_kwargs or {}
    if isinstance(batch, dict):
        output = model(**batch, **extra)
        return loss_from_output(output, model) if loss_fn is None else loss_fn(output, batch)
    if loss_fn is None:
        args = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        return loss_from_output(model(*args, **extra), model)
    inputs, targets = batch
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    return loss_fn(model(*args, **extra), targets)


def check_batch_form(batch: Any, loss_fn: Optional[Callable[..., torch.Tensor]]) -> None:
    """Raises GraphedError with the accepted forms when ``batch`` fits none
    (Note [Batch forms])."""
    if isinstance(batch, dict) or loss_fn is None:
        return
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        found = (f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list))
                 else type(batch).__name__)
        raise GraphedError(
            f"Expected sample_batch to be (inputs, targets) for loss_fn(model(*inputs), targets), "
            f"or a dict of model arguments (model(**batch)), got {found}. With a model that "
            "computes its loss (transformers models given labels), pass loss_fn=None.")


def split_batch(value: Any, parts: int) -> List[Any]:
    """``value`` split into ``parts`` microbatches along dim 0: tensors
    chunked, tuples, lists and dicts split element-wise, anything else
    repeated."""
    if parts == 1:
        return [value]
    if isinstance(value, torch.Tensor):
        chunks = list(torch.chunk(value, parts))
        if len(chunks) != parts:
            raise GraphedError(
                f"Expected every batch tensor to split into microbatches={parts} along dim 0, got "
                f"a tensor of shape {tuple(value.shape)}. Use a batch size divisible by {parts}.")
        return chunks
    if isinstance(value, dict):
        columns = {key: split_batch(item, parts) for key, item in value.items()}
        return [{key: columns[key][i] for key in value} for i in range(parts)]
    if isinstance(value, (tuple, list)):
        columns = [split_batch(item, parts) for item in value]
        return [type(value)(column[i] for column in columns) if isinstance(value, list)
                else tuple(column[i] for column in columns) for i in range(parts)]
    return [value] * parts


def _optimizer_step(optimizer: torch.optim.Optimizer, found_inf: Optional[torch.Tensor]) -> None:
    """torch.optim's fused steps read the skip flag from ``optimizer.found_inf``,
    where torch.amp.GradScaler puts it."""
    if found_inf is not None:
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    optimizer.step()


def training_iteration(model: nn.Module, optimizer: torch.optim.Optimizer,
                       loss_fn: Optional[Callable[..., torch.Tensor]], sample_batch: Any, *,
                       microbatches: int = 1, clip_grad_norm: Optional[float] = None,
                       amp: Optional[str] = None, skip_nonfinite: bool = False,
                       loss_scaling: Optional[_C.LossScaling] = None
                       ) -> Tuple[Callable[[Any], torch.Tensor], Any]:
    """The iteration :meth:`TrainStep.from_parts` captures, and its gradient guard.

    Makes ``optimizer`` capturable (:func:`make_capturable`) and hands the
    model, loss and optimizer as pieces to the C++ core's iteration
    (``_C.TrainingIteration``, which owns the order of operations). Returns
    ``(iteration, guard)``: ``iteration(batch)`` runs one step eagerly and
    returns the mean loss; ``guard.state()`` lists the guard's tensors;
    ``iteration.notes`` says what graphed changed about the forward (Note
    [Batch forms]). graphed.advise traces this function to predict the
    captured step."""
    if amp not in (None, "bf16", "fp16"):
        raise GraphedError(f'Expected amp to be None, "bf16" or "fp16", got {amp!r}.')
    if microbatches < 1:
        raise GraphedError(f"Expected microbatches >= 1, got {microbatches}.")
    check_batch_form(sample_batch, loss_fn)
    extra_kwargs, notes = training_forward_kwargs(model, sample_batch)
    target = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    notes = capturable_experts(target) + notes
    make_capturable(optimizer)
    scaling = loss_scaling or (_C.LossScaling() if amp == "fp16" else None)
    if (skip_nonfinite or scaling is not None) and not _fusable(optimizer):
        raise GraphedError(
            f"Skipping non-finite steps inside the graph needs an optimizer whose step reads "
            f"a device flag: fused Adam, AdamW or SGD; got {type(optimizer).__name__}. "
            "Use one of those, or skip_nonfinite=False.")
    # The order of operations lives in the C++ core (Note [One training
    # iteration] in include/graphed/training_iteration.h); these are its
    # nn.Module and torch.optim pieces. The guard puts the model's buffers
    # back after a skipped step (Note [Buffers of a skipped step]).
    # Delayed FP8 scaling ends each step after the last backward and before
    # the optimizer step (graphed.fp8.update_scales: one all_reduce, one
    # kernel), inside the captured iteration. Its state is packed into the
    # model's flat buffers now, before a capture collects them.
    float8_scaling = fp8.has_delayed_scaling(model)
    if float8_scaling:
        fp8.prepare(model)

    def step(found_inf: Optional[torch.Tensor]) -> None:
        if float8_scaling:
            fp8.update_scales(model)
        _optimizer_step(optimizer, found_inf)

    core = _C.TrainingIteration(
        loss=lambda micro_batch: batch_loss(model, loss_fn, micro_batch, extra_kwargs),
        split=split_batch,
        zero_grad=lambda: optimizer.zero_grad(set_to_none=True),
        step=step,
        params=[p for group in optimizer.param_groups for p in group["params"]],
        buffers=list(model.buffers()), microbatches=microbatches,
        skip_nonfinite=skip_nonfinite, clip_grad_norm=clip_grad_norm, loss_scaling=scaling,
        autocast={"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp))

    def iteration(batch: Any) -> torch.Tensor:
        return core(batch)

    iteration.__qualname__ = f"TrainStep.from_parts({type(model).__name__})"
    iteration.notes = notes  # type: ignore[attr-defined]
    return iteration, core.guard


@dataclass(frozen=True)
class StepSettings:
    """How a training step runs beyond its model, optimizer, loss and batch:
    the settings of :meth:`TrainStep.from_parts` that graphed.optimize and
    graphed.advise_training take too, so that they verify and predict the step
    the user trains with (bf16 autocast, clipping, gradient accumulation, a
    non-finite guard), against an eager step with the same settings
    (graphed.advise.eager_training_step). fp16 autocast is not among them: its
    eager reference would need torch.amp.GradScaler's loss scaling, which
    graphed's in-graph scaling does not reproduce step for step."""

    #: None, or "bf16": forward and loss under bf16 autocast, weights as they are.
    amp: Optional[str] = None
    #: The batch split into this many microbatches along dim 0 (gradient accumulation).
    microbatches: int = 1
    #: Gradients clipped to this global norm before the optimizer step.
    clip_grad_norm: Optional[float] = None
    #: A step whose loss or gradients are not finite changes nothing.
    skip_nonfinite: bool = False

    def __post_init__(self) -> None:
        if self.amp not in (None, "bf16"):
            raise GraphedError(
                f'Expected amp to be None or "bf16", got {self.amp!r}. fp16 autocast needs '
                'loss scaling, whose eager reference (torch.amp.GradScaler) graphed does not '
                'reproduce step for step: use graphed.TrainStep.from_parts(..., amp="fp16").')
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or \
                self.microbatches < 1:
            raise GraphedError(f"Expected microbatches to be an int >= 1, got "
                               f"{self.microbatches!r}. Pass the number of microbatches the "
                               "batch splits into along dim 0.")
        if self.clip_grad_norm is not None and not (
                isinstance(self.clip_grad_norm, (int, float)) and self.clip_grad_norm > 0):
            raise GraphedError(f"Expected clip_grad_norm to be None or a positive number, got "
                               f"{self.clip_grad_norm!r}.")
        if not isinstance(self.skip_nonfinite, bool):
            raise GraphedError(f"Expected skip_nonfinite to be a bool, got "
                               f"{self.skip_nonfinite!r}.")

    def from_parts_kwargs(self) -> Dict[str, Any]:
        """The keyword arguments of TrainStep.from_parts for these settings."""
        return {"amp": self.amp, "microbatches": self.microbatches,
                "clip_grad_norm": self.clip_grad_norm, "skip_nonfinite": self.skip_nonfinite}

    def describe(self) -> str:
        """The settings that differ from the plain step, as keyword arguments."""
        plain = StepSettings()
        return ", ".join(f"{k}={v!r}" for k, v in self.from_parts_kwargs().items()
                         if v != getattr(plain, k)) or "the plain step"


class TrainStep:
    """A whole training iteration captured as one CUDA graph.

    ``step_fn(batch)`` does the whole iteration (zero-grad, forward, backward,
    optimizer step) and returns the loss. The optimizers it uses are made
    capturable (:func:`make_capturable`); the modules and optimizers are found in
    the function's closure, or given with ``modules=`` and ``optimizers=``.
    Warm-up and capture change nothing: parameters, gradients, buffers,
    optimizer state and random generators are restored afterwards, so the first
    :meth:`step` equals eager's first step.

    After construction each parameter's ``.grad`` is the graph's gradient buffer,
    refreshed by every :meth:`step`. Do not call ``optimizer.zero_grad()`` between
    steps: the captured iteration clears gradients itself, and dropping them would
    detach ``.grad`` from the memory the graph writes.

    Args:
        step_fn: the iteration; called with one argument, the batch.
        sample_batch: a batch like those :meth:`step` will get (nested tuples,
            lists and dicts of CUDA tensors).
        warmup: eager iterations before capture.
        microbatches: when set, the batch is a sequence of this many microbatches.
        modules, optimizers: what the iteration updates (found automatically
            when omitted).
        state: further tensors the iteration changes (e.g. a loss scaler's).
        pool: a memory pool handle to capture into.
        capture_error_mode: ``"global"``, ``"thread_local"`` or ``"relaxed"``.
        clone_loss: return a loss that stays valid after the next step.

    Under DistributedDataParallel (a DDP module among ``modules``) the gradient
    all-reduces are captured too. Build the DDP with
    :func:`graphed.distributed.prepare_ddp` (on graphed's capture stream); the
    defaults become ``warmup=11`` and ``capture_error_mode="thread_local"``; what
    cannot work (backend, NCCL environment, DDP options) is refused here with
    the fix; end with :func:`graphed.distributed.shutdown`, which releases the
    graph before the process group. See Note [Capturing collectives] in
    include/graphed/train_step.h.

    Under FSDP2 (``modules`` holding a model sharded with ``fully_shard``,
    sharded as a whole and per block) the unshards, all-gathers and
    reduce-scatters are captured with the step, and the optimizer steps the
    sharded parameters; the default capture mode becomes ``"thread_local"``;
    what cannot be captured (CPU offload, resharding the root after forward,
    gradient sync off, ...) is refused here with the fix (see
    :func:`graphed.fsdp.check_fsdp2` and Note [FSDP2 inside a captured step]
    in python/graphed/fsdp.py). End with :func:`graphed.distributed.shutdown`.
    """

    def __init__(self, step_fn: Callable[[Any], torch.Tensor], sample_batch: Any, *,
                 warmup: Optional[int] = None, microbatches: Optional[int] = None,
                 modules: Optional[Iterable[nn.Module]] = None,
                 optimizers: Optional[Iterable[torch.optim.Optimizer]] = None,
                 state: Iterable[torch.Tensor] = (), pool: Optional[Tuple[int, int]] = None,
                 capture_error_mode: Optional[str] = None, clone_loss: bool = True,
                 guard: Optional[Any] = None) -> None:
        if microbatches is not None:
            if not isinstance(sample_batch, (list, tuple)) or len(sample_batch) != microbatches:
                found = (f"a {type(sample_batch).__name__} of {len(sample_batch)}"
                         if isinstance(sample_batch, (list, tuple))
                         else type(sample_batch).__name__)
                raise GraphedError(
                    f"Expected sample_batch to be a list or tuple of {microbatches} microbatches "
                    f"(microbatches={microbatches}), got {found}.")
        self.modules, self.optimizers = find_training_objects(step_fn, modules, optimizers)
        hooked = distributed.collective_capture(self.modules)
        # FSDP2: checked, lazily initialised, its unsharded Parameters fresh
        # (Note [FSDP2 inside a captured step] in python/graphed/fsdp.py).
        sharded = fsdp.prepare_capture(self.modules, error_mode=capture_error_mode)
        if warmup is None:
            warmup = 3 if hooked is None else distributed.COLLECTIVE_WARMUP_ITERS
        if capture_error_mode is None:
            capture_error_mode = ("global" if hooked is None and sharded is None
                                  else distributed.COLLECTIVE_CAPTURE_ERROR_MODE)
        for optimizer in self.optimizers:
            make_capturable(optimizer)
        self.guard = guard
        #: What graphed changed about the step, for reports (e.g. use_cache=False).
        self.notes: List[str] = []
        tensors = training_state(self.modules, self.optimizers, state)
        known = {id(t) for t in tensors}
        # Each step checks that the modules still hold the tensors the graph
        # trains (Note [Tensors a graph reads in place]).
        submodules = [m for module in self.modules for m in module.modules()]
        if sharded is None:
            core_state = tensors
            tensor_dicts = [m._parameters for m in submodules] + [m._buffers for m in submodules]
        else:
            # The core works on storage: DTensors become their local shards.
            core_state = fsdp.local_tensors(tensors)
            tensor_dicts = fsdp.tensor_dicts(submodules)
        #: FSDP2's parameter groups, resharded before a step when an eager
        #: forward between steps left them unsharded (see step()).
        self._fsdp_groups = [] if sharded is None else [
            g for root in sharded.roots for s in root._get_fsdp_state()._state_ctx.all_states
            for g in fsdp.param_groups(s)]
        try:
            self._core = _C.TrainStep(step_fn, sample_batch, warmup,
                                      None if pool is None else tuple(pool), capture_error_mode,
                                      core_state, clone_loss, _describe(step_fn), hooked,
                                      tensor_dicts=tensor_dicts)
        except BaseException:
            if sharded is not None:
                # The core put the tensors back; FSDP2's Python state stopped
                # mid-step (Note [FSDP2 inside a captured step], point 6).
                fsdp.reset_after_failure(sharded)
            raise
        logger.debug("TrainStep: captured %s (%d tensors of training state)",
                     _describe(step_fn), len(tensors))
        if hooked is not None or sharded is not None:
            distributed.register(self)
        # Replays change FP8 layers' weights without a version bump: each step
        # starts a new weight-cast epoch (Note [The weight is cast once per step]).
        self._float8 = any(fp8.float8_layers(module) for module in self.modules)
        _reset_lazy_state(self.optimizers, known)
        # Gradients the capture created (a step that drops them allocates new
        # ones in the graph's pool) hold garbage until the first step: zero them.
        with torch.no_grad():
            for module in self.modules:
                for p in module.parameters():
                    if p.grad is not None and id(p.grad) not in known:
                        p.grad.zero_()

    @classmethod
    def from_parts(cls, model: nn.Module, optimizer: torch.optim.Optimizer,
                   loss_fn: Optional[Callable[..., torch.Tensor]], sample_batch: Any, *,
                   microbatches: int = 1, clip_grad_norm: Optional[float] = None,
                   amp: Optional[str] = None, skip_nonfinite: bool = False,
                   loss_scaling: Optional[_C.LossScaling] = None, warmup: Optional[int] = None,
                   pool: Optional[Tuple[int, int]] = None,
                   capture_error_mode: Optional[str] = None) -> "TrainStep":
        """The usual iteration, built from its parts.

        ``sample_batch`` is ``(inputs, targets)`` (``inputs`` a tensor or a tuple of
        model arguments), or a dict of model arguments (``model(**batch)``); with
        ``loss_fn=None`` the loss is the model's own (``output.loss``, as
        transformers models return it when the batch holds ``labels``). A forward
        that takes ``use_cache`` gets ``use_cache=False`` (``step.notes`` says so;
        see Note [Batch forms] in this file). Each step: gradients dropped (they are written fresh,
        no memset), the batch split into ``microbatches`` along dim 0, forward
        (under ``amp``: ``"bf16"`` autocast, or ``"fp16"`` autocast with dynamic
        loss scaling), ``loss_fn(output, targets) / microbatches``, backward;
        then the non-finite check (``skip_nonfinite``: a step whose loss or
        gradients are not finite leaves weights, optimizer state and the
        model's buffers, such as BatchNorm statistics, untouched),
        clipping to ``clip_grad_norm``, the optimizer step, and the loss-scale
        update. Returns the mean loss. ``model`` may be a DistributedDataParallel
        (see the class documentation). A model with FP8 layers of delayed
        scaling (:func:`graphed.fp8.convert`) gets :func:`graphed.fp8.update_scales`
        after the last backward, before the optimizer step, inside the graph."""
        distributed.collective_capture([model])  # DDP problems first, before any other work
        if fsdp.find_fsdp2([model]):
            # FSDP2 problems too, and its lazy init before make_capturable
            # creates optimizer state (Note [FSDP2 inside a captured step]).
            fsdp.raise_problems(fsdp.check_step_settings(
                clip_grad_norm=clip_grad_norm, skip_nonfinite=skip_nonfinite, amp=amp,
                loss_scaling=loss_scaling, float8=bool(fp8.float8_layers(model))))
            fsdp.prepare_capture([model], error_mode=capture_error_mode)
        iteration, guard = training_iteration(
            model, optimizer, loss_fn, sample_batch, microbatches=microbatches,
            clip_grad_norm=clip_grad_norm, amp=amp, skip_nonfinite=skip_nonfinite,
            loss_scaling=loss_scaling)
        step = cls(iteration, sample_batch, warmup=warmup, modules=[model],
                   optimizers=[optimizer], state=guard.state(), pool=pool,
                   capture_error_mode=capture_error_mode, guard=guard)
        step.notes = list(iteration.notes)
        return step

    def step(self, batch: Any) -> torch.Tensor:
        """Copies ``batch`` into the static buffers, replays the iteration and
        returns the loss (a device tensor; no host sync)."""
        if getattr(self, "_float8", False):
            _C.advance_float8_weight_epoch()
        for group in getattr(self, "_fsdp_groups", ()):
            # An eager FSDP2 forward between steps (evaluation, no backward)
            # leaves unsharded parameters that this step's update would make
            # stale; a later eager forward would skip its unshard and use them.
            if not group.is_sharded:
                group.reshard()
        return self._core.step(batch)

    __call__ = step

    def capture_eval(self, fn: Callable[..., Any], *sample_args: Any, warmup: int = 1,
                     **sample_kwargs: Any) -> None:
        """Captures ``fn`` (forward only, no autograd) into the same memory pool;
        :meth:`evaluate` replays it. Model state is restored after its warm-up.
        Not under FSDP2 (evaluate eagerly between steps there)."""
        if getattr(self, "_fsdp_groups", None):
            raise GraphedError(
                "capture_eval is not supported under FSDP2: an evaluation forward has no "
                "backward, so FSDP2 leaves the root's parameters unsharded after it, in memory "
                "the training graph does not own. Evaluate eagerly between steps (model(x) "
                "under torch.no_grad()); the next step() reshards first.")
        self._core.capture_eval(fn, tuple(sample_args), dict(sample_kwargs), warmup)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """Replays the evaluation graph on new inputs."""
        return self._core.evaluate(*args, **kwargs)

    def release(self) -> None:
        """Destroys the captured graphs and frees their memory, once the GPU has
        finished every step. Required before the process group of captured
        all-reduces is destroyed (graphed.distributed.shutdown does it). Later
        steps raise. Does nothing the second time."""
        self._core.release()

    @property
    def released(self) -> bool:
        """True once :meth:`release` ran."""
        return self._core.released

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because the loss or a gradient was not finite (reads a
        device counter: synchronizes)."""
        return self.guard.skipped_steps if self.guard is not None else 0

    @property
    def loss_scale(self) -> Optional[float]:
        """The current fp16 loss scale, or None (synchronizes)."""
        return self.guard.loss_scale if self.guard is not None else None

    @property
    def static_batch(self) -> List[torch.Tensor]:
        """The static batch buffers, in signature order."""
        return self._core.static_batch

    def stats(self) -> Dict[str, Any]:
        """Graph nodes and kernels, pool memory, capture and warm-up time, steps."""
        stats = dict(self._core.graph_stats())
        stats["steps"] = self._core.steps
        return stats

    @property
    def pool(self) -> Tuple[int, int]:
        """The memory pool handle of the captured iteration."""
        return self._core.graph_stats()["pool"]


def _describe(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return f"training step `{name}`" if name else "the training step"
