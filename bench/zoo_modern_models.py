"""The second zoo (issue 28): today's architectures, random init from tiny
configs, nothing downloaded. Mixture-of-experts from transformers as it ships
them (Mixtral, Qwen3-MoE, gpt-oss, DeepSeek-V3: ``experts_implementation``
left to transformers, which picks ``grouped_mm`` on CUDA), a hand-written
mixture-of-experts block with the classic ``nonzero``/``where`` dispatch and
a Python loop over the experts that were hit (what most research code does),
the same block dispatched at fixed sizes through graphed.moe.grouped_mm
(the rewrite graphed's advice names),
Mamba2 (transformers' torch path, no mamba-ssm kernels) and a hybrid of
Mamba2, attention and experts (granite-moe-hybrid).

Each builder returns a ``ZooModel`` (bench/zoo_models.py) in fp32 on the GPU;
bench/zoo_modern.py runs each in two setups: bf16 parameters, and fp32
master weights under bf16 autocast. Sizes: "bench" for the results table,
"test" smaller, for tests/python/test_zoo_modern_gpu.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from zoo_models import ZooModel, _generator, _tokens


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    # Fused, as graphed makes it for a captured step (graphed.make_capturable),
    # so that eager and graphed run the same optimizer kernels: with bf16
    # parameters the foreach and fused AdamW round differently, and routing
    # to experts turns such differences into other experts within steps.
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def _causal_lm(name: str, model: nn.Module, vocab: int, batch: int, length: int,
               description: str) -> ZooModel:
    ids = _tokens(_generator(), batch, length, vocab)
    return ZooModel(
        name, "bench" if name.startswith("handwritten_moe") else "transformers", model, _adamw,
        None,
        {"input_ids": ids, "labels": ids},
        lambda b: ((), {"input_ids": _tokens(_generator(b), b, length, vocab),
                        "use_cache": False}),
        description, True)


def _sizes(size: str):
    # layers, width, batch, length, vocab
    return (4, 512, 4, 128, 8192) if size == "bench" else (2, 128, 2, 32, 512)


def mixtral(size: str) -> ZooModel:
    from transformers import MixtralConfig, MixtralForCausalLM

    layers, width, batch, length, vocab = _sizes(size)
    config = MixtralConfig(num_hidden_layers=layers, hidden_size=width,
                           intermediate_size=2 * width, num_attention_heads=8,
                           num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                           vocab_size=vocab, max_position_embeddings=max(length, 128),
                           bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = MixtralForCausalLM(config).cuda().train()
    return _causal_lm("mixtral", model, vocab, batch, length,
                      f"Mixtral {layers} layers d{width}, 8 experts top-2, {batch}x{length}")


def qwen3_moe(size: str) -> ZooModel:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    layers, width, batch, length, vocab = _sizes(size)
    config = Qwen3MoeConfig(num_hidden_layers=layers, hidden_size=width,
                            intermediate_size=2 * width, moe_intermediate_size=width // 2,
                            num_attention_heads=8, num_key_value_heads=2, head_dim=width // 8,
                            num_experts=16, num_experts_per_tok=4, vocab_size=vocab,
                            max_position_embeddings=max(length, 128), bos_token_id=0,
                            eos_token_id=0, pad_token_id=0)
    model = Qwen3MoeForCausalLM(config).cuda().train()
    return _causal_lm("qwen3_moe", model, vocab, batch, length,
                      f"Qwen3-MoE {layers} layers d{width}, 16 experts top-4, {batch}x{length}")


def gpt_oss(size: str) -> ZooModel:
    from transformers import GptOssConfig, GptOssForCausalLM

    layers, width, batch, length, vocab = _sizes(size)
    config = GptOssConfig(num_hidden_layers=layers, hidden_size=width, intermediate_size=width,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=width // 8,
                          num_local_experts=8, num_experts_per_tok=2, vocab_size=vocab,
                          max_position_embeddings=max(length, 128), sliding_window=length // 2,
                          bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = GptOssForCausalLM(config).cuda().train()
    return _causal_lm("gpt_oss", model, vocab, batch, length,
                      f"gpt-oss {layers} layers d{width}, 8 experts top-2 with biases, "
                      f"sliding window {length // 2}, {batch}x{length}")


def deepseek_v3(size: str) -> ZooModel:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    layers, width, batch, length, vocab = _sizes(size)
    config = DeepseekV3Config(num_hidden_layers=layers, first_k_dense_replace=1,
                              hidden_size=width, intermediate_size=2 * width,
                              moe_intermediate_size=width // 2, n_routed_experts=8,
                              num_experts_per_tok=2, n_shared_experts=1, n_group=1,
                              topk_group=1, num_attention_heads=8, num_key_value_heads=8,
                              q_lora_rank=width // 4, kv_lora_rank=width // 4,
                              qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=width // 8,
                              vocab_size=vocab, max_position_embeddings=max(length, 128),
                              bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = DeepseekV3ForCausalLM(config).cuda().train()
    return _causal_lm("deepseek_v3", model, vocab, batch, length,
                      f"DeepSeek-V3 {layers} layers d{width} (MLA, 1 dense layer, 8 routed + 1 "
                      f"shared experts top-2), {batch}x{length}")


class HandwrittenMoE(nn.Module):
    """Top-2 routing, then for each expert that was hit its tokens found with
    ``torch.where`` and its output added with ``index_add_``: data-dependent
    shapes and a loop whose trip count the host reads."""

    def __init__(self, width: int, experts: int = 8, top_k: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(experts))
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, chosen = torch.topk(F.softmax(self.router(tokens), dim=-1), self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(tokens.dtype)
        out = torch.zeros_like(tokens)
        mask = F.one_hot(chosen, len(self.experts)).permute(2, 1, 0)  # experts, k, tokens
        for e in torch.nonzero(mask.sum(dim=(1, 2))).flatten().tolist():
            slot, token = torch.where(mask[e])
            contribution = self.experts[e](tokens[token]) * weights[token, slot, None]
            out.index_add_(0, token, contribution.to(out.dtype))
        return out.reshape(shape)


class SortedDispatchMoE(HandwrittenMoE):
    """HandwrittenMoE's parameters and routing, dispatched at fixed sizes: the
    (token, choice) rows sorted by expert, each expert's rows one group of
    ``graphed.moe.grouped_mm`` over the experts' stacked weights, the outputs
    weighted and added back with ``index_add_``. Every size is the number of
    tokens times top-k, whatever the routing, so the block captures whole:
    the rewrite graphed's advice points a hand-written loop over experts to
    (docs/guide.md, section 8). Same parameters, so a HandwrittenMoE's
    state_dict loads unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from graphed.moe import grouped_mm

        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        experts = len(self.experts)
        weights, chosen = torch.topk(F.softmax(self.router(tokens), dim=-1), self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(tokens.dtype)
        flat = chosen.reshape(-1)  # expert of each (token, choice) row
        order = torch.argsort(flat, stable=True)
        expert_of_row = flat[order]
        # One-hot counts, not bincount: bincount sizes its output by reading
        # the largest id on the host.
        offsets = F.one_hot(flat, experts).sum(0).cumsum(0).to(torch.int32)
        first, second = zip(*((e[0], e[2]) for e in self.experts))
        w1 = torch.stack([m.weight for m in first]).transpose(-2, -1)  # (E, d, 2d)
        w2 = torch.stack([m.weight for m in second]).transpose(-2, -1)  # (E, 2d, d)
        b1 = torch.stack([m.bias for m in first])
        b2 = torch.stack([m.bias for m in second])
        rows = tokens[order // self.top_k].to(w1.dtype)  # the experts' dtype, as transformers
        hidden = F.gelu(grouped_mm(rows, w1, offsets) + b1[expert_of_row])
        out_rows = grouped_mm(hidden.to(w2.dtype), w2, offsets) + b2[expert_of_row]
        out_rows = out_rows * weights.reshape(-1)[order, None]
        out = torch.zeros_like(tokens)
        out.index_add_(0, order // self.top_k, out_rows.to(out.dtype))
        return out.reshape(shape)


class HandwrittenAttention(nn.Module):
    """Causal self-attention as research code writes it (nanoGPT's)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), is_causal=True)
        return self.proj(attn.transpose(1, 2).reshape(b, t, d))


class HandwrittenBlock(nn.Module):
    def __init__(self, width: int, heads: int, moe: type = HandwrittenMoE) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = HandwrittenAttention(width, heads)
        self.moe = moe(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class HandwrittenMoELM(nn.Module):
    """A decoder of HandwrittenBlocks, called as transformers' causal LMs are
    (``input_ids``, ``labels``; returns an object with ``.loss`` and ``.logits``)."""

    def __init__(self, layers: int, width: int, vocab: int, length: int,
                 moe: type = HandwrittenMoE) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(length, width) * 0.02)
        self.blocks = nn.ModuleList(HandwrittenBlock(width, 8, moe) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                use_cache: bool = False):
        x = self.embed(input_ids) + self.position[: input_ids.size(1)]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(),
                                   labels[:, 1:].reshape(-1))
        return _LMOutput(loss, logits)


@dataclass
class _LMOutput:
    loss: Optional[torch.Tensor]
    logits: torch.Tensor


def handwritten_moe(size: str) -> ZooModel:
    layers, width, batch, length, vocab = _sizes(size)
    torch.manual_seed(0)
    model = HandwrittenMoELM(layers, width, vocab, length).cuda().train()
    return _causal_lm("handwritten_moe", model, vocab, batch, length,
                      f"hand-written MoE decoder {layers} layers d{width}, 8 experts top-2, "
                      f"nonzero/where dispatch and a loop over the experts hit, {batch}x{length}")


def handwritten_moe_sorted(size: str) -> ZooModel:
    """handwritten_moe's model (the same seed, so the same weights) with its
    experts dispatched at fixed sizes (SortedDispatchMoE)."""
    layers, width, batch, length, vocab = _sizes(size)
    torch.manual_seed(0)
    model = HandwrittenMoELM(layers, width, vocab, length, SortedDispatchMoE).cuda().train()
    return _causal_lm("handwritten_moe_sorted", model, vocab, batch, length,
                      f"handwritten_moe with the experts sorted and run through "
                      f"graphed.moe.grouped_mm at fixed sizes, {batch}x{length}")


def mamba2(size: str) -> ZooModel:
    from transformers import Mamba2Config, Mamba2ForCausalLM

    layers, width, batch, length, vocab = _sizes(size)
    width //= 2
    config = Mamba2Config(num_hidden_layers=layers, hidden_size=width, state_size=64, expand=2,
                          head_dim=32, num_heads=2 * width // 32, n_groups=1,
                          chunk_size=min(64, length), vocab_size=vocab, bos_token_id=0,
                          eos_token_id=0, pad_token_id=0)
    model = Mamba2ForCausalLM(config).cuda().train()
    return _causal_lm("mamba2", model, vocab, batch, length,
                      f"Mamba2 {layers} layers d{width}, state 64, torch path (no mamba-ssm "
                      f"kernels), {batch}x{length}")


def granite_moe_hybrid(size: str) -> ZooModel:
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    layers, width, batch, length, vocab = _sizes(size)
    width //= 2
    config = GraniteMoeHybridConfig(
        num_hidden_layers=layers, hidden_size=width, intermediate_size=2 * width,
        shared_intermediate_size=2 * width, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=8, num_experts_per_tok=2,
        layer_types=["mamba" if i % 2 == 0 else "attention" for i in range(layers)],
        mamba_n_heads=8, mamba_d_head=2 * width // 8, mamba_d_state=64, mamba_n_groups=1,
        mamba_chunk_size=min(64, length), vocab_size=vocab,
        max_position_embeddings=max(length, 128), bos_token_id=0, eos_token_id=0,
        pad_token_id=0)
    model = GraniteMoeHybridForCausalLM(config).cuda().train()
    return _causal_lm("granite_moe_hybrid", model, vocab, batch, length,
                      f"granite-moe-hybrid {layers} layers d{width}: Mamba2 and attention "
                      f"layers alternating, 8 experts top-2 plus a shared MLP, {batch}x{length}")


BUILDERS: Dict[str, Callable[[str], ZooModel]] = {
    "mixtral": mixtral, "qwen3_moe": qwen3_moe, "gpt_oss": gpt_oss, "deepseek_v3": deepseek_v3,
    "handwritten_moe": handwritten_moe, "handwritten_moe_sorted": handwritten_moe_sorted,
    "mamba2": mamba2,
    "granite_moe_hybrid": granite_moe_hybrid,
}

#: The setups each model trains in: bf16 parameters, and fp32 master weights
#: under bf16 autocast.
SETUPS = ("bf16", "amp_bf16")


def build(name: str, size: str = "bench", setup: str = "bf16") -> ZooModel:
    if setup not in SETUPS:
        raise ValueError(f"setup must be one of {SETUPS}, got {setup!r}")
    torch.manual_seed(0)
    entry = BUILDERS[name](size)
    if setup == "bf16":
        entry.model.to(torch.bfloat16)
    return entry
