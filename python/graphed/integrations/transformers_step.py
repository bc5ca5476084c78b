"""The parts of ``graphed.integrations.transformers`` that need no Trainer
class: what keeps a Trainer from running graphed and the mode it runs in
(:func:`training_blockers`, :func:`step_blockers`, :func:`choose_mode`), the
batches of an optimizer step (:func:`batch_signature`,
:func:`describe_signature`, :func:`merge_microbatches`), the report
(:class:`GraphedTrainerReport`), one micro-batch's loss as the Trainer
computes it (``_TrainerLoss``) and the per-Trainer state (``_GraphedState``).

They take plain values (or the Trainer instance they are given), so that the
CPU tests cover them; this module does not import transformers.
``graphed.integrations.transformers`` re-exports every name."""

from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._C import GraphedError

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from transformers import Trainer

__all__ = ["CAPTURABLE_OPTIMS", "DDP_TYPES", "GraphedTrainerReport", "batch_signature",
           "choose_mode", "describe_signature", "merge_microbatches", "modules_blockers",
           "step_blockers", "training_blockers"]

# The logger of graphed.integrations.transformers: the report logs its fallbacks there.
logger = logging.getLogger("graphed.integrations.transformers")

MODES = ("step", "modules")
FALLBACKS = ("eager", "modules", "raise")

#: ``TrainingArguments.optim`` values whose optimizer graphed can capture
#: (graphed.make_capturable): AdamW and SGD run fused, RMSprop capturable.
CAPTURABLE_OPTIMS = ("adamw_torch_fused", "adamw_torch", "sgd", "rmsprop")

#: accelerate's distributed types whose Trainer wraps the model in
#: DistributedDataParallel (one process per GPU), which mode="step" captures.
DDP_TYPES = ("MULTI_GPU",)

# The batch key that carries the Trainer's num_items_in_batch into the
# captured step (one entry per micro-batch, so that it splits with them).
_ITEMS_KEY = "__graphed_num_items_in_batch__"


def _plain_value(value: Any) -> Any:
    return getattr(value, "value", value)  # enums such as DistributedType print as their value


def training_blockers(*, device_type: str, n_gpu: int = 1, world_size: int = 1,
                      distributed_type: Any = "NO", deepspeed: bool = False,
                      fsdp: bool = False, torch_compile: bool = False,
                      parallelism: bool = False) -> List[str]:
    """What keeps a Trainer from running graphed at all (any mode, evaluation
    included), each reason saying what was expected, what was found and the
    fix. Empty when nothing does. Takes plain values so that it runs without
    a Trainer (see :func:`trainer_blockers`)."""
    reasons = []
    if device_type != "cuda":
        reasons.append(
            f"graphed needs the Trainer to run on a CUDA GPU, found device {device_type!r} "
            "(use_cpu=True, or no GPU visible). Train on a GPU; elsewhere the plain Trainer runs.")
    if deepspeed:
        reasons.append(
            "DeepSpeed is not supported by graphed yet: its engine runs the backward, the "
            "optimizer step and their communication outside a capturable step. Found a "
            "DeepSpeed config (TrainingArguments.deepspeed); train without it to use graphed.")
    if fsdp:
        reasons.append(
            "FSDP is not supported by graphed yet: its parameter gathering and gradient "
            "reduction run outside a capturable step. Found TrainingArguments.fsdp set; train "
            "without FSDP to use graphed.")
    if n_gpu > 1:
        reasons.append(
            f"Expected one GPU per process, found n_gpu={n_gpu} (the Trainer wraps the model in "
            "DataParallel over every visible GPU), which graphed does not support. Make one GPU "
            "visible (CUDA_VISIBLE_DEVICES=0).")
    kind = str(_plain_value(distributed_type)).upper()
    if kind not in ("NO", "NONE") + DDP_TYPES or (world_size > 1 and kind not in DDP_TYPES):
        reasons.append(
            f"Expected one process on one GPU, or DistributedDataParallel over GPUs (accelerate's "
            f"MULTI_GPU, as torchrun gives), found world_size={world_size}, distributed type "
            f"{_plain_value(distributed_type)}, which graphed.integrations.transformers does not "
            "support. Launch with torchrun (one process per GPU) without DeepSpeed or FSDP, or "
            "capture your own DistributedDataParallel loop with graphed.TrainStep "
            "(graphed.distributed).")
    if torch_compile:
        reasons.append(
            "Expected torch_compile=False: the Trainer compiles the model with torch.compile, "
            "whose own graphs and guards conflict with graphed's capture. Use one of the two: "
            "torch_compile=False with graphed, or the plain Trainer with torch_compile=True.")
    if parallelism:
        reasons.append(
            "Context, tensor or sequence parallelism (TrainingArguments.parallelism_config) is "
            "not supported by graphed; train without it to use graphed.")
    return reasons


