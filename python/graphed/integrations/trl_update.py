"""graphed for TRL's ``GRPOTrainer``: the policy update on graphs.

The optimizer step of a GRPO step (per-token log-probabilities of the
completions, the clipped objective, the KL term when ``beta > 0``, backward
over every micro-batch of gradient accumulation, clipping to
``max_grad_norm``, the optimizer step) replays a CUDA graph captured by
:class:`graphed.TrainStep`, one per sequence-length bucket: a step whose
prompts and completions are shorter than its bucket pads to it, with the
padding masked out so that the loss is TRL's (Note [The GRPO update on
graphs], Note [One layout for every prompt and completion length]).
:class:`graphed.integrations.trl.GraphedGRPOTrainer` runs it by default
(``graphed_update=True``) and reports it in ``trainer.graphed_update``.

What graphed cannot reproduce runs TRL's own training step, with the reason
in the ``graphed.integrations.trl`` logger and counted in
``trainer.graphed_update.fallbacks``: for the whole run (no GPU, fp16,
loss types and options of :func:`update_blockers`), or for one step (a
multimodal batch, a bucket beyond ``max_update_graphs``, a failed capture).

The loss and the batch layout are in ``graphed.integrations.trl_loss``; their
names are importable from here too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._C import GraphedError
from .transformers import (_GraphedState, _GraphedTrainerMixin, _inner_optimizer, step_blockers,
                           training_blockers)
from .trl_loss import (BUCKET_STEP, GRPOUpdateLoss, LossSettings, SUPPORTED_LOSS_TYPES, _KNOWN_KEYS,
                       _describe, _head_scores_every_position, _merge, _nan_extreme, _signature,
                       batch_problem, bucket_length, layout, update_blockers)

#: What this module takes from trl_loss without using it itself: it stays
#: importable from here, as before the loss had a file of its own.
_REEXPORTED = (_KNOWN_KEYS, _head_scores_every_position, _nan_extreme)

logger = logging.getLogger("graphed.integrations.trl")


# Note [The GRPO update on graphs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# TRL 1.16's GRPOTrainer.training_step is the Trainer's (compute_loss and
# backward per micro-batch; the loop clips, steps and schedules), timed, with
# its micro-batch counter _step advanced. Its _compute_loss cannot be
# captured as it is: it logs a dozen metrics with .item() on every call, and
# its fused LM head scores only the labelled positions, hidden_states[mask],
# a host sync and a shape that changes with every batch. graphed's update
# keeps TRL's pieces and replaces what cannot run in a graph:
#  - the log-probabilities come from the same call TRL makes, the policy's
#    forward with labels and fused_lm_head=True (TRL's own chunked kernel,
#    under the accelerator's autocast, with TRL's temperature), but with
#    trl.trainer.utils._use_triton answering False during warm-up and
#    capture, which makes the head score every position of the fixed-size
#    tile (its path for devices without Triton: same per-row kernel, zeros
#    where the label is -100, no host sync);
#  - the objective is TRL's, term for term (GRPOUpdateLoss): the ratio to the
#    old log-probabilities (or to the detached current ones when TRL did not
#    compute them), token or sequence importance sampling, clipping with
#    epsilon_low/epsilon_high and delta, the KL term to the reference model
#    with its bias correction, and each loss type's normalization, less the
#    division by the gradient accumulation steps, which graphed's iteration
#    does (Note [One training iteration]);
#  - TRL's metrics (entropy, KL, clip ratios) are computed inside the graph
#    and read on the host only when the trainer logs.
# training_step mirrors GRPOTrainer's bookkeeping (_step, step_time) around
# the stash-and-replay of graphed's Trainer integration (Note [The Trainer's
# loop around a captured step] in transformers.py, whose optimizer, clipping
# and learning-rate overrides the update reuses), so that the rollout
# schedule (generate every steps_per_generation * num_iterations
# micro-batches) is TRL's. A step that falls back runs TRL's compute_loss and
# backward on the same prepared micro-batches.


@dataclass
class GraphedUpdate:
    """What graphed did with the trainer's policy updates: ``path``
    ("graphs", or "trl" when the whole run is refused), ``graphed``
    optimizer steps replayed and ``eager`` ones on TRL's training step,
    ``fallbacks`` ({reason: optimizer steps}), ``buckets`` ({sequence
    length: replays}), ``captures`` and ``capture_s`` (seconds spent
    capturing, warm-up included), ``steps`` (each optimizer step's path:
    "graph:<length>" or "trl"), ``notes``."""

    path: str = "graphs"
    graphed: int = 0
    eager: int = 0
    fallbacks: Dict[str, int] = field(default_factory=dict)
    buckets: Dict[int, int] = field(default_factory=dict)
    captures: int = 0
    capture_s: float = 0.0
    steps: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def add_fallback(self, reason: str) -> None:
        """Counts one optimizer step on TRL's path for ``reason`` (logged once)."""
        if reason not in self.fallbacks:
            logger.warning("graphed: this policy update runs TRL's training step: %s", reason)
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    def add_note(self, note: str) -> None:
        """Records what graphed changed (logged once)."""
        if note not in self.notes:
            self.notes.append(note)
            logger.info("graphed: %s", note)

    def to_dict(self) -> Dict[str, Any]:
        """The report as a JSON-ready dict."""
        return {"path": self.path, "graphed": self.graphed, "eager": self.eager,
                "fallbacks": dict(self.fallbacks),
                "buckets": {str(k): v for k, v in sorted(self.buckets.items())},
                "captures": self.captures, "capture_s": self.capture_s,
                "steps": list(self.steps), "notes": list(self.notes)}

    def __str__(self) -> str:
        buckets = ", ".join(f"{k} tokens x{v}" for k, v in sorted(self.buckets.items()))
        lines = [f"graphed policy update ({self.path}): {self.graphed} optimizer step(s) on "
                 f"graphs ({buckets or 'no buckets'}), {self.eager} on TRL's training step"]
        lines += [f"- {count} x {reason}" for reason, count in self.fallbacks.items()]
        lines += [f"- note: {note}" for note in self.notes]
        return "\n".join(lines)


