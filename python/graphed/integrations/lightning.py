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
imports Lightning (``lightning``, else ``pytorch_lightning``).

The step mode's machinery apart from the callback (its conditions, batch
signatures, the log recorder, the captured step) is in
``graphed.integrations.lightning_step``; its names are importable from here
too."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import distributed
from .._C import GraphedError, InputMismatchError
from ..auto import auto as _auto, stats as _auto_stats
from ..capture import capture as _capture, graph_pool_handle as _graph_pool_handle

try:  # Lightning 2.x ships as `lightning`; `pytorch_lightning` is the older name.
    from lightning.pytorch import Callback as _Callback
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        from pytorch_lightning import Callback as _Callback
    except ImportError as error:
        raise ImportError(
            "graphed.integrations.lightning needs PyTorch Lightning: pip install lightning "
            "(or pytorch_lightning).") from error

from .lightning_step import (CALLBACK_STEP_HOOKS, GraphedTraining, LogRecorder, MODULE_STEP_HOOKS,
                             PRECISIONS, StepEngine, StepSettings, TrainingStepModule, _Logged,
                             _Recording, _attribute_reads, _code_of, _concat, _device_problem,
                             _frozen_reads, _lightning_base, _metric_modules, _nested_codes,
                             _optimizer_problem, _overridden, _parameter_reads, batch_signature,
                             concat_batches, ddp_problems, ddp_wrapper, describe_signature,
                             is_ddp_strategy, step_conditions)

__all__ = ["CUDAGraphs", "StepSettings", "step_conditions"]

#: What this module takes from lightning_step without using it itself: it
#: stays importable from here, as before the step mode had a file of its own.
_REEXPORTED = (CALLBACK_STEP_HOOKS, MODULE_STEP_HOOKS, PRECISIONS, StepEngine, TrainingStepModule,
               _attribute_reads, _code_of, _concat, _Logged, _metric_modules, _nested_codes,
               _optimizer_problem, _parameter_reads, ddp_problems)

logger = logging.getLogger("graphed.integrations.lightning")

MODES = ("auto", "step", "modules")
FALLBACKS = ("eager", "raise")

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


# Note [DDP in Lightning's captured step]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# With strategy="ddp" (DDPStrategy, any number of devices, one included)
# Lightning wraps the LightningModule in DistributedDataParallel
# (DDPStrategy._setup_model, from strategy.setup, after the callbacks' setup
# hook) and calls training_step through it: its strategy's training_step
# "redirects" the call, patching the module's forward to run training_step
# once and calling the wrapper, so that DDP's forward prepares the reducer.
# The step mode does the same (TrainingStepModule with the wrapper), inside
# the captured iteration, so DDP's gradient hooks all-reduce in the graph as
# for a TrainStep over graphed.distributed.prepare_ddp's model (Note [DDP
# built by a framework] in python/graphed/distributed.py). What changes:
#  - the callback's setup hook replaces the strategy's _setup_model for the
#    fit by graphed.distributed.build_ddp with the strategy's device ids and
#    DDP arguments: Lightning builds DDP on a fresh side stream, the capture
#    needs graphed's capture stream (teardown puts Lightning's back);
#  - step_conditions refuses what DDP capture cannot do (ddp_problems:
#    graphed.distributed.framework_ddp_problems on the wrapper: the gloo
#    backend, NCCL's asynchronous error handling, find_unused_parameters
#    without static_graph, a communication hook), each with its fix, and
#    mode="modules" refuses DDPStrategy (graphed.auto's backward is not
#    DDP's), so mode="auto" under DDP is the step mode or eager;
#  - the warm-up is at least graphed.distributed.COLLECTIVE_WARMUP_ITERS.
# Lightning blocks DDP's gradient sync (no_sync) on the batches that only
# accumulate; the captured iteration all-reduces every micro-batch (point 4
# of that Note), and a window that runs eagerly does so too, since the
# callback runs its batches at the window's last one, outside Lightning's
# no_sync.


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

    Conditions of the step mode: one CUDA device (SingleDeviceStrategy) or
    DDP (``strategy="ddp"``, see Note [DDP in Lightning's captured step]:
    NCCL with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``, no
    ``find_unused_parameters``), automatic optimization, one
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
        problem = (_device_problem(trainer, ddp=self.mode in ("auto", "step"))
                   if self._require_cuda else None)
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

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Before DDPStrategy wraps the module for fitting: makes it build the
        DistributedDataParallel on graphed's capture stream (Note [DDP in
        Lightning's captured step])."""
        strategy = trainer.strategy
        if stage != "fit" or self.mode == "modules" or not is_ddp_strategy(strategy):
            return
        device = getattr(strategy, "root_device", None)
        if device is None or device.type != "cuda" or "_setup_model" in vars(strategy):
            return

        def _setup_model(model: nn.Module) -> nn.Module:
            return distributed.build_ddp(model, device, device_ids=[device.index],
                                         **strategy._ddp_kwargs)

        strategy._setup_model = _setup_model
        self._patched_strategy = strategy

    def _unpatch_strategy(self) -> None:
        strategy = getattr(self, "_patched_strategy", None)
        if strategy is not None:
            vars(strategy).pop("_setup_model", None)
            self._patched_strategy = None

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Puts back everything the callback replaced and frees the graphs;
        :attr:`report` keeps their statistics."""
        self._unpatch_strategy()
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
        """The captured step (a :class:`GraphedTraining`); under DDPStrategy
        through its DistributedDataParallel (Note [DDP in Lightning's captured
        step])."""
        wrapper = ddp_wrapper(self._trainer)
        engine = GraphedTraining(pl_module, optimizer, settings, batch, extra_args, self.warmup,
                                 wrapper)
        if engine.warmup != self.warmup:
            self._notes.append(f"warm-up of {engine.warmup} iterations instead of "
                               f"warmup={self.warmup}: DistributedDataParallel needs that many "
                               "eager iterations before its all-reduces can be captured")
        if wrapper is not None:
            self._notes.append("DistributedDataParallel's all-reduces are captured with the "
                               "step, one per accumulated batch")
        return engine

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
            if is_ddp_strategy(self._trainer.strategy):
                self._fall_back("the module's blocks", _device_problem(self._trainer))
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