def step_blockers(*, optim: Optional[str], custom_optimizer: bool = False,
                  gradient_checkpointing: bool = False, fp16: bool = False,
                  half_precision_backend: str = "auto",
                  training_step_owner: Optional[str] = None, ddp: bool = False,
                  ddp_find_unused_parameters: Optional[bool] = None,
                  ddp_static_graph: Optional[bool] = None) -> List[str]:
    """What keeps mode="step" (one graph per optimizer step) from applying,
    beyond :func:`training_blockers`. ``optim`` is ``TrainingArguments.optim``
    (ignored with ``custom_optimizer``: an optimizer given to the Trainer is
    checked when the step is captured); ``training_step_owner`` names a class
    that overrides ``Trainer.training_step``. With ``ddp`` (the Trainer wraps
    the model in DistributedDataParallel) ``ddp_find_unused_parameters`` and
    ``ddp_static_graph`` are the TrainingArguments of those names; the DDP
    the Trainer built is checked again when the step is captured (Note [DDP in
    the Trainer's captured step])."""
    reasons = []
    if ddp:
        # The Trainer's default (None) is True unless gradient checkpointing is
        # on, which mode="step" refuses anyway.
        find_unused = True if ddp_find_unused_parameters is None else ddp_find_unused_parameters
        if find_unused and not ddp_static_graph:
            found = ("unset (the Trainer then passes find_unused_parameters=True)"
                     if ddp_find_unused_parameters is None else "True")
            reasons.append(
                f"Expected ddp_find_unused_parameters=False for mode='step' under "
                f"DistributedDataParallel, found it {found}: DDP then searches the autograd "
                "graph on the host every iteration, which a replayed graph cannot do. Set "
                "TrainingArguments(ddp_find_unused_parameters=False) (every parameter must get "
                "a gradient), or ddp_static_graph=True when the unused parameters never change.")
    optim_name = str(_plain_value(optim)) if optim is not None else None
    if not custom_optimizer and optim_name not in CAPTURABLE_OPTIMS:
        reasons.append(
            f"Expected an optimizer graphed can capture, found optim={optim_name!r}. Use "
            "optim='adamw_torch_fused' (fused AdamW, one kernel per dtype), 'adamw_torch' or "
            "'sgd' (run fused by graphed.make_capturable), or 'rmsprop' (capturable); or "
            "mode='modules', which leaves the optimizer eager.")
    if gradient_checkpointing:
        reasons.append(
            "Expected gradient_checkpointing=False for mode='step': checkpointing recomputes "
            "activations in backward and saves random-generator state on the host, which a "
            "captured step cannot replay. Turn it off, or use mode='modules'.")
    if fp16 and half_precision_backend not in ("auto", "cpu_amp", None):
        reasons.append(
            f"Expected half_precision_backend='auto' with fp16=True, found "
            f"{half_precision_backend!r}. graphed scales the fp16 loss itself (amp='fp16').")
    if training_step_owner is not None:
        reasons.append(
            f"{training_step_owner}.training_step overrides Trainer.training_step; mode='step' "
            "replaces training_step with one captured optimizer step and cannot run yours. Put "
            "custom loss code in compute_loss (graphed captures the Trainer's compute_loss), or "
            "use mode='modules'.")
    return reasons


