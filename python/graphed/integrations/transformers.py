"""graphed for the Hugging Face ``transformers.Trainer``.

    from graphed.integrations.transformers import GraphedTrainer, optimize_trainer

    trainer = GraphedTrainer(model=model, args=args, train_dataset=data)   # mode="step"
    trainer.train()
    print(trainer.graphed_report)

    trainer = optimize_trainer(existing_trainer, mode="modules")   # patches an instance

``mode="step"`` captures the whole optimizer step (forward, loss, backward over
every micro-batch of ``gradient_accumulation_steps``, clipping to
``max_grad_norm``, the optimizer step) as one CUDA graph with
:class:`graphed.TrainStep`; ``mode="modules"`` graphs the model's repeated
blocks with :func:`graphed.auto` under the Trainer's own loop. Evaluation
replays captured graphs where batch shapes repeat. What cannot be graphed runs
as the plain Trainer would, with the reason in the
``graphed.integrations.transformers`` logger and in
``trainer.graphed_report.fallbacks``; ``fallback="raise"`` raises
:class:`graphed.GraphedError` instead.

transformers is imported only by this module. The logic that decides what can
be graphed takes plain values, so that the CPU tests cover it.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._C import GraphedError

try:  # The one place graphed imports transformers.
    from transformers import Trainer
except ImportError as error:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "graphed.integrations.transformers needs the transformers package "
        f"(pip install transformers): {error}") from error

logger = logging.getLogger("graphed.integrations.transformers")

MODES = ("step", "modules")
FALLBACKS = ("eager", "modules", "raise")

#: ``TrainingArguments.optim`` values whose optimizer graphed can capture
#: (graphed.make_capturable): AdamW and SGD run fused, RMSprop capturable.
CAPTURABLE_OPTIMS = ("adamw_torch_fused", "adamw_torch", "sgd", "rmsprop")

# The batch key that carries the Trainer's num_items_in_batch into the
# captured step (one entry per micro-batch, so that it splits with them).
_ITEMS_KEY = "__graphed_num_items_in_batch__"

_SHAPE_HINT = ("A graph replays fixed shapes; the last partial batch of an epoch has others: set "
               "dataloader_drop_last=True, and pad every batch to one length "
               "(padding='max_length')")


# Note [The Trainer's loop around a captured step]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# transformers 5.x's Trainer._run_epoch does, per optimizer step: collect
# gradient_accumulation_steps (N) batches and num_items_in_batch
# (get_batch_samples); for each micro-batch set accelerator.sync_gradients
# (True on the last one) and call training_step (forward, loss, backward),
# adding the returned loss to the device tensor _tr_loss; then on the last
# one clip (_clip_grad_norm), read the norm (_get_grad_norm), optimizer.step(),
# read the learning rate (_get_learning_rate), lr_scheduler.step() and
# model.zero_grad(). mode="step" keeps that loop and changes four of its
# pieces, all documented Trainer methods or attributes:
#  - training_step keeps the micro-batches of an optimizer step (returning a
#    zero loss for all but the last) and, on the last (sync_gradients), copies
#    them into the TrainStep's static batch and replays the whole step: every
#    micro-batch's forward and backward, clipping, the optimizer step. It
#    returns the step's loss, so _tr_loss gets the same sum the plain loop
#    adds up micro-batch by micro-batch.
#  - the optimizer the loop steps (self.optimizer, accelerate's wrapper) gets
#    an instance `step` that does nothing after a replayed step (marking the
#    optimizer as stepped for the LR scheduler's order check) and steps as
#    before after an eager one. Patching the instance keeps the object: the
#    scheduler, callbacks and checkpoints hold the same optimizer.
#  - _clip_grad_norm and _get_grad_norm return the norm the graph computed
#    (a device tensor, read only when the Trainer logs) instead of clipping
#    and measuring again.
#  - _get_learning_rate returns the host value the LR scheduler computed: the
#    learning rate is a device tensor now (make_capturable; schedulers fill it
#    in place, so the graph reads each step's value), and the plain method
#    would read it with .item(), a host sync every step.
# A step whose micro-batches do not fit the graph (fewer than N at the end of
# an epoch, another shape, the last partial batch) runs all its micro-batches
# through the plain training_step when the last one arrives, and the loop
# clips and steps as usual: never a silent wrong result, and the reason is
# logged and counted. The graph reads the optimizer's state and learning-rate
# tensors in place: when load_state_dict (resuming from a checkpoint) has
# replaced the param groups, the step is captured again.
# The plain loop reads every micro-batch's loss on the host when
# logging_nan_inf_filter is on (`torch.isnan(loss) or torch.isinf(loss)`), a
# sync per micro-batch. While a captured step is active the filter runs on the
# device instead (torch.where, same replacement value: the mean of the losses
# since the last log) and args.logging_nan_inf_filter is off for the duration
# of train(). The filter then sees the step's summed loss rather than each
# micro-batch's.

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
    if world_size > 1 or str(_plain_value(distributed_type)).upper() not in ("NO", "NONE"):
        reasons.append(
            f"Multiple GPUs via accelerate are not yet supported by "
            f"graphed.integrations.transformers: found world_size={world_size}, distributed type "
            f"{_plain_value(distributed_type)}. Run one process on one GPU, or capture a "
            "DistributedDataParallel loop with graphed.TrainStep (graphed.distributed).")
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
                  training_step_owner: Optional[str] = None) -> List[str]:
    """What keeps mode="step" (one graph per optimizer step) from applying,
    beyond :func:`training_blockers`. ``optim`` is ``TrainingArguments.optim``
    (ignored with ``custom_optimizer``: an optimizer given to the Trainer is
    checked when the step is captured); ``training_step_owner`` names a class
    that overrides ``Trainer.training_step``."""
    reasons = []
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


def choose_mode(requested: str, fallback: str, training: Sequence[str],
                step: Sequence[str]) -> Tuple[str, List[str]]:
    """The mode a Trainer runs in, and the reasons it is not ``requested``.

    ``training`` and ``step`` are the reasons of :func:`training_blockers`
    and :func:`step_blockers`. Returns ``("step" | "modules" | "eager",
    reasons)``; raises GraphedError with the reasons when ``fallback`` is
    ``"raise"`` and the requested mode cannot run."""
    _check_choice("mode", requested, MODES)
    _check_choice("fallback", fallback, FALLBACKS)
    reasons = list(training) + (list(step) if requested == "step" else [])
    if not reasons:
        return requested, []
    if fallback == "raise":
        raise GraphedError(f"graphed cannot run the Trainer in mode={requested!r}: "
                           + " ".join(reasons))
    if fallback == "modules" and requested == "step" and not training:
        return "modules", reasons
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


class _EvalStep(nn.Module):
    """The Trainer's prediction_step on one batch, as graphed.capture records it."""

    def __init__(self, trainer: "Trainer", model: nn.Module, prediction_loss_only: bool,
                 ignore_keys: Optional[List[str]], extra: Dict[str, Any]) -> None:
        super().__init__()
        self.model = model
        object.__setattr__(self, "_trainer", trainer)
        self._args = (prediction_loss_only, ignore_keys)
        self._extra = dict(extra)
        self.train(model.training)

    def forward(self, inputs: Dict[str, Any]) -> Any:
        prediction_loss_only, ignore_keys = self._args
        plain = super(_GraphedTrainerMixin, self._trainer)
        return tuple(plain.prediction_step(self.model, {**inputs, **self._extra},
                                           prediction_loss_only, ignore_keys=ignore_keys))


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