def _owner_below(cls: type, name: str, stop: type, skip: Sequence[type]) -> Optional[str]:
    """The class above ``stop`` in ``cls``'s MRO, other than graphed's, that defines ``name``."""
    for klass in cls.__mro__:
        if klass is stop:
            return None
        if klass in skip or klass.__module__.startswith("graphed."):
            continue
        if name in vars(klass):
            return klass.__name__
    return None


class _GraphedUpdateState:
    """Per-trainer state of the graphed update (``trainer._graphed_update``)."""

    def __init__(self, fallback: str, bucket_step: int, max_graphs: int, warmup: int) -> None:
        for name, value, least in (("bucket_step", bucket_step, 1),
                                   ("max_update_graphs", max_graphs, 1), ("warmup", warmup, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise GraphedError(f"Expected {name} to be an int >= {least}, got {value!r}.")
        self.fallback = fallback
        self.bucket_step = bucket_step
        self.max_graphs = max_graphs
        self.warmup = warmup
        self.report = GraphedUpdate()
        self.reasons: List[str] = []  # why the whole run is refused
        self.steps: Dict[int, Any] = {}  # length -> TrainStep
        self.records: Dict[int, List[torch.Tensor]] = {}  # length -> metric tensors
        self.settings: Optional[LossSettings] = None
        self.pending: List[Tuple[List[str], torch.Tensor]] = []
        self.signature: Optional[Tuple[int, Tuple[str, ...]]] = None  # rows, optional inputs
        self.broken = ""  # a capture failed: the rest of the run is TRL's


class _GraphedUpdateMixin(_GraphedTrainerMixin):
    """GRPOTrainer's training step on graphs (Note [The GRPO update on
    graphs]). Builds on the Trainer integration's mixin, whose train(),
    optimizer, clipping and learning-rate overrides it reuses."""

    _graphed_update: Optional[_GraphedUpdateState] = None

    def _graphed_update_setup(self, enabled: bool, fallback: str, bucket_step: int,
                              max_graphs: int, warmup: int) -> None:
        if not enabled:
            self._graphed = None
            self._graphed_update = None
            return
        self._graphed_update = _GraphedUpdateState(fallback, bucket_step, max_graphs, warmup)
        self._graphed = _GraphedState("step", "eager", False, warmup, 0, None)
        if fallback == "raise":
            reasons = self.graphed_blockers()["update"]
            if reasons:
                raise GraphedError("graphed cannot run the GRPO update on graphs: "
                                   + " ".join(reasons))

    @property
    def graphed_update(self) -> Optional[GraphedUpdate]:
        """What graphed did with the policy updates (None with update=False)."""
        state = self._graphed_update
        return None if state is None else state.report

    def graphed_blockers(self) -> Dict[str, List[str]]:
        """Why the GRPO update cannot run on graphs now: ``{"update": [...]}``."""
        from trl import GRPOTrainer

        args = self.args
        accelerator = self.accelerator
        training = training_blockers(
            device_type=torch.device(args.device).type, n_gpu=args.n_gpu,
            world_size=args.world_size,
            distributed_type=getattr(accelerator.state, "distributed_type", "NO"),
            deepspeed=bool(getattr(self, "is_deepspeed_enabled", False)),
            fsdp=bool(getattr(self, "is_fsdp_enabled", False)),
            torch_compile=bool(args.torch_compile))
        step = step_blockers(
            optim=args.optim, custom_optimizer=self.optimizer is not None
            or getattr(self, "optimizer_cls_and_kwargs", None) is not None)
        update = update_blockers(
            loss_type=self.loss_type, top_entropy_quantile=float(self.top_entropy_quantile),
            entropy_bonus=bool(getattr(self, "_entropy_bonus_enabled", False)),
            aux_loss=bool(getattr(self, "aux_loss_enabled", False)),
            vllm_importance_sampling=bool(self.use_vllm and getattr(
                self, "vllm_importance_sampling_correction", False)),
            off_policy_mask=getattr(self, "off_policy_mask_threshold", None) is not None,
            liger_kernel=bool(getattr(args, "use_liger_kernel", False)), fp16=bool(args.fp16),
            gradient_checkpointing=bool(args.gradient_checkpointing),
            training_step_owner=_owner_below(type(self), "training_step", GRPOTrainer, ()))
        return {"update": training + step + update}

    # --- the Trainer integration's hooks ------------------------------------------
    def _graphed_decide(self) -> str:
        state, update = self._graphed, self._graphed_update
        update.reasons = self.graphed_blockers()["update"]
        if update.reasons and update.fallback == "raise":
            raise GraphedError("graphed cannot run the GRPO update on graphs: "
                               + " ".join(update.reasons))
        update.report.path = "trl" if update.reasons else "graphs"
        state.active = state.report.mode = "eager" if update.reasons else "step"
        return state.active

    def log(self, logs: Dict[str, float], *args: Any, **kwargs: Any) -> None:
        """GRPOTrainer.log, after the graphed steps' metrics reach TRL's records."""
        update = self._graphed_update
        if update is not None and update.pending:
            for names, values in update.pending:
                for name, value in zip(names, values.tolist()):
                    self._metrics["train"][name].append(value)
            update.pending = []
        return super().log(logs, *args, **kwargs)

    # --- training -------------------------------------------------------------------
    def training_step(self, model: nn.Module, inputs: Dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """GRPOTrainer.training_step; the last micro-batch of an optimizer
        step replays the update's graph for its bucket (Note [The GRPO
        update on graphs])."""
        state, update = self._graphed, self._graphed_update
        if state is None or update is None or state.active != "step":
            loss = super().training_step(model, inputs, num_items_in_batch)
            if update is not None and update.reasons and self.accelerator.sync_gradients:
                update.report.eager += 1
                update.report.steps.append("trl")
                for reason in update.reasons:
                    update.report.add_fallback(reason)
            return loss
        started = time.perf_counter()
        model.train()
        inputs = self._prepare_inputs(inputs)  # GRPO: the rollout, every generate_every calls
        state.stash.append(inputs)
        if self.accelerator.sync_gradients:
            microbatches, state.stash = state.stash, []
            loss = self._graphed_update_step(model, microbatches, num_items_in_batch)
        else:
            loss = self._graphed_zero()
        # GRPOTrainer.training_step's bookkeeping.
        self._step += 1
        self._current_train_step_time += time.perf_counter() - started
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return loss

    def _graphed_update_step(self, model: nn.Module, microbatches: List[Dict[str, Any]],
                             num_items_in_batch: Any) -> torch.Tensor:
        state, update = self._graphed, self._graphed_update
        length, reason = self._graphed_update_bucket(microbatches)
        step = None
        if not reason:
            step, reason = self._graphed_update_graph(model, microbatches, length)
        if reason:
            if update.fallback == "raise":
                raise GraphedError(f"graphed cannot run this GRPO update on graphs: {reason}.")
            return self._graphed_update_eager(model, microbatches, num_items_in_batch, reason)
        batch = _merge([layout(mb, length, update.settings.beta) for mb in microbatches])
        self._graphed_patch_optimizer()
        self._graphed_track_lr()
        loss = step.step(batch)
        state.last_step_graphed = True
        guard = step.guard
        norm = guard.grad_norm if guard is not None else None
        state.grad_norm = norm.clone() if isinstance(norm, torch.Tensor) else None
        records = update.records[length]
        if records:
            names = update.settings.metric_names()
            update.pending += [(names, values.clone()) for values in records]
        report = update.report
        report.graphed += 1
        report.buckets[length] = report.buckets.get(length, 0) + 1
        report.steps.append(f"graph:{length}")
        state.report.graphed_steps += 1
        return self._graphed_filter(loss.reshape(()))

    def _graphed_update_bucket(self, microbatches: List[Dict[str, Any]]
                               ) -> Tuple[Optional[int], str]:
        update = self._graphed_update
        if update.broken:
            return None, update.broken
        expected = self.args.gradient_accumulation_steps
        if len(microbatches) != expected:
            return None, (f"this optimizer step has {len(microbatches)} of "
                          f"gradient_accumulation_steps={expected} micro-batches")
        for mb in microbatches:
            problem = batch_problem(mb)
            if problem:
                return None, problem
        if update.settings is None:
            update.settings = LossSettings.of(self)
        if update.settings.beta != 0.0 and any(
                mb.get("ref_per_token_logps") is None for mb in microbatches):
            return None, "beta != 0 but the batch has no ref_per_token_logps"
        signatures = {_signature(mb) for mb in microbatches}
        if len(signatures) != 1:
            return None, "the micro-batches of this optimizer step carry different inputs"
        signature = signatures.pop()
        if update.signature is not None and signature != update.signature:
            return None, (f"the batch ({_describe(signature)}) differs from the one the update "
                          f"graphs were captured for ({_describe(update.signature)})")
        needed = max(mb["prompt_ids"].shape[1] + mb["completion_ids"].shape[1]
                     for mb in microbatches)
        config = getattr(self.accelerator.unwrap_model(self.model), "config", None)
        max_length = getattr(config, "max_position_embeddings", None)
        return bucket_length(needed, update.bucket_step, max_length, list(update.steps),
                             update.max_graphs)

    def _graphed_update_graph(self, model: nn.Module, microbatches: List[Dict[str, Any]],
                              length: int) -> Tuple[Any, str]:
        """The TrainStep of ``length``, captured on first use; or a reason."""
        from ..train import TrainStep, make_capturable

        state, update = self._graphed, self._graphed_update
        optimizer = _inner_optimizer(self.optimizer)
        if update.steps and not self._graphed_lr_kept(optimizer):
            # The param groups were replaced (a checkpoint was loaded): capture again.
            for old in update.steps.values():
                old.release()
            update.steps.clear()
            update.records.clear()
            update.signature = None
            update.report.add_note("the optimizer's param groups were replaced "
                                   "(load_state_dict); the update graphs were captured again")
        step = update.steps.get(length)
        if step is not None:
            return step, ""
        try:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise GraphedError(f"Expected a torch.optim optimizer, found "
                                   f"{type(optimizer).__name__}; use optim='adamw_torch_fused'.")
            if not state.lr_tensors:
                lrs = [group["lr"] for group in optimizer.param_groups]
                make_capturable(optimizer)
                state.lr_tensors = [group["lr"] for group in optimizer.param_groups]
                state.host_lr = [float(lr) for lr in lrs] if all(
                    not isinstance(lr, torch.Tensor) for lr in lrs) else None
            batch = _merge([layout(mb, length, update.settings.beta) for mb in microbatches])
            loss_module = GRPOUpdateLoss(self, model, update.settings)
            clip = self.args.max_grad_norm if self.args.max_grad_norm and \
                self.args.max_grad_norm > 0 else None
            logger.info("graphed: capturing the GRPO update for %d tokens per sequence "
                        "(%d micro-batches, max_grad_norm=%s)", length, len(microbatches), clip)
            started = time.perf_counter()
            model.train()
            step = TrainStep.from_parts(loss_module, optimizer, None, batch,
                                        microbatches=len(microbatches), clip_grad_norm=clip,
                                        warmup=update.warmup)
        except Exception as error:  # noqa: BLE001 - any failed capture falls back, counted
            update.broken = f"capturing the GRPO update failed: {str(error).strip()}"[:500]
            if update.fallback == "raise":
                raise GraphedError(update.broken) from error
            return None, update.broken
        update.report.capture_s += time.perf_counter() - started
        update.report.captures += 1
        update.steps[length] = step
        # The capture's calls are the last ones; the graph refreshes their metrics each replay.
        update.records[length] = loss_module.records[-len(microbatches):]
        loss_module.records = []
        state.report.train_step = step
        update.signature = _signature(microbatches[0])
        if "old_per_token_logps" not in update.signature[1]:
            update.report.add_note("no old_per_token_logps in TRL's batch (num_iterations=1): the "
                                   "ratio is to the detached current log-probabilities, as TRL's")
        return step, ""

    def _graphed_update_eager(self, model: nn.Module, microbatches: List[Dict[str, Any]],
                              num_items_in_batch: Any, reason: str) -> torch.Tensor:
        """TRL's compute_loss and backward on the prepared micro-batches."""
        from transformers import Trainer

        state, update = self._graphed, self._graphed_update
        state.last_step_graphed = False
        state.report.eager_steps += 1
        update.report.eager += 1
        update.report.steps.append("trl")
        update.report.add_fallback(reason)
        had = "_prepare_inputs" in vars(self)
        previous = vars(self).get("_prepare_inputs")
        self._prepare_inputs = lambda prepared: prepared  # already prepared
        total = None
        try:
            for inputs in microbatches:
                loss = self._graphed_filter(
                    Trainer.training_step(self, model, inputs, num_items_in_batch), total)
                total = loss if total is None else total + loss
        finally:
            if had:
                self._prepare_inputs = previous
            else:
                del self._prepare_inputs
        return total


__all__ = ["BUCKET_STEP", "GRPOUpdateLoss", "GraphedUpdate", "LossSettings",
           "SUPPORTED_LOSS_TYPES", "batch_problem", "bucket_length", "layout", "update_blockers"]