def modules_blockers(*, ddp: bool = False) -> List[str]:
    """What keeps mode="modules" (graphed.auto under the Trainer's loop) from
    applying, beyond :func:`training_blockers`."""
    reasons = []
    if ddp:
        reasons.append(
            "Expected one process without DistributedDataParallel for mode='modules', found "
            "the Trainer wrapping the model in DDP: graphed.auto's graphed backward does not "
            "hand DDP's gradient hooks what they all-reduce. Use mode='step', which captures "
            "DDP's all-reduces with the step.")
    return reasons


def choose_mode(requested: str, fallback: str, training: Sequence[str],
                step: Sequence[str], modules: Sequence[str] = ()) -> Tuple[str, List[str]]:
    """The mode a Trainer runs in, and the reasons it is not ``requested``.

    ``training``, ``step`` and ``modules`` are the reasons of
    :func:`training_blockers`, :func:`step_blockers` and
    :func:`modules_blockers`. Returns ``("step" | "modules" | "eager",
    reasons)``; raises GraphedError with the reasons when ``fallback`` is
    ``"raise"`` and the requested mode cannot run."""
    _check_choice("mode", requested, MODES)
    _check_choice("fallback", fallback, FALLBACKS)
    own = list(step) if requested == "step" else list(modules)
    reasons = list(training) + own
    if not reasons:
        return requested, []
    if fallback == "raise":
        raise GraphedError(f"graphed cannot run the Trainer in mode={requested!r}: "
                           + " ".join(reasons))
    if fallback == "modules" and requested == "step" and not training:
        if not modules:
            return "modules", reasons
        return "eager", reasons + list(modules)
    return "eager", reasons


def _check_choice(name: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise GraphedError(
            f"Expected {name} to be one of {', '.join(repr(a) for a in allowed)}, got {value!r}.")


def batch_signature(batch: Any) -> Tuple:
    """What a captured graph fixes about a batch: keys, and per tensor its
    shape, dtype and device; other values as they are."""
    if isinstance(batch, dict):
        return tuple((key, batch_signature(value)) for key, value in batch.items())
    if isinstance(batch, (list, tuple)):
        return (type(batch).__name__,) + tuple(batch_signature(v) for v in batch)
    if isinstance(batch, torch.Tensor):
        return ("tensor", tuple(batch.shape), str(batch.dtype), str(batch.device))
    return ("value", repr(batch))


def describe_signature(signature: Tuple) -> str:
    """A short form of :func:`batch_signature` for messages: key: shape."""
    parts = []
    for entry in signature:
        if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], tuple) \
                and entry[1] and entry[1][0] == "tensor":
            parts.append(f"{entry[0]}: {list(entry[1][1])}")
    return ", ".join(parts) if parts else repr(signature)


