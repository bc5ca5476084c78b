"""The launch-bound workloads of DESIGN.md, shared by ``graphed demo``, the
benchmarks and the tests. Built exactly as specified there, so that ratios
measured on different days stay comparable."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn


def configure_numerics() -> None:
    """fp32 with TF32 matmuls allowed, as every DESIGN.md figure was measured."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


class MLPBlock(nn.Module):
    """``Linear(width, width) -> GELU -> LayerNorm(width)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(nn.functional.gelu(self.linear(x)))


class ResidualMLP(nn.Module):
    """``depth`` MLPBlocks applied as ``x = x + block(x)``."""

    def __init__(self, width: int = 512, depth: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


MLP_INFERENCE_DESCRIPTION = (
    "mlp_inference: 16 blocks of Linear(512, 512) -> GELU -> LayerNorm(512), applied as "
    "x = x + block(x); input 32x512 fp32 (TF32 matmuls), eval mode, no_grad"
)


def mlp_inference(device: str = "cuda", batch: int = 32, width: int = 512,
                  depth: int = 16) -> Tuple[nn.Module, torch.Tensor]:
    """The ``mlp_inference`` workload: the model in eval mode and its input (seed 0)."""
    torch.manual_seed(0)
    model = ResidualMLP(width, depth).to(device).eval()
    x = torch.randn(batch, width, device=device)
    return model, x


class GPTBlock(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        shape = (batch, length, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attention = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, length, width))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class GPT(nn.Module):
    """Token and learned position embeddings, GPTBlocks, final LayerNorm, linear head."""

    def __init__(self, vocab: int = 4096, context: int = 128, width: int = 384,
                 depth: int = 6, heads: int = 6) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        nn.init.normal_(self.position, std=0.02)
        self.blocks = nn.ModuleList(GPTBlock(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.token(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


GPT_TRAIN_DESCRIPTION = (
    "gpt_train: GPT (vocab 4096, 6 pre-LN blocks, d=384, 6 heads, context 128), batch 8x128 "
    "tokens, cross-entropy, AdamW(lr=1e-4); fp32 with TF32 matmuls"
)


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of next-token logits (batch, length, vocab) against targets."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def gpt_train(device: str = "cuda", batch: int = 8, length: int = 128,
              vocab: int = 4096) -> Tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The ``gpt_train`` workload: the model (seed 0), random tokens and targets."""
    torch.manual_seed(0)
    model = GPT(vocab=vocab, context=length).to(device)
    tokens = torch.randint(0, vocab, (batch, length), device=device)
    targets = torch.randint(0, vocab, (batch, length), device=device)
    return model, tokens, targets


class DecodeBlock(GPTBlock):
    """One decode step of a GPTBlock (same layers): the single query of each
    sequence attends to fixed K and V caches of length 512 (sliced to the
    batch), then a 4x GELU MLP; both with residuals. Only q of the qkv Linear
    is used, as in DESIGN.md's decode workload."""

    def __init__(self, width: int, heads: int, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> None:
        super().__init__(width, heads)
        # Views of the model's cache buffers, [max_batch, heads, length, head_dim].
        # Plain attributes, not buffers: they are the model's state (its
        # state_dict holds them once) and the block only reads them.
        self.caches = (k_cache, v_cache)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, width = x.shape
        q = self.qkv(self.norm1(x))[:, :width]
        q = q.view(batch, self.heads, 1, width // self.heads)
        k, v = (cache[:batch] for cache in self.caches)
        attention = nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(attention.reshape(batch, width))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class Decoder(nn.Module):
    """``layers`` DecodeBlocks over K and V cache buffers of shape
    ``[layers, max_batch, heads, length, width // heads]``."""

    def __init__(self, width: int = 512, heads: int = 8, layers: int = 8, max_batch: int = 64,
                 length: int = 512, device: str = "cuda",
                 caches: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        super().__init__()
        shape = (layers, max_batch, heads, length, width // heads)
        if caches is None:
            caches = (torch.randn(shape, device=device), torch.randn(shape, device=device))
        self.register_buffer("k_cache", caches[0])
        self.register_buffer("v_cache", caches[1])
        self.blocks = nn.ModuleList(
            DecodeBlock(width, heads, self.k_cache[i], self.v_cache[i]) for i in range(layers))
        self.to(device)
        self.config = dict(width=width, heads=heads, layers=layers, max_batch=max_batch,
                           length=length)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def decode_copy(model: Decoder) -> Decoder:
    """Another Decoder with the same weights (copied) and the same caches
    (shared, not copied: they are gigabytes), in the same mode, so that
    methods that modify their model (graphed.auto) leave ``model`` alone."""
    copy = Decoder(device=str(model.k_cache.device), caches=(model.k_cache, model.v_cache),
                   **model.config)
    copy.load_state_dict(model.state_dict())
    return copy.train(model.training)


DECODE_BATCHES = (1, 3, 5, 8, 13, 21, 32, 47, 64)

DECODE_DESCRIPTION = (
    "decode: 8 blocks (d=512, 8 heads): LayerNorm, qkv Linear (q only), attention of one query "
    "against fixed K/V caches of length 512 ([8, 64, 8, 512, 64] buffers sliced to the batch), "
    "output Linear, residual, LayerNorm + 4x GELU MLP, residual; input (B, 512), B cycling "
    "through 1, 3, 5, 8, 13, 21, 32, 47, 64; ms per step averaged over the cycle; fp32 with "
    "TF32 matmuls, eval mode, no_grad"
)


def decode(device: str = "cuda", layers: int = 8, width: int = 512, heads: int = 8,
           max_batch: int = 64, length: int = 512,
           batches: Tuple[int, ...] = DECODE_BATCHES) -> Tuple[nn.Module, Tuple[torch.Tensor, ...]]:
    """The ``decode`` workload: the model in eval mode (seed 0) and one input
    per batch size of the cycle."""
    torch.manual_seed(0)
    model = Decoder(width, heads, layers, max_batch, length, device).eval()
    inputs = tuple(torch.randn(batch, width, device=device) for batch in batches)
    return model, inputs


class HostReadGPTBlock(GPTBlock):
    """A GPTBlock that reads a value to the host on every call (``.item()``),
    as logging or a data-dependent branch would: it cannot be captured."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.detach().abs().amax().item() > 1e6:  # never true; still a host sync
            x = x * 0.5
        return super().forward(x)


GPT_TRAIN_BLOCKER_DESCRIPTION = GPT_TRAIN_DESCRIPTION.replace(
    "gpt_train:", "gpt_train_blocker:") + "; block 3 calls .item() on every forward"


def gpt_train_blocker(device: str = "cuda", batch: int = 8, length: int = 128,
                      vocab: int = 4096, blocked: int = 3):
    """The gpt_train workload with block ``blocked`` a HostReadGPTBlock (same weights)."""
    model, tokens, targets = gpt_train(device, batch, length, vocab)
    original = model.blocks[blocked]
    replacement = HostReadGPTBlock(original.norm1.normalized_shape[0], original.heads).to(device)
    replacement.load_state_dict(original.state_dict())
    model.blocks[blocked] = replacement
    return model, tokens, targets
