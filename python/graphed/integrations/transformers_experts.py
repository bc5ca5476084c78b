"""transformers' mixture-of-experts layers in graphs of every precision.

transformers 5 runs the experts of Mixtral, Qwen3-MoE, gpt-oss, DeepSeek and
the rest through ``experts_implementation="grouped_mm"``: tokens sorted by
expert, per-expert offsets counted on the GPU, and ``torch._grouped_mm``.
torch's grouped GEMM stays on the GPU only for bf16 operands on Hopper and
Blackwell; for fp32 and fp16 (and so under autocast with fp32 master weights,
where transformers casts the tokens to the weights' dtype) it copies the
offsets to the host, which no graph can capture. graphed registers
``"graphed_grouped_mm"``, the same algorithm with graphed's grouped GEMM
(:func:`graphed.moe.grouped_mm`: offsets read on the device, fp32 accumulation;
Note [A grouped GEMM every dtype can capture]), and selects it when it
captures such a model, as it sets ``use_cache=False`` for training, saying so
in the notes. A model whose experts run an implementation the user chose
(``"eager"``, ``"batched_mm"``, a hub kernel) is left as it is.

Imported only when a model holds transformers experts.
"""

from __future__ import annotations

from typing import List

import torch
from torch import nn

#: The experts implementation graphed registers with transformers.
IMPLEMENTATION = "graphed_grouped_mm"

# transformers' default on CUDA (None: not resolved yet), which graphed replaces.
_REPLACEABLE = (None, "grouped_mm")


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` is an experts layer of transformers' experts interface
    (``@use_experts_implementation``), told without importing transformers."""
    return (type(module).__module__.startswith("transformers.")
            and all(hasattr(module, a) for a in ("has_gate", "is_transposed", "num_experts",
                                                 "down_proj", "config")))


def _weights(module: nn.Module) -> List[torch.Tensor]:
    names = ("gate_up_proj", "up_proj", "down_proj")
    return [getattr(module, n) for n in names if isinstance(getattr(module, n, None), torch.Tensor)]


def _needs_graphed_gemm(module: nn.Module) -> bool:
    """torch's grouped GEMM reads its offsets on the host unless both operands
    are bf16 on compute capability 9 or 10."""
    for weight in _weights(module):
        if weight.dtype != torch.bfloat16 or not weight.is_cuda:
            return True
        if torch.cuda.get_device_capability(weight.device)[0] not in (9, 10):
            return True
    return False


def _grouped_linear(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                    bias: torch.Tensor | None, is_transposed: bool) -> torch.Tensor:
    from ..moe import grouped_mm

    # [E, in, out] when transposed, else [E, out, in]: a view, no copy.
    weight = weight if is_transposed else weight.transpose(-2, -1)
    out = grouped_mm(input.to(weight.dtype), weight, offs)
    return out if bias is None else out + bias


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' ``grouped_mm_experts_forward`` (5.17) with graphed's grouped
    GEMM: the same routing, sort, offsets, gate and reduction, so results
    match transformers' up to the GEMM's rounding. Rows past the last offset
    (expert-parallel sentinels) come out of graphed's GEMM as zeros."""
    num_top_k = top_k_index.size(-1)
    num_tokens, hidden_dim = hidden_states.size(0), hidden_states.size(-1)
    sample_weights = top_k_weights.reshape(-1)
    expert_ids = top_k_index.reshape(-1)
    expert_ids_g, perm = torch.sort(expert_ids)
    selected = hidden_states[perm // num_top_k]
    sample_weights_g = sample_weights[perm]
    # histc on int, not bincount: no host read (as transformers does).
    tokens_per_expert = torch.histc(expert_ids_g.int(), bins=self.num_experts, min=0,
                                    max=self.num_experts - 1)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    sentinel = (expert_ids_g >= self.num_experts).unsqueeze(-1)
    expert_ids_g = expert_ids_g.clamp(max=self.num_experts - 1)
    selected = selected.masked_fill(sentinel, 0.0)

    if self.has_gate:
        up_weight = self.gate_up_proj
        up_bias = self.gate_up_proj_bias[expert_ids_g] if self.has_bias else None
    else:
        up_weight = self.up_proj
        up_bias = self.up_proj_bias[expert_ids_g] if self.has_bias else None
    projected = _grouped_linear(selected, up_weight, offsets, up_bias, self.is_transposed)
    projected = projected.masked_fill(sentinel, 0.0)
    projected = self._apply_gate(projected) if self.has_gate else self.act_fn(projected)
    down_bias = self.down_proj_bias[expert_ids_g] if self.has_bias else None
    projected = _grouped_linear(projected, self.down_proj, offsets, down_bias, self.is_transposed)
    projected = projected.masked_fill(sentinel, 0.0)
    weighted = projected * sample_weights_g.unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0), device=perm.device)
    weighted = weighted[inverse]
    out = weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
    return out.to(hidden_states.dtype)


def register() -> None:
    """Registers :data:`IMPLEMENTATION` with transformers (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, experts_forward)


def use_graphed_experts(model: nn.Module) -> List[str]:
    """Selects :data:`IMPLEMENTATION` for the experts of ``model`` that would
    otherwise run torch's grouped GEMM with host-read offsets; returns the
    notes saying so (none when nothing changed)."""
    changed: List[str] = []
    dtypes = set()
    for name, module in model.named_modules():
        if not is_experts(module):
            continue
        if getattr(module.config, "_experts_implementation", None) not in _REPLACEABLE:
            continue  # the user's choice
        if not _needs_graphed_gemm(module):
            continue
        register()
        module.config._experts_implementation = IMPLEMENTATION
        changed.append(name or "<root>")
        dtypes.update(str(w.dtype).replace("torch.", "") for w in _weights(module))
    if not changed:
        return []
    where = changed[0] if len(changed) == 1 else f"{changed[0]} and {len(changed) - 1} more"
    return [f"experts_implementation={IMPLEMENTATION!r} for the experts of {type(model).__name__} "
            f"({where}, {'/'.join(sorted(dtypes))} weights): transformers' grouped_mm reads the "
            "per-expert offsets on the host for operands other than bf16 on compute capability "
            "9/10 (torch's grouped GEMM fallback), which no graph can capture; graphed's grouped "
            "GEMM reads them on the GPU (same routing, fp32 accumulation)"]