def merge_microbatches(microbatches: Sequence[Dict[str, Any]],
                       num_items: Optional[torch.Tensor]) -> Tuple[Optional[Dict[str, Any]], str]:
    """The micro-batches of one optimizer step as one batch that
    ``graphed.train.split_batch`` splits back into them: tensors concatenated
    along dim 0, other values kept (they must be equal), and
    ``num_items_in_batch`` repeated once per micro-batch. Returns
    ``(batch, "")``, or ``(None, reason)`` when they cannot be merged."""
    first = microbatches[0]
    if not isinstance(first, dict):
        return None, (f"Expected the Trainer's batches to be dicts of model arguments, got "
                      f"{type(first).__name__}.")
    if _ITEMS_KEY in first:
        return None, f"A batch holds the key {_ITEMS_KEY!r}, which graphed reserves."
    merged: Dict[str, Any] = {}
    for key, value in first.items():
        values = [mb.get(key) if isinstance(mb, dict) else None for mb in microbatches]
        if any(not isinstance(mb, dict) or set(mb) != set(first) for mb in microbatches):
            return None, "The micro-batches of one optimizer step have different keys."
        if isinstance(value, torch.Tensor):
            shapes = {(tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else None
                      for v in values}
            if len(shapes) != 1:
                return None, (f"The micro-batches of one optimizer step differ in {key!r} "
                              f"({sorted(str(s[0]) if s else 'not a tensor' for s in shapes)}).")
            if value.dim() == 0:
                return None, f"Batch value {key!r} is a 0-dimensional tensor; no batch dimension."
            merged[key] = values[0] if len(values) == 1 else torch.cat(values)
        else:
            if any(v != value for v in values[1:]):
                return None, f"The micro-batches of one optimizer step differ in {key!r}."
            merged[key] = value
    if num_items is not None:
        if not isinstance(num_items, torch.Tensor):
            device = next((v.device for v in first.values() if isinstance(v, torch.Tensor)), None)
            num_items = torch.tensor(num_items, device=device)
        if num_items.numel() != 1:
            return None, (f"Expected num_items_in_batch to be a single number, got a tensor of "
                          f"shape {list(num_items.shape)}.")
        merged[_ITEMS_KEY] = num_items.reshape(1).repeat(len(microbatches))
    return merged, ""


class GraphedTrainerReport:
    """What graphed did with a Trainer: the mode it runs in, every fallback
    with its reason and count, notes on what graphed changed, and counters.

    ``fallbacks`` is a list of dicts ``{"scope", "reason", "count"}``, scope
    ``"trainer"`` (the whole Trainer runs another mode), ``"step"`` (one
    optimizer step ran eagerly) or ``"eval"`` (one evaluation batch ran
    eagerly)."""

    def __init__(self, requested_mode: str, fallback: str) -> None:
        self.requested_mode = requested_mode
        #: "step", "modules" or "eager": decided when train() or evaluate() starts.
        self.mode: Optional[str] = None
        self.fallback = fallback
        self.fallbacks: List[Dict[str, Any]] = []
        self.notes: List[str] = []
        self.graphed_steps = 0
        self.eager_steps = 0
        self.eval_replays = 0
        self.eval_eager_batches = 0
        self.eval_graphs = 0
        #: The graphed.TrainStep of mode="step", once captured.
        self.train_step: Optional[Any] = None

    def add_fallback(self, scope: str, reason: str) -> bool:
        """Counts a fallback; True (and logs it) the first time its reason is seen."""
        for entry in self.fallbacks:
            if entry["scope"] == scope and entry["reason"] == reason:
                entry["count"] += 1
                return False
        self.fallbacks.append({"scope": scope, "reason": reason, "count": 1})
        logger.warning("graphed: %s runs eagerly: %s", scope, reason)
        return True

    def add_note(self, note: str) -> None:
        """Records what graphed changed (logged once)."""
        if note not in self.notes:
            self.notes.append(note)
            logger.info("graphed: %s", note)

    def as_dict(self) -> Dict[str, Any]:
        """The report as plain values (the TrainStep's stats under ``train_step``)."""
        result = {key: value for key, value in vars(self).items() if key != "train_step"}
        result["fallbacks"] = [dict(f) for f in self.fallbacks]
        result["notes"] = list(self.notes)
        if self.train_step is not None:
            result["train_step"] = self.train_step.stats()
        return result

    def __repr__(self) -> str:
        lines = [f"graphed Trainer report: mode {self.mode} (requested {self.requested_mode}), "
                 f"{self.graphed_steps} graphed and {self.eager_steps} eager optimizer steps, "
                 f"{self.eval_replays} eval replays ({self.eval_graphs} graphs), "
                 f"{self.eval_eager_batches} eager eval batches"]
        lines += [f"  fallback [{f['scope']}] x{f['count']}: {f['reason']}" for f in self.fallbacks]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# Note [Loss normalization of the Trainer]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The captured iteration (Note [One training iteration]) divides each
# micro-batch loss by the number of micro-batches. The plain training_step
# divides by current_gradient_accumulation_steps only when the loss does not
# already use num_items_in_batch: when model_accepts_loss_kwargs and the
# Trainer counted the items (labels != -100 over the whole step), or a
# compute_loss_func is set, compute_loss already returns sum / items of the
# step and is not divided again. The micro-batch loss graphed captures is the
# Trainer's own compute_loss (user overrides, label smoothing and
# compute_loss_func included), given the same num_items_in_batch (a device
# tensor in the static batch, one copy per micro-batch), multiplied by N in
# that second case so that the iteration's division cancels: exact for N a
# power of two, within one rounding otherwise.


class _TrainerLoss(nn.Module):
    """One micro-batch's loss as the Trainer computes it, in the form
    graphed's iteration calls (``module(**batch)`` returning the loss): the
    Trainer's compute_loss under its context manager, with the step's
    num_items_in_batch; see Note [Loss normalization of the Trainer]."""

    def __init__(self, trainer: "Trainer", model: nn.Module, microbatches: int,
                 undo_division: bool, extra: Dict[str, Any]) -> None:
        super().__init__()
        self.model = model  # a submodule: its parameters and buffers are the step's state
        object.__setattr__(self, "_trainer", trainer)  # not a submodule
        self._microbatches = microbatches
        self._undo_division = undo_division
        self._extra = dict(extra)

    def forward(self, **batch: Any) -> torch.Tensor:
        items = batch.pop(_ITEMS_KEY, None)
        if items is not None:
            items = items.reshape(())  # this micro-batch's copy of the step's count
        inputs = {**batch, **self._extra}
        trainer = self._trainer
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(self.model, inputs, num_items_in_batch=items)
        if self._undo_division:
            loss = loss * self._microbatches
        return loss


def _forward_takes(model: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return False


def _inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's AcceleratedOptimizer."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


class _GraphedState:
    """Per-Trainer state of the integration (held as ``trainer._graphed``)."""

    def __init__(self, mode: str, fallback: str, eval_graphs: bool, warmup: int,
                 max_eval_graphs: int, auto_kwargs: Optional[Dict[str, Any]]) -> None:
        _check_choice("mode", mode, MODES)
        _check_choice("fallback", fallback, FALLBACKS)
        if not isinstance(warmup, int) or warmup < 1:
            raise GraphedError(f"Expected warmup to be an int >= 1, got {warmup!r}.")
        if not isinstance(max_eval_graphs, int) or max_eval_graphs < 0:
            raise GraphedError(
                f"Expected max_eval_graphs to be an int >= 0, got {max_eval_graphs!r}.")
        self.report = GraphedTrainerReport(mode, fallback)
        self.mode = mode
        self.fallback = fallback
        self.eval_enabled = eval_graphs
        self.warmup = warmup
        self.max_eval_graphs = max_eval_graphs
        self.auto_kwargs = dict(auto_kwargs or {})
        self.active: Optional[str] = None  # the mode decided at train()/evaluate()
        self.stash: List[Dict[str, Any]] = []
        self.train_step: Optional[Any] = None
        self.signature: Optional[Tuple] = None
        self.captured_for: Optional[Tuple[int, int]] = None
        self.last_step_graphed = False
        self.grad_norm: Optional[torch.Tensor] = None
        self.host_lr: Optional[List[float]] = None
        self.saved_nan_filter: Optional[bool] = None
        self.patched_optimizer: Any = None
        self.unpatch: Tuple[bool, Any] = (False, None)
        self.lr_tensors: List[torch.Tensor] = []
        self.recaptures = 0
        self.eval_graphs: Dict[Tuple, Any] = {}
        self.eval_refused: Dict[Tuple, str] = {}
        self.eval_reasons: Optional[List[str]] = None
