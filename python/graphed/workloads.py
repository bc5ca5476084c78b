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
