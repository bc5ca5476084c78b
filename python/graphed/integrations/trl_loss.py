"""The loss of graphed's GRPO update (``graphed.integrations.trl_update``)
and the batch layout it runs on: which TRL settings it reproduces
(:func:`update_blockers`, :class:`LossSettings`), the sequence-length buckets
(:func:`bucket_length`), one TRL micro-batch in the update's layout
(:func:`layout`, :func:`batch_problem`, Note [One layout for every prompt and
completion length]) and TRL's objective without host syncs
(:class:`GRPOUpdateLoss`).

TRL is imported only inside ``_head_scores_every_position``, when a loss
runs; ``graphed.integrations.trl_update`` re-exports every name."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._C import GraphedError

__all__ = ["BUCKET_STEP", "GRPOUpdateLoss", "LossSettings", "SUPPORTED_LOSS_TYPES",
           "batch_problem", "bucket_length", "layout", "update_blockers"]

#: TRL loss types whose loss graphed's update reproduces.
SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo")

#: The sequence length of an update graph is a multiple of this many tokens by default.
BUCKET_STEP = 32

#: Batch keys the update understands; any other non-empty value (images...)
#: sends the step to TRL's training step.
_KNOWN_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
               "num_items_in_batch", "old_per_token_logps", "ref_per_token_logps",
               "sampling_per_token_logps", "tool_mask")


# Note [One layout for every prompt and completion length]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# TRL left-pads the prompts to the longest one and right-pads the completions
# to the longest, so both lengths change every step. The update lays each
# row out as TRL's sequence, prompt then completion, followed by masked
# padding up to the bucket length L (a multiple of bucket_step): the real
# tokens keep their positions (TRL passes no position_ids, so a model counts
# positions from the first column, TRL's own left padding included), and
# under causal attention no real token sees the padding. Only L identifies a
# graph. The per-token tensors (completion mask, old and reference
# log-probabilities, 2-D advantages) sit at the positions that predict each
# completion token, with zeros elsewhere; every TRL loss type reduces them
# with the mask or with fixed counts (max_completion_length for dr_grpo,
# num_items_in_batch for dapo and cispo), so the padding changes no value:
# the loss equals TRL's up to the rounding of differently shaped kernels.


def update_blockers(*, loss_type: str, top_entropy_quantile: float = 1.0,
                    entropy_bonus: bool = False, aux_loss: bool = False,
                    vllm_importance_sampling: bool = False,
                    off_policy_mask: bool = False, liger_kernel: bool = False,
                    fp16: bool = False, gradient_checkpointing: bool = False,
                    training_step_owner: Optional[str] = None) -> List[str]:
    """What keeps the GRPO update from running on graphs, beyond the
    Trainer integration's :func:`~graphed.integrations.transformers.training_blockers`
    and :func:`~graphed.integrations.transformers.step_blockers`; each reason
    says what was expected, what was found and the fix. Plain values, so
    that it runs without a trainer."""
    reasons = []
    if loss_type not in SUPPORTED_LOSS_TYPES:
        reasons.append(
            f"Expected a loss_type graphed's update reproduces ({', '.join(SUPPORTED_LOSS_TYPES)}), "
            f"found loss_type={loss_type!r}; that loss runs in TRL's training step.")
    if top_entropy_quantile < 1.0:
        reasons.append(
            f"top_entropy_quantile={top_entropy_quantile} masks tokens by a quantile of the "
            "entropies gathered on the host, which a graph cannot hold. Use "
            "top_entropy_quantile=1.0 for the graphed update.")
    if entropy_bonus:
        reasons.append(
            "The entropy bonus (entropy_coef != 0 or adaptive entropy) reads the entropy on the "
            "host every step to adapt its coefficient; graphed's update does not implement it. "
            "Set entropy_coef=0.0 for the graphed update.")
    if aux_loss:
        reasons.append(
            "The MoE load-balancing loss (router_aux_loss_coef with output_router_logits) is not "
            "part of graphed's update; set router_aux_loss_coef=0.0 or graphed_update=False.")
    if vllm_importance_sampling:
        reasons.append(
            "vLLM's importance-sampling correction (vllm_importance_sampling_correction=True) is "
            "not part of graphed's update; turn it off, or train with graphed rollouts instead "
            "of vLLM.")
    if off_policy_mask:
        reasons.append(
            "off_policy_mask_threshold is not part of graphed's update; leave it None for the "
            "graphed update.")
    if liger_kernel:
        reasons.append(
            "use_liger_kernel=True replaces the model's layers with Liger's kernels, which "
            "graphed has not verified under capture; train without it for the graphed update.")
    if fp16:
        reasons.append(
            "fp16=True scales the loss with accelerate's GradScaler, which reads the scale on the "
            "host; use bf16=True (or full precision) for the graphed update.")
    if gradient_checkpointing:
        reasons.append(
            "Expected gradient_checkpointing=False for the graphed update (TRL's configs turn it "
            "on by default): checkpointing recomputes activations in backward and saves "
            "random-generator state on the host, which a captured step cannot replay. Pass "
            "gradient_checkpointing=False to GRPOConfig; graphs replace its memory saving with "
            "static buffers sized once per bucket.")
    if training_step_owner is not None:
        reasons.append(
            f"{training_step_owner}.training_step overrides GRPOTrainer.training_step, which the "
            "graphed update replaces; put custom code elsewhere, or graphed_update=False.")
    return reasons


def bucket_length(needed: int, step: int = BUCKET_STEP, max_length: Optional[int] = None,
                  existing: Sequence[int] = (), max_graphs: Optional[int] = None
                  ) -> Tuple[Optional[int], str]:
    """The sequence length of the graph for ``needed`` tokens (prompt plus
    completion): ``needed`` rounded up to ``step``, at most ``max_length``
    (the model's positions); once ``max_graphs`` lengths exist, the shortest
    existing one that fits. Returns ``(length, "")`` or ``(None, reason)``."""
    if needed < 2 or step < 1:
        raise GraphedError(f"Expected a sequence of at least 2 tokens and a bucket step >= 1, got "
                           f"needed={needed}, step={step}.")
    length = -(-needed // step) * step
    if max_length is not None and length > max_length:
        length = max(needed, max_length)
    if max_graphs is None or length in existing or len(existing) < max_graphs:
        return length, ""
    fits = sorted(n for n in existing if n >= needed)
    if fits:
        return fits[0], ""
    return None, (f"this step needs {needed} tokens per sequence and max_update_graphs="
                  f"{max_graphs} graphs exist already (lengths {sorted(existing)}); raise "
                  "max_update_graphs or bucket_step")


def layout(microbatch: Dict[str, Any], length: int, beta: float = 0.0) -> Dict[str, torch.Tensor]:
    """One TRL micro-batch in the update's layout of ``length`` tokens per
    row (Note [One layout for every prompt and completion length]):
    ``input_ids``, ``attention_mask``, ``labels`` (B, length); ``mask`` and,
    when TRL has them, ``old_per_token_logps``, ``ref_per_token_logps``
    (only with ``beta != 0``) of (B, length - 1) at the positions that
    predict the completion tokens; ``advantages``; ``num_items_in_batch``
    once per row."""
    prompt_ids, prompt_mask = microbatch["prompt_ids"], microbatch["prompt_mask"]
    completion_ids, completion_mask = microbatch["completion_ids"], microbatch["completion_mask"]
    rows, prompt = prompt_ids.shape
    completion = completion_ids.shape[1]
    if prompt + completion > length:
        raise GraphedError(f"Expected at most {length} prompt and completion tokens per row, got "
                           f"{prompt} + {completion}.")
    pad = length - prompt - completion
    ids = prompt_ids.new_zeros(rows, pad)
    out = {"input_ids": torch.cat([prompt_ids, completion_ids, ids], dim=1),
           "attention_mask": torch.cat([prompt_mask, completion_mask,
                                        prompt_mask.new_zeros(rows, pad)], dim=1)}
    labels = torch.full_like(out["input_ids"], -100)
    labels[:, prompt:prompt + completion] = completion_ids.masked_fill(completion_mask == 0, -100)
    out["labels"] = labels
    positions = slice(prompt - 1, prompt - 1 + completion)  # logps index t scores token t + 1

    def per_token(values: torch.Tensor) -> torch.Tensor:
        full = values.new_zeros(rows, length - 1)
        full[:, positions] = values
        return full

    mask = completion_mask if microbatch.get("tool_mask") is None \
        else completion_mask * microbatch["tool_mask"]
    out["mask"] = per_token(mask)
    advantages = microbatch["advantages"]
    out["advantages"] = advantages if advantages.dim() == 1 else per_token(advantages)
    if microbatch.get("old_per_token_logps") is not None:
        out["old_per_token_logps"] = per_token(microbatch["old_per_token_logps"])
    if beta != 0.0:
        out["ref_per_token_logps"] = per_token(microbatch["ref_per_token_logps"])
    items = microbatch.get("num_items_in_batch")
    if isinstance(items, torch.Tensor):
        out["num_items_in_batch"] = items.reshape(-1)[:1].to(torch.float32).repeat(rows)
    return out


def batch_problem(microbatch: Any) -> str:
    """Why a TRL micro-batch cannot go through the graphed update ("" when it can)."""
    if not isinstance(microbatch, dict):
        return f"Expected TRL's batch to be a dict, got {type(microbatch).__name__}"
    missing = [k for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                           "advantages") if not isinstance(microbatch.get(k), torch.Tensor)]
    if missing:
        return f"the batch has no {', '.join(missing)}"
    extra = sorted(k for k, v in microbatch.items() if k not in _KNOWN_KEYS and v is not None)
    if extra:
        return (f"the batch holds {', '.join(extra)} (multimodal or other inputs), which "
                "graphed's update does not pass to the model")
    return ""


@dataclass(frozen=True)
class LossSettings:
    """The GRPOTrainer settings the loss reads, as plain values."""

    loss_type: str
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: Optional[float] = None
    importance_sampling_level: str = "token"
    use_bias_correction_kl: bool = False
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    max_completion_length: int = 256
    steps_per_generation: int = 1
    num_processes: int = 1

    @classmethod
    def of(cls, trainer: Any) -> "LossSettings":
        """The settings of a GRPOTrainer."""
        args = trainer.args
        return cls(loss_type=trainer.loss_type, beta=float(trainer.beta),
                   epsilon_low=float(trainer.epsilon_low), epsilon_high=float(trainer.epsilon_high),
                   delta=args.delta, importance_sampling_level=trainer.importance_sampling_level,
                   use_bias_correction_kl=bool(args.use_bias_correction_kl),
                   sapo_temperature_pos=float(getattr(args, "sapo_temperature_pos", 1.0)),
                   sapo_temperature_neg=float(getattr(args, "sapo_temperature_neg", 1.05)),
                   max_completion_length=int(trainer.max_completion_length),
                   steps_per_generation=int(args.steps_per_generation),
                   num_processes=int(trainer.accelerator.num_processes))

    def metric_names(self) -> List[str]:
        """The TRL metrics the loss records, in order."""
        names = ["entropy"] + (["kl"] if self.beta != 0.0 else [])
        if self.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            names += ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                      "clip_ratio/low_min", "clip_ratio/high_max"]
        elif self.loss_type == "cispo":
            names.append("cispo_clip_ratio")
        return names


@contextlib.contextmanager
def _head_scores_every_position() -> Iterator[None]:
    """TRL's fused LM head without its compact path (Note [The GRPO update on graphs])."""
    from trl.trainer import utils as trl_utils

    original = getattr(trl_utils, "_use_triton", None)
    if original is None:
        yield
        return
    trl_utils._use_triton = lambda device: False
    try:
        yield
    finally:
        trl_utils._use_triton = original


def _nan_extreme(values: torch.Tensor, largest: bool) -> torch.Tensor:
    """TRL's nanmin/nanmax without its host sync: NaN when every value is NaN."""
    fill = float("-inf") if largest else float("inf")
    cleaned = torch.where(torch.isnan(values), torch.full_like(values, fill), values)
    extreme = cleaned.max() if largest else cleaned.min()
    return torch.where(torch.isnan(values).all(), torch.full_like(extreme, float("nan")), extreme)


class GRPOUpdateLoss(nn.Module):
    """One micro-batch's GRPO loss as TRL 1.16's ``_compute_loss`` computes
    it, on a batch in the update's :func:`layout`, without the division by
    the gradient accumulation steps (graphed's iteration divides) and
    without host syncs; TRL's metrics of the call are appended to
    ``records`` as one device tensor (``settings.metric_names()``)."""

    def __init__(self, trainer: Any, model: nn.Module, settings: LossSettings) -> None:
        super().__init__()
        self.model = model  # a submodule: its parameters and buffers are the step's state
        object.__setattr__(self, "_trainer", trainer)  # not a submodule
        self.settings = settings
        self.records: List[torch.Tensor] = []

    def forward(self, **batch: torch.Tensor) -> torch.Tensor:
        s, trainer = self.settings, self._trainer
        mask = batch["mask"]
        with trainer.compute_loss_context_manager():
            with _head_scores_every_position(), trainer.accelerator.autocast():
                outputs = self.model(input_ids=batch["input_ids"],
                                     attention_mask=batch["attention_mask"],
                                     labels=batch["labels"], fused_lm_head=True)
            logps, entropies = outputs.log_probs, outputs.entropy
            advantages = batch["advantages"]
            if advantages.dim() == 1:
                advantages = advantages.unsqueeze(1)
            old = batch.get("old_per_token_logps")
            old = logps.detach() if old is None else old
            log_ratio = logps - old
            if s.importance_sampling_level == "token":
                log_weights = log_ratio
            else:
                log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
            coef_1 = torch.exp(log_weights)
            kl = None
            if s.beta != 0.0:
                ref = batch["ref_per_token_logps"]
                kl = torch.exp(ref - logps) - (ref - logps) - 1
                if s.use_bias_correction_kl:
                    kl = kl * coef_1
            if s.loss_type == "cispo":
                clamped = torch.clamp(coef_1, max=s.epsilon_high).detach()
                per_token_loss = -clamped * advantages * logps
            elif s.loss_type == "sapo":
                temperatures = torch.where(advantages > 0, s.sapo_temperature_pos,
                                           s.sapo_temperature_neg)
                per_token_loss = -(torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
                                   ) * advantages
            else:
                coef_2 = torch.clamp(coef_1, 1 - s.epsilon_low, 1 + s.epsilon_high)
                ratio = coef_1 if s.delta is None else torch.clamp(coef_1, max=s.delta)
                per_token_loss = -torch.min(ratio * advantages, coef_2 * advantages)
            if kl is not None:
                per_token_loss = per_token_loss + s.beta * kl
            masked = per_token_loss * mask
            if s.loss_type in ("grpo", "sapo"):
                loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
            elif s.loss_type == "bnpo":
                loss = masked.sum() / mask.sum().clamp(min=1.0)
            elif s.loss_type == "dr_grpo":
                loss = masked.sum() / (per_token_loss.size(0) * s.max_completion_length)
            elif s.loss_type in ("dapo", "cispo"):
                items = batch["num_items_in_batch"][0].clamp(min=1.0) / s.num_processes
                loss = masked.sum() / (items / s.steps_per_generation)
            else:  # luspo
                loss = masked.sum(-1).mean()
        with torch.no_grad():
            self.records.append(self._metrics(mask, entropies, kl, coef_1, advantages))
        return loss

    def _metrics(self, mask: torch.Tensor, entropies: torch.Tensor, kl: Optional[torch.Tensor],
                 coef_1: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        s = self.settings

        def global_mean(x: torch.Tensor) -> torch.Tensor:
            if x.shape[1] == 1:
                return x.sum() / x.shape[0]
            return (x * mask).sum() / mask.sum().float().clamp(min=1.0)

        def row_means(x: torch.Tensor) -> torch.Tensor:
            return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

        values = [global_mean(entropies)] + ([global_mean(kl)] if kl is not None else [])
        if s.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            low = ((coef_1 < 1 - s.epsilon_low) & (advantages < 0)).float()
            high = ((coef_1 > 1 + s.epsilon_high) & (advantages > 0)).float()
            region = torch.maximum(low, high)
            values += [global_mean(low), global_mean(high), global_mean(region),
                       _nan_extreme(row_means(low), largest=False),
                       _nan_extreme(row_means(high), largest=True)]
        elif s.loss_type == "cispo":
            values.append(global_mean(((coef_1 > s.epsilon_high) & (advantages > 0)).float()))
        return torch.stack([v.float().reshape(()) for v in values])


def _signature(microbatch: Dict[str, Any]) -> Tuple[int, Tuple[str, ...]]:
    """What an update graph fixes about a micro-batch besides its length:
    the rows, and which optional inputs it carries."""
    optional = ("old_per_token_logps", "tool_mask", "num_items_in_batch")
    return (int(microbatch["prompt_ids"].shape[0]),
            tuple(k for k in optional if microbatch.get(k) is not None))


def _describe(signature: Tuple[int, Tuple[str, ...]]) -> str:
    rows, keys = signature
    return f"{rows} rows" + (f" with {', '.join(keys)}" if keys else "")


def _merge(batches: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Micro-batches in the update's layout, concatenated along dim 0 (the
    iteration splits them back)."""
    if len(batches) == 1:
        return batches[0]
    return {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
