"""graphed for TRL's ``GRPOTrainer``: rollouts on graphed's decoder, the
policy update on graphs.

    from graphed.integrations.trl import GraphedGRPOTrainer, optimize_grpo_trainer

    trainer = GraphedGRPOTrainer(model=policy, reward_funcs=reward, args=config,
                                 train_dataset=prompts)
    trainer.train()
    print(trainer.graphed_rollouts)
    print(trainer.graphed_update)

    trainer = optimize_grpo_trainer(existing_trainer)   # patches an instance

The completions of every GRPO step are sampled by :func:`graphed.generate`
(the decode steps replayed as CUDA graphs) with TRL's own sampling settings
(``temperature``, ``top_p``, ``top_k``, ``num_generations`` completions per
prompt, ``max_completion_length``, its end-of-sequence tokens) and the
policy's live weights: the graphs read the parameters in place, so no copy
and no weight sync follows an optimizer step. Everything around the
generation (padding of the prompts, masking after the first end-of-sequence
token, rewards, advantages, the loss) is TRL's, unchanged; Note [Rollouts on
graphs inside GRPOTrainer].

What graphed cannot reproduce (settings the decoder does not implement, such
as ``repetition_penalty`` or ``min_p``; multimodal inputs; a model the decoder
cannot drive) runs TRL's own ``model.generate``, with the reason in the
``graphed.integrations.trl`` logger and counted in
``trainer.graphed_rollouts.fallbacks``; ``fallback="raise"`` raises
:class:`graphed.GraphedError` instead. vLLM and transformers' continuous
batching never reach ``model.generate``: with those the trainer runs as TRL's,
and the report says so.

The policy update (log-probabilities of the completions, TRL's objective,
backward, clipping, the optimizer step) replays one CUDA graph per
sequence-length bucket, TRL's loss unchanged by the padding; what it cannot
reproduce runs TRL's training step, counted in
``trainer.graphed_update.fallbacks`` (graphed.integrations.trl_update).

TRL is imported only by this module, trl_update and trl_loss.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from .._C import GraphedError

try:  # The one place graphed imports TRL.
    from trl import GRPOTrainer
except ImportError as error:  # pragma: no cover - exercised only without TRL
    raise ImportError(
        f"graphed.integrations.trl needs the trl package (pip install trl): {error}") from error

from .trl_update import BUCKET_STEP, GraphedUpdate, _GraphedUpdateMixin  # noqa: E402

logger = logging.getLogger("graphed.integrations.trl")

FALLBACKS = ("trl", "raise")

#: The cache length of the decoder grows in steps of this many tokens, so
#: that prompts of varying length reuse one decoder and its graphs.
CACHE_LENGTH_STEP = 64


# Note [Rollouts on graphs inside GRPOTrainer]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# TRL 1.16's GRPOTrainer._generate_single_turn has three paths: vLLM,
# transformers' continuous batching (generate_batch), and the default, which
# left-pads the prompts, calls unwrapped_model.generate(input_ids,
# attention_mask, generation_config=...) under no_grad, and masks each
# completion after its first end-of-sequence token. graphed replaces one
# call of the default path and nothing else: while _generate_single_turn
# runs, the policy model's `generate` is an instance attribute that calls
# graphed.generate with the same arguments, and is removed afterwards. So the
# padding, the masking, TRL's profiling and every later stage stay TRL's,
# whatever TRL does around the call.
#  - The decoder graphs read the policy's parameters in place: after each
#    optimizer step the next rollout samples from the new weights, with no
#    copy (vLLM's sync_weights) and no recapture.
#  - The decoder is kept on the model and reused while its cache length is
#    unchanged (graphed.generate); prompts of varying length would change the
#    length every step, so the cache length is the largest prompt plus the
#    completion length seen so far, rounded up to CACHE_LENGTH_STEP tokens:
#    it settles within a few steps.
#  - Sampling follows TRL's settings (temperature, top_k, top_p, its
#    end-of-sequence tokens) on the decoder's sampling kernels, which draw
#    their own random numbers: completions are samples of the same
#    distribution as TRL's, not the same samples.
#  - graphed.generate refuses what it does not implement before any work
#    (GraphedError); that call then runs the model's own generate, and the
#    reason is logged and counted.
#  - The policy is in training mode during TRL's rollouts. Dropout active in
#    a rollout would be captured as it runs; graphed.generate decodes the
#    model as it is, as model.generate does.


@dataclass
class GraphedRollouts:
    """What graphed did with the trainer's rollouts: ``graphed`` calls of
    graphed.generate, ``fallbacks`` ({reason: calls that ran TRL's
    model.generate}), ``path`` (TRL's generation path), ``generation_s``
    (seconds spent in graphed.generate, the graphs' capture included),
    ``cache_length`` (the decoder's current cache length)."""

    path: str = "transformers"
    graphed: int = 0
    fallbacks: Dict[str, int] = field(default_factory=dict)
    generation_s: float = 0.0
    cache_length: int = 0

    def to_dict(self) -> Dict[str, Any]:
        """The report as a JSON-ready dict."""
        return {"path": self.path, "graphed": self.graphed, "fallbacks": dict(self.fallbacks),
                "generation_s": self.generation_s, "cache_length": self.cache_length}

    def __str__(self) -> str:
        lines = [f"graphed rollouts ({self.path} path): {self.graphed} generate call(s) on "
                 f"graphs, {sum(self.fallbacks.values())} on TRL's model.generate"]
        lines += [f"- {count} x {reason}" for reason, count in self.fallbacks.items()]
        return "\n".join(lines)


def generation_path(*, use_vllm: bool, use_transformers_continuous_batching: bool) -> str:
    """The generation path TRL takes: "vllm", "continuous_batching" or
    "transformers" (the default, which graphed replaces)."""
    if use_vllm:
        return "vllm"
    if use_transformers_continuous_batching:
        return "continuous_batching"
    return "transformers"


def cache_length(previous: int, prompt_length: int, max_new_tokens: int,
                 step: int = CACHE_LENGTH_STEP) -> int:
    """The decoder's cache length for a prompt of ``prompt_length`` tokens:
    never shorter than ``previous``, else the tokens needed rounded up to
    ``step`` (Note [Rollouts on graphs inside GRPOTrainer])."""
    if prompt_length < 1 or max_new_tokens < 1:
        raise GraphedError(f"Expected a prompt and at least one token to generate, got "
                           f"prompt_length={prompt_length}, max_new_tokens={max_new_tokens}.")
    needed = prompt_length + max_new_tokens
    return max(previous, -(-needed // step) * step)


def _check_fallback(fallback: str) -> None:
    if fallback not in FALLBACKS:
        raise GraphedError(f"Expected fallback to be one of {', '.join(FALLBACKS)}, got "
                           f"{fallback!r}: 'trl' runs TRL's model.generate where graphed cannot, "
                           "'raise' raises instead.")


class _GraphedGenerate:
    """The policy model's ``generate`` while a rollout runs: graphed.generate,
    or the model's own generate with the reason counted."""

    def __init__(self, model: Any, original: Callable[..., Any], report: GraphedRollouts,
                 fallback: str, compile: Any) -> None:
        self.model = model
        self.original = original
        self.report = report
        self.fallback = fallback
        self.compile = compile

    def __call__(self, input_ids: Optional[torch.Tensor] = None, **kwargs: Any) -> Any:
        import graphed

        if input_ids is None:
            input_ids = kwargs.pop("input_ids", None)
        try:
            config = kwargs.get("generation_config")
            new_tokens = kwargs.get("max_new_tokens") or getattr(config, "max_new_tokens", None)
            if input_ids is None or new_tokens is None:
                raise GraphedError("graphed decodes input_ids with max_new_tokens set; TRL passed "
                                   f"{'no input_ids' if input_ids is None else 'no max_new_tokens'}")
            length = cache_length(self.report.cache_length, input_ids.shape[-1], int(new_tokens))
            started = time.perf_counter()
            out = graphed.generate(self.model, input_ids, max_cache_len=length,
                                   compile=self.compile, **kwargs)
            self.report.generation_s += time.perf_counter() - started
            self.report.cache_length = length
            self.report.graphed += 1
            return out
        except GraphedError as error:
            if self.fallback == "raise":
                raise
            reason = str(error).splitlines()[0][:300]
            if reason not in self.report.fallbacks:
                logger.warning("graphed: this rollout runs TRL's model.generate: %s", reason)
            self.report.fallbacks[reason] = self.report.fallbacks.get(reason, 0) + 1
            if input_ids is not None:
                kwargs["input_ids"] = input_ids
            return self.original(**kwargs)


class _GraphedGRPOMixin:
    """The rollout path of GraphedGRPOTrainer and optimize_grpo_trainer."""

    graphed_rollouts: GraphedRollouts
    _graphed_fallback: str
    _graphed_compile: Any

    def _graphed_setup(self, fallback: str, compile: Any) -> None:
        _check_fallback(fallback)
        self._graphed_fallback = fallback
        self._graphed_compile = compile
        path = generation_path(
            use_vllm=bool(getattr(self, "use_vllm", False)),
            use_transformers_continuous_batching=bool(
                getattr(self, "use_transformers_continuous_batching", False)))
        self.graphed_rollouts = GraphedRollouts(path=path)
        if path != "transformers":
            message = (f"TRL generates with {path} here, which never calls model.generate: "
                       "rollouts run as TRL's. graphed replaces TRL's default path "
                       "(use_vllm=False, use_transformers_continuous_batching=False)")
            if fallback == "raise":
                raise GraphedError(message)
            logger.warning("graphed: %s", message)

    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        if self.graphed_rollouts.path != "transformers":
            return super()._generate_single_turn(*args, **kwargs)  # type: ignore[misc]
        model = self.accelerator.unwrap_model(self.model)  # type: ignore[attr-defined]
        had = "generate" in vars(model)
        original = model.generate
        model.generate = _GraphedGenerate(model, original, self.graphed_rollouts,
                                          self._graphed_fallback, self._graphed_compile)
        try:
            return super()._generate_single_turn(*args, **kwargs)  # type: ignore[misc]
        finally:
            if had:
                model.generate = original
            else:
                del model.generate


class GraphedGRPOTrainer(_GraphedGRPOMixin, _GraphedUpdateMixin, GRPOTrainer):
    """trl.GRPOTrainer whose rollouts run on graphed's decoder (Note [Rollouts
    on graphs inside GRPOTrainer]) and whose policy updates replay CUDA
    graphs (Note [The GRPO update on graphs] in trl_update.py). Takes
    GRPOTrainer's arguments, and:

    Args:
        graphed_fallback: ``"trl"`` runs TRL's own path where graphed cannot
            (a rollout on ``model.generate``, an update on TRL's training
            step), with the reason logged and counted; ``"raise"`` raises
            :class:`graphed.GraphedError` instead.
        graphed_compile: graphed.generate's ``compile`` for the rollouts.
        graphed_update: run the policy update on graphs (default); False
            leaves it TRL's.
        graphed_bucket_step: the sequence length (prompt plus completion) of
            an update graph is a multiple of this many tokens.
        graphed_max_update_graphs: at most this many update graphs (lengths);
            a longer step then pads to an existing longer one, or runs TRL's.
        graphed_warmup: eager iterations before an update graph is captured.

    ``graphed_rollouts`` and ``graphed_update`` report what ran where."""

    def __init__(self, *args: Any, graphed_fallback: str = "trl", graphed_compile: Any = False,
                 graphed_update: bool = True, graphed_bucket_step: int = BUCKET_STEP,
                 graphed_max_update_graphs: int = 8, graphed_warmup: int = 3,
                 **kwargs: Any) -> None:
        _check_fallback(graphed_fallback)
        super().__init__(*args, **kwargs)
        self._graphed_setup(graphed_fallback, graphed_compile)
        self._graphed_update_setup(bool(graphed_update), graphed_fallback, graphed_bucket_step,
                                   graphed_max_update_graphs, graphed_warmup)


def optimize_grpo_trainer(trainer: "GRPOTrainer", *, fallback: str = "trl",
                          compile: Any = False, update: bool = True,
                          bucket_step: int = BUCKET_STEP, max_update_graphs: int = 8,
                          warmup: int = 3) -> "GRPOTrainer":
    """Makes an existing GRPOTrainer's rollouts run on graphed's decoder and
    its policy updates on graphs, in place (its class becomes a subclass of
    its own class with graphed's paths); returns it. The arguments are
    GraphedGRPOTrainer's without the ``graphed_`` prefix. Call before
    ``trainer.train()``."""
    if not isinstance(trainer, GRPOTrainer):
        raise GraphedError(f"Expected a trl.GRPOTrainer, got {type(trainer).__name__}.")
    _check_fallback(fallback)
    if not isinstance(trainer, _GraphedGRPOMixin):
        trainer.__class__ = type(f"Graphed{type(trainer).__name__}",
                                 (_GraphedGRPOMixin, _GraphedUpdateMixin, type(trainer)), {})
    trainer._graphed_setup(fallback, compile)  # type: ignore[attr-defined]
    trainer._graphed_update_setup(  # type: ignore[attr-defined]
        bool(update), fallback, bucket_step, max_update_graphs, warmup)
    return trainer


__all__: List[str] = ["GraphedGRPOTrainer", "GraphedRollouts", "GraphedUpdate",
                      "optimize_grpo_trainer",
                      "generation_path", "cache_length", "CACHE_LENGTH_STEP"]
