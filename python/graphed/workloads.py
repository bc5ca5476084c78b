"""The launch-bound workloads of DESIGN.md, shared by ``graphed demo``, the
benchmarks and the tests. Built exactly as specified there, so that ratios
measured on different days stay comparable."""

from __future__ import annotations

from typing import Tuple

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
