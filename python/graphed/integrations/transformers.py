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
be graphed takes plain values, so that the CPU tests cover it; it is in
``graphed.integrations.transformers_step`` with the other parts that need no
Trainer class (the report, the micro-batch loss, the per-Trainer state), and
its names are importable from here too.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from .._C import GraphedError

try:  # The one place graphed imports transformers.
    from transformers import Trainer
except ImportError as error:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "graphed.integrations.transformers needs the transformers package "
        f"(pip install transformers): {error}") from error

from .. import distributed
from .transformers_step import (CAPTURABLE_OPTIMS, DDP_TYPES, FALLBACKS, GraphedTrainerReport,
                                MODES, _GraphedState, _ITEMS_KEY, _TrainerLoss, _check_choice,
                                _forward_takes, _inner_optimizer, _plain_value, batch_signature,
                                choose_mode, describe_signature, merge_microbatches,
                                modules_blockers, step_blockers, training_blockers)

#: What this module takes from transformers_step without using it itself: it
#: stays importable from here, as before those parts had a file of their own.
_REEXPORTED = (_ITEMS_KEY,)

logger = logging.getLogger("graphed.integrations.transformers")

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


# Note [DDP in the Trainer's captured step]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Under torchrun (any number of processes, one included) accelerate's
# distributed type is MULTI_GPU and prepare_model wraps the model in
# DistributedDataParallel; training_step then gets that wrapper, and the
# captured step calls compute_loss on it, so DDP's forward prepares the
# reducer and its gradient hooks all-reduce inside the graph, as for a
# TrainStep over graphed.distributed.prepare_ddp's model (Note [DDP built by a
# framework] in python/graphed/distributed.py). The integration adds:
#  - train() runs accelerate's prepare_model on graphed's capture stream
#    (distributed.on_capture_stream, an instance attribute on the
#    accelerator for the duration of train()), where DDP must create its
#    gradient accumulators; a model wrapped before (by an earlier train()
#    without graphed) is refused by the core at capture and the Trainer
#    falls back to eager with that reason.
#  - mode="step" refuses ddp_find_unused_parameters left unset (the Trainer
#    then passes True) or True without ddp_static_graph, and mode="modules"
#    refuses DDP (step_blockers, modules_blockers); at capture the DDP the
#    Trainer built is checked (distributed.framework_ddp_problems: NCCL
#    backend and environment, communication hooks, no_sync, device), each
#    problem a counted fallback to eager with its fix.
#  - the warm-up is at least distributed.COLLECTIVE_WARMUP_ITERS (a note says
#    so when graphed_warmup was lower).
# The Trainer's loop runs the non-final micro-batches under
# accelerator.no_sync; graphed's training_step only stashes them there, and
# the replay all-reduces every micro-batch (point 4 of that Note). The
# Trainer's num_items_in_batch is gathered across ranks by its own loop,
# before training_step, and reaches the graph as a device tensor; the loss
# scaling compute_loss applies for average_tokens_across_devices runs inside
# the captured compute_loss. Evaluation uses the unwrapped model (the Trainer
# does not wrap it for evaluation), so its graphs hold no collectives.


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
        "step": [...], "modules": [...]}`` (empty lists when nothing blocks)."""
        return trainer_blockers(self)

    def _graphed_decide(self) -> str:
        state = self._graphed
        blockers = trainer_blockers(self)
        active, reasons = choose_mode(state.mode, state.fallback, blockers["training"],
                                      blockers["step"], blockers.get("modules", []))
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
        unpatch = self._graphed_patch_prepare() if active == "step" else None
        try:
            return super().train(*args, **kwargs)
        finally:
            if unpatch is not None:
                unpatch()
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

    def _graphed_patch_prepare(self) -> Optional[Any]:
        """Under DDP, makes accelerate build the DistributedDataParallel on
        graphed's capture stream for this train() (Note [DDP in the Trainer's
        captured step]); returns the function that undoes it, or None."""
        accelerator = getattr(self, "accelerator", None)
        kind = str(_plain_value(getattr(getattr(accelerator, "state", None),
                                        "distributed_type", "NO"))).upper()
        if accelerator is None or kind not in DDP_TYPES or not torch.cuda.is_available():
            return None
        had_instance = "prepare_model" in vars(accelerator)
        previous = vars(accelerator).get("prepare_model")
        original = accelerator.prepare_model
        device = self.args.device

        def prepare_model(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
            from .. import fp8

            fp8.keep_state_out_of_ddp(model)
            with distributed.on_capture_stream(device):
                return original(model, *args, **kwargs)

        accelerator.prepare_model = prepare_model

        def unpatch() -> None:
            if had_instance:
                accelerator.prepare_model = previous
            else:
                vars(accelerator).pop("prepare_model", None)

        return unpatch

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
        ddps = distributed.find_ddp([model])
        problems = [p for ddp in ddps for p in distributed.framework_ddp_problems(ddp)]
        if problems:
            # Note [DDP in the Trainer's captured step]: before anything changes.
            raise GraphedError(" ".join(distributed.describe_problem(p) for p in problems))
        warmup = distributed.collective_warmup([model], state.warmup)
        if warmup != state.warmup:
            state.report.add_note(
                f"warm-up of {warmup} iterations instead of graphed_warmup={state.warmup}: "
                "DistributedDataParallel needs that many eager iterations before its "
                "all-reduces can be captured")
        if ddps:
            state.report.add_note(
                "DistributedDataParallel's all-reduces are captured with the step, one per "
                "micro-batch (the Trainer's no_sync on non-final micro-batches does not apply "
                "to the graph; the gradients agree up to rounding)")
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
            clip_grad_norm=clip, amp=amp, warmup=warmup)
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
    for any mode, ``{"step": [...]}`` for mode="step" and ``{"modules":
    [...]}`` for mode="modules" in addition."""
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
    ddp = str(_plain_value(getattr(state, "distributed_type", "NO"))).upper() in DDP_TYPES
    step = step_blockers(
        optim=args.optim,
        custom_optimizer=trainer.optimizer is not None
        or getattr(trainer, "optimizer_cls_and_kwargs", None) is not None,
        gradient_checkpointing=bool(args.gradient_checkpointing), fp16=bool(args.fp16),
        half_precision_backend=str(_plain_value(getattr(args, "half_precision_backend", "auto"))),
        training_step_owner=owner, ddp=ddp,
        ddp_find_unused_parameters=getattr(args, "ddp_find_unused_parameters", None),
        ddp_static_graph=getattr(args, "ddp_static_graph", None))
    return {"training": training, "step": step, "modules": modules_blockers(ddp=ddp)}


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
        choose_mode(mode, fallback, blockers["training"], blockers["step"],
                    blockers.get("modules", []))


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
            DeepSpeed, FSDP, DataParallel over several GPUs, DDP settings a
            graph cannot capture, ``torch_compile=True``, an
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
           "choose_mode", "merge_microbatches", "modules_blockers", "optimize_trainer",
           "step_blockers", "trainer_blockers", "training_blockers"]