class _GraphedTrainerMixin:
    """The Trainer methods graphed overrides; see Note [The Trainer's loop
    around a captured step]. Every override runs the plain method when graphed
    is not active."""

    _graphed: Optional[_GraphedState] = None

    # --- configuration -----------------------------------------------------------
    @property
    def graphed_report(self) -> GraphedTrainerReport:
        """What graphed did: mode, fallbacks with reasons, notes, counters."""
        return self._graphed.report

    def graphed_blockers(self) -> Dict[str, List[str]]:
        """The reasons graphed cannot run in each mode now: ``{"training": [...],
        "step": [...]}`` (empty lists when nothing blocks)."""
        return trainer_blockers(self)

    def _graphed_decide(self) -> str:
        state = self._graphed
        blockers = trainer_blockers(self)
        active, reasons = choose_mode(state.mode, state.fallback, blockers["training"],
                                      blockers["step"])
        state.active = active
        state.report.mode = active
        for reason in reasons:
            state.report.add_fallback("trainer", reason)
        state.eval_reasons = list(blockers["training"])
        if active == "modules":
            self._graphed_apply_modules()
        return active

    def _graphed_apply_modules(self) -> None:
        from ..auto import auto

        model = self.model
        if getattr(model, "_graphed_auto_manager", None) is None:
            auto(model, **self._graphed.auto_kwargs)
            self._graphed.report.add_note(
                f"graphed.auto graphs the repeated blocks of {type(model).__name__}; the "
                "Trainer's loop and optimizer run as usual")

    # --- training -----------------------------------------------------------------
    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer.train, graphed as the mode chosen at construction allows."""
        state = self._graphed
        if state is None:
            return super().train(*args, **kwargs)
        active = self._graphed_decide()
        if active == "step" and self.args.logging_nan_inf_filter:
            # Note [The Trainer's loop around a captured step]: filtered on the device.
            state.saved_nan_filter = True
            self.args.logging_nan_inf_filter = False
        try:
            return super().train(*args, **kwargs)
        finally:
            if state.saved_nan_filter is not None:
                self.args.logging_nan_inf_filter = state.saved_nan_filter
                state.saved_nan_filter = None
            self._graphed_unpatch_optimizer()
            if state.stash:
                logger.warning("graphed: training stopped inside an optimizer step; %d "
                               "micro-batches of it were not trained", len(state.stash))
                state.stash = []

    def training_step(self, model: nn.Module, inputs: Dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """One micro-batch; with mode="step", the last one of an optimizer step
        replays the captured step (Note [The Trainer's loop around a captured
        step])."""
        state = self._graphed
        if state is None or state.active != "step":
            return super().training_step(model, inputs, num_items_in_batch)
        inputs = self._prepare_inputs(inputs)
        state.stash.append(inputs)
        if not self.accelerator.sync_gradients:
            return self._graphed_zero()
        microbatches, state.stash = state.stash, []
        reason = self._graphed_try_capture(model, microbatches, num_items_in_batch)
        if not reason:
            batch, reason = merge_microbatches(microbatches, num_items_in_batch)
            if not reason and batch_signature(batch) != state.signature:
                reason = (f"the batch ({describe_signature(batch_signature(batch))}) differs from "
                          f"the one the step was captured with "
                          f"({describe_signature(state.signature)})")
            if reason:
                reason = f"{reason.rstrip('.')}. {_SHAPE_HINT}"
        if reason:
            return self._graphed_eager_step(model, microbatches, num_items_in_batch, reason)
        model.train()
        self._graphed_patch_optimizer()
        self._graphed_track_lr()
        loss = state.train_step.step(batch)
        state.last_step_graphed = True
        # The norm the graph writes each replay (clipping on); copied, since the
        # Trainer reads it only when it logs, after later replays.
        guard = state.train_step.guard
        norm = guard.grad_norm if guard is not None else None
        state.grad_norm = norm.clone() if isinstance(norm, torch.Tensor) else None
        state.report.graphed_steps += 1
        return self._graphed_filter(loss.reshape(()))

    def _graphed_lr_kept(self, optimizer: Any) -> bool:
        """Whether each group's learning rate is still the tensor the graph
        reads: the optimizer's param groups were not replaced (load_state_dict),
        nor a value assigned instead of filled in place."""
        groups = optimizer.param_groups
        captured = self._graphed.lr_tensors
        return len(groups) == len(captured) and all(
            g["lr"] is t for g, t in zip(groups, captured))

    def _graphed_zero(self) -> torch.Tensor:
        return torch.zeros((), dtype=torch.float32, device=self.args.device)

    def _graphed_filter(self, loss: torch.Tensor, pending: Optional[torch.Tensor] = None
                        ) -> torch.Tensor:
        """HF's logging_nan_inf_filter on the device (Note [The Trainer's loop
        around a captured step])."""
        state = self._graphed
        tr_loss = getattr(self, "_tr_loss", None)
        if state.saved_nan_filter is None or tr_loss is None:
            return loss
        logged = tr_loss if pending is None else tr_loss + pending
        average = logged / (1 + self.state.global_step - self._globalstep_last_logged)
        return torch.where(torch.isfinite(loss), loss, average.to(loss.dtype))

    def _graphed_eager_step(self, model: nn.Module, microbatches: List[Dict[str, Any]],
                            num_items_in_batch: Any, reason: str) -> torch.Tensor:
        state = self._graphed
        state.last_step_graphed = False
        state.report.eager_steps += 1
        if state.fallback == "raise":
            raise GraphedError(f"graphed cannot replay this optimizer step: {reason}.")
        state.report.add_fallback("step", reason)
        total = None
        for inputs in microbatches:
            loss = self._graphed_filter(
                super().training_step(model, inputs, num_items_in_batch), total)
            total = loss if total is None else total + loss
        return total

    def _graphed_try_capture(self, model: nn.Module, microbatches: List[Dict[str, Any]],
                             num_items_in_batch: Any) -> str:
        """Captures the step on the first full optimizer step; returns why this
        step cannot replay it ("" when it can)."""
        state = self._graphed
        expected = self.args.gradient_accumulation_steps
        if len(microbatches) != expected:
            return (f"this optimizer step has {len(microbatches)} of gradient_accumulation_steps="
                    f"{expected} micro-batches (the epoch's batches do not divide evenly); make "
                    "the number of batches per epoch a multiple of gradient_accumulation_steps")
        optimizer = _inner_optimizer(self.optimizer)
        key = (id(model), id(optimizer))
        if state.train_step is not None and state.captured_for == key:
            if self._graphed_lr_kept(optimizer):
                return ""
            # Note [The Trainer's loop around a captured step]: load_state_dict (resuming
            # from a checkpoint) replaces the param groups and the state the graph reads.
            state.recaptures += 1
            if state.recaptures > 2:
                raise GraphedError(
                    "Expected the optimizer's learning rates to stay the device tensors the "
                    "step was captured with (LR schedulers fill them in place), but something "
                    "keeps replacing them. Set learning rates with group['lr'].fill_(value).")
            state.report.add_note("the optimizer's param groups were replaced (load_state_dict); "
                                  "the step was captured again")
            state.train_step.release()
            state.train_step = state.report.train_step = None
        batch, reason = merge_microbatches(microbatches, num_items_in_batch)
        if reason:
            return f"{reason.rstrip('.')}. {_SHAPE_HINT}"
        try:
            self._graphed_capture(model, optimizer, batch, expected, num_items_in_batch)
        except (GraphedError, RuntimeError) as error:
            message = (f"capturing the Trainer's optimizer step failed: {error}".strip())
            if state.fallback == "raise":
                raise GraphedError(message) from error
            state.report.add_fallback("trainer", message)
            state.active = "eager"
            state.report.mode = "eager"
            if state.fallback == "modules":
                try:
                    self._graphed_apply_modules()
                    state.active = state.report.mode = "modules"
                except (GraphedError, RuntimeError) as modules_error:
                    state.report.add_fallback("trainer", f"graphed.auto failed: {modules_error}")
            return message
        state.captured_for = key
        state.signature = batch_signature(batch)
        return ""

    def _graphed_capture(self, model: nn.Module, optimizer: Any, batch: Dict[str, Any],
                         microbatches: int, num_items_in_batch: Any) -> None:
        from ..train import TrainStep, make_capturable

        state = self._graphed
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise GraphedError(
                f"Expected a torch.optim optimizer, found {type(optimizer).__name__}; use "
                "optim='adamw_torch_fused'.")
        args = self.args
        divides = ((not self.model_accepts_loss_kwargs or num_items_in_batch is None)
                   and self.compute_loss_func is None)
        unwrapped = self.accelerator.unwrap_model(model)
        extra: Dict[str, Any] = {}
        if _forward_takes(unwrapped, "use_cache") and "use_cache" not in batch:
            extra["use_cache"] = False
            state.report.add_note(
                f"use_cache=False in the captured step: {type(unwrapped).__name__} would "
                "otherwise build a key/value cache in every training forward, which training "
                "never reads and a graph cannot replay")
        if getattr(optimizer, "defaults", {}).get("fused") is not True and \
                type(optimizer) in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
            state.report.add_note(
                f"{type(optimizer).__name__} switched to its fused implementation "
                "(graphed.make_capturable); numerics differ from the foreach one by rounding")
        # The scheduler computed its base values from float learning rates;
        # remember them before make_capturable turns them into device tensors.
        lrs = [group["lr"] for group in optimizer.param_groups]
        make_capturable(optimizer)
        state.lr_tensors = [group["lr"] for group in optimizer.param_groups]
        state.host_lr = [float(lr) for lr in lrs] if all(
            not isinstance(lr, torch.Tensor) for lr in lrs) else None
        loss_module = _TrainerLoss(self, model, microbatches, not divides, extra)
        clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
        amp = "bf16" if args.bf16 else "fp16" if args.fp16 else None
        logger.info("graphed: capturing the Trainer's optimizer step (%d micro-batches, "
                    "max_grad_norm=%s, amp=%s)", microbatches, clip, amp)
        model.train()
        state.train_step = TrainStep.from_parts(
            loss_module, optimizer, None, batch, microbatches=microbatches,
            clip_grad_norm=clip, amp=amp, warmup=state.warmup)
        state.report.train_step = state.train_step
        if amp == "fp16":
            state.report.add_note(
                "fp16 loss scaling by graphed (init 65536, growth interval 2000, as GradScaler) "
                "inside the graph; the accelerator's GradScaler is not used, and the LR "
                "scheduler steps after a skipped step too")
        if clip is None:
            state.report.add_note(
                "max_grad_norm=0: the captured step does not compute the gradient norm, so "
                "grad_norm is not logged")
        if not divides and microbatches & (microbatches - 1):
            state.report.add_note(
                f"the loss uses num_items_in_batch, so graphed multiplies each micro-batch loss by "
                f"{microbatches} before the iteration divides it by {microbatches}: equal to the "
                "plain Trainer within one rounding (exact for powers of two)")

    def _graphed_patch_optimizer(self) -> None:
        """Gives the optimizer the loop steps an instance ``step`` that skips
        replayed steps (Note [The Trainer's loop around a captured step])."""
        state = self._graphed
        optimizer = self.optimizer
        if state.patched_optimizer is optimizer:
            return
        self._graphed_unpatch_optimizer()
        original = optimizer.step
        had_instance_step = "step" in vars(optimizer)
        previous = vars(optimizer).get("step")

        def step(*args: Any, **kwargs: Any) -> Any:
            if state.last_step_graphed:
                optimizer._opt_called = True  # the LR scheduler's order check
                return None
            return original(*args, **kwargs)

        # LR schedulers leave a step marked like this alone (torch.optim.lr_scheduler).
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        step._graphed = True  # type: ignore[attr-defined]
        optimizer.step = step
        state.patched_optimizer = optimizer
        state.unpatch = (had_instance_step, previous)

    def _graphed_unpatch_optimizer(self) -> None:
        state = self._graphed
        optimizer = state.patched_optimizer
        if optimizer is None:
            return
        had_instance_step, previous = state.unpatch
        if had_instance_step:
            optimizer.step = previous
        else:
            vars(optimizer).pop("step", None)
        state.patched_optimizer = None
        state.last_step_graphed = False

    def _graphed_track_lr(self) -> None:
        """Records the host learning rates a LambdaLR computes (all of
        transformers' get_scheduler schedules but ReduceLROnPlateau), so that
        logging needs no .item() of the device learning rate."""
        state = self._graphed
        scheduler = self.lr_scheduler
        if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            state.host_lr = None
            return
        if getattr(scheduler.get_lr, "_graphed", False):
            return
        compute = scheduler.get_lr

        def get_lr() -> Any:
            values = compute()
            state.host_lr = ([float(v) for v in values]
                             if all(not isinstance(v, torch.Tensor) for v in values) else None)
            return values

        get_lr._graphed = True  # type: ignore[attr-defined]
        scheduler.get_lr = get_lr
        if state.host_lr is None:
            last = scheduler.get_last_lr()
            if all(not isinstance(v, torch.Tensor) for v in last):
                state.host_lr = [float(v) for v in last]

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        state = self._graphed
        if state is not None and state.last_step_graphed:
            return state.grad_norm  # clipped inside the graph
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        state = self._graphed
        if state is not None and state.last_step_graphed:
            return state.grad_norm
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def _get_learning_rate(self) -> float:
        state = self._graphed
        if state is not None and state.last_step_graphed and state.host_lr \
                and not self.is_deepspeed_enabled:
            return state.host_lr[0]
        return super()._get_learning_rate()

    # --- evaluation -----------------------------------------------------------------
    def prediction_step(self, model: nn.Module, inputs: Dict[str, Any],
                        prediction_loss_only: bool, ignore_keys: Optional[List[str]] = None
                        ) -> Tuple[Any, Any, Any]:
        """Trainer.prediction_step, replayed from a captured graph per batch
        signature (at most ``max_eval_graphs``), eagerly otherwise."""
        state = self._graphed
        if state is None or not state.eval_enabled or state.mode == "modules":
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if state.eval_reasons is None:
            state.eval_reasons = trainer_blockers(self)["training"]
            for reason in state.eval_reasons:
                state.report.add_fallback("trainer", reason)
        if state.eval_reasons or state.active == "modules":
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        key = (id(model), model.training, bool(prediction_loss_only),
               tuple(ignore_keys) if ignore_keys else None, batch_signature(inputs))
        graph = state.eval_graphs.get(key)
        reason = state.eval_refused.get(key)
        if graph is None and reason is None:
            graph, reason = self._graphed_capture_eval(model, inputs, prediction_loss_only,
                                                       ignore_keys, key)
        if graph is not None:
            try:
                outputs = graph(inputs)
            except GraphedError as error:
                reason = f"replaying the evaluation graph failed: {error}"
            else:
                state.report.eval_replays += 1
                return tuple(outputs)
        state.report.eval_eager_batches += 1
        if state.fallback == "raise":
            raise GraphedError(f"graphed cannot replay this evaluation batch: {reason}.")
        state.report.add_fallback("eval", reason)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def _graphed_capture_eval(self, model: nn.Module, inputs: Dict[str, Any],
                              prediction_loss_only: bool, ignore_keys: Optional[List[str]],
                              key: Tuple) -> Tuple[Any, str]:
        from ..capture import capture

        state = self._graphed
        if len(state.eval_graphs) >= state.max_eval_graphs:
            reason = (f"max_eval_graphs={state.max_eval_graphs} evaluation graphs exist already "
                      f"and this batch ({describe_signature(key[-1])}) would need another; use "
                      "fixed "
                      "shapes (dataloader_drop_last=True, padding='max_length') or raise "
                      "max_eval_graphs")
            state.eval_refused[key] = reason
            return None, reason
        extra: Dict[str, Any] = {}
        unwrapped = self.accelerator.unwrap_model(model)
        if _forward_takes(unwrapped, "use_cache") and "use_cache" not in inputs:
            extra["use_cache"] = False  # the cache is among keys_to_ignore_at_inference anyway
        step = _EvalStep(self, model, prediction_loss_only, ignore_keys, extra)
        try:
            graph = capture(step, inputs, warmup=1, clone_outputs=True)
        except (GraphedError, RuntimeError) as error:
            reason = f"capturing the evaluation step failed: {error}"
            if state.fallback == "raise":
                raise GraphedError(reason) from error
            state.eval_refused[key] = reason
            return None, reason
        state.eval_graphs[key] = graph
        state.report.eval_graphs = len(state.eval_graphs)
        return graph, ""


def trainer_blockers(trainer: "Trainer") -> Dict[str, List[str]]:
    """The reasons graphed cannot run ``trainer`` now: ``{"training": [...]}``
    for any mode, ``{"step": [...]}`` for mode="step" in addition."""
    args = trainer.args
    accelerator = getattr(trainer, "accelerator", None)
    state = getattr(accelerator, "state", None)
    pc = getattr(accelerator, "parallelism_config", None)
    parallel = pc is not None and any(
        getattr(pc, f"{name}_enabled", False) for name in ("cp", "tp", "sp"))
    training = training_blockers(
        device_type=torch.device(args.device).type, n_gpu=args.n_gpu,
        world_size=args.world_size,
        distributed_type=getattr(state, "distributed_type", "NO"),
        deepspeed=bool(getattr(trainer, "is_deepspeed_enabled", False)),
        fsdp=bool(getattr(trainer, "is_fsdp_enabled", False)),
        torch_compile=bool(args.torch_compile), parallelism=parallel)
    owner = _override_owner(type(trainer), "training_step")
    step = step_blockers(
        optim=args.optim,
        custom_optimizer=trainer.optimizer is not None
        or getattr(trainer, "optimizer_cls_and_kwargs", None) is not None,
        gradient_checkpointing=bool(args.gradient_checkpointing), fp16=bool(args.fp16),
        half_precision_backend=str(_plain_value(getattr(args, "half_precision_backend", "auto"))),
        training_step_owner=owner)
    return {"training": training, "step": step}


def _override_owner(cls: type, name: str) -> Optional[str]:
    """The class below Trainer (skipping graphed's) that defines ``name``."""
    for klass in cls.__mro__:
        if klass is Trainer:
            return None
        if klass is _GraphedTrainerMixin or klass.__module__ == __name__:
            continue
        if name in vars(klass):
            return klass.__name__
    return None


def _setup(trainer: "Trainer", mode: str, fallback: str, eval_graphs: bool, warmup: int,
           max_eval_graphs: int, auto_kwargs: Optional[Dict[str, Any]]) -> None:
    trainer._graphed = _GraphedState(mode, fallback, eval_graphs, warmup, max_eval_graphs,
                                     auto_kwargs)
    if fallback == "raise":
        # Refuse what can never work right away, not at train().
        blockers = trainer_blockers(trainer)
        choose_mode(mode, fallback, blockers["training"], blockers["step"])


class GraphedTrainer(_GraphedTrainerMixin, Trainer):
    """A ``transformers.Trainer`` whose training and evaluation run as CUDA graphs.

    Takes the Trainer's arguments, and:

    Args:
        graphed_mode: ``"step"`` (default): each optimizer step (every
            micro-batch of ``gradient_accumulation_steps``, clipping to
            ``max_grad_norm``, the optimizer step, under ``bf16``/``fp16``)
            replays one graph captured by :class:`graphed.TrainStep` at the
            first full step; the learning rate becomes a device tensor that
            the Trainer's scheduler updates in place. ``"modules"``:
            :func:`graphed.auto` graphs the model's repeated blocks and the
            Trainer runs as usual.
        graphed_fallback: what happens where graphed cannot apply (no GPU,
            DeepSpeed, FSDP, several GPUs, ``torch_compile=True``, an
            optimizer that cannot be captured, a failed capture): ``"eager"``
            runs the plain Trainer, ``"modules"`` tries mode="modules",
            ``"raise"`` raises :class:`graphed.GraphedError`. Optimizer steps
            and evaluation batches whose shapes do not fit a graph run eagerly
            (or raise with ``"raise"``). Reasons go to the
            ``graphed.integrations.transformers`` logger and to
            :attr:`graphed_report`.
        graphed_eval: replay ``evaluate``/``predict`` batches from captured
            graphs (one per batch signature, at most ``graphed_max_eval_graphs``).
        graphed_warmup: eager iterations before the step is captured.
        graphed_auto_kwargs: keyword arguments for :func:`graphed.auto` in
            mode="modules".

    See Note [The Trainer's loop around a captured step] in this file for
    what changes in the Trainer's loop.
    """

    def __init__(self, *args: Any, graphed_mode: str = "step", graphed_fallback: str = "eager",
                 graphed_eval: bool = True, graphed_warmup: int = 3,
                 graphed_max_eval_graphs: int = 4,
                 graphed_auto_kwargs: Optional[Dict[str, Any]] = None, **kwargs: Any) -> None:
        _check_choice("graphed_mode", graphed_mode, MODES)
        _check_choice("graphed_fallback", graphed_fallback, FALLBACKS)
        super().__init__(*args, **kwargs)
        _setup(self, graphed_mode, graphed_fallback, graphed_eval, graphed_warmup,
               graphed_max_eval_graphs, graphed_auto_kwargs)


_PATCHED_CLASSES: Dict[type, type] = {}


def optimize_trainer(trainer: "Trainer", mode: str = "step", *, fallback: str = "eager",
                     eval: bool = True, warmup: int = 3, max_eval_graphs: int = 4,
                     auto_kwargs: Optional[Dict[str, Any]] = None) -> "Trainer":
    """Makes an existing ``transformers.Trainer`` (or subclass) instance run
    graphed, in place, and returns it; the arguments are those of
    :class:`GraphedTrainer` without the ``graphed_`` prefix.

    The instance's class becomes a subclass of its own class with graphed's
    overrides (its methods, including your overrides of ``compute_loss``,
    still apply). Call before ``trainer.train()``; ``trainer.graphed_report``
    then says what graphed did."""
    if not isinstance(trainer, Trainer):
        raise GraphedError(
            f"Expected a transformers.Trainer, got {type(trainer).__name__}. Pass the Trainer "
            "instance, or construct a graphed.integrations.transformers.GraphedTrainer.")
    _check_choice("mode", mode, MODES)
    _check_choice("fallback", fallback, FALLBACKS)
    cls = type(trainer)
    if not isinstance(trainer, _GraphedTrainerMixin):
        if cls not in _PATCHED_CLASSES:
            _PATCHED_CLASSES[cls] = type(f"Graphed{cls.__name__}", (_GraphedTrainerMixin, cls),
                                         {"__module__": __name__, "__doc__": cls.__doc__})
        trainer.__class__ = _PATCHED_CLASSES[cls]
    elif trainer._graphed is not None and trainer._graphed.train_step is not None:
        raise GraphedError(
            "This Trainer already captured its training step; call optimize_trainer once, "
            "before train().")
    _setup(trainer, mode, fallback, eval, warmup, max_eval_graphs, auto_kwargs)
    return trainer


__all__ = ["CAPTURABLE_OPTIMS", "GraphedTrainer", "GraphedTrainerReport", "batch_signature",
           "choose_mode", "merge_microbatches", "optimize_trainer", "step_blockers",
           "trainer_blockers", "training_blockers"]
