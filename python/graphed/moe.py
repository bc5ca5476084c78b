"""graphed.moe: the grouped matrix product of mixture-of-experts layers, which
CUDA graphs can capture in every dtype.

``torch._grouped_mm`` (what transformers' mixture-of-experts layers call) is
capturable only for bfloat16 on compute capability 9.x and 10.x; for float32
and float16 it copies the offsets to the host, so capture fails.
:func:`grouped_mm` takes the same arguments and runs torch's kernel where it
is capturable and graphed's own kernels everywhere else, see
Note [A grouped GEMM every dtype can capture] in src/grouped_mm.cpp::

    offs = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
    out = graphed.moe.grouped_mm(rows_sorted_by_expert, weights, offs)

The logic is in the C++ core (include/graphed/grouped_mm.h).
"""

from __future__ import annotations

import torch

from . import _C

__all__ = ["grouped_mm", "grouped_mm_uses_torch"]


def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, *,
               kernels: str = "auto") -> torch.Tensor:
    """The grouped product ``out[rows of g] = input[rows of g] @ weight[g]``.

    Args:
        input: ``[S, K]`` CUDA tensor (float32, bfloat16 or float16), the rows
            of every group one after another, sorted by group.
        weight: ``[E, K, N]`` in ``input``'s dtype, one matrix per group. Weights
            stored ``[E, N, K]`` are passed as ``w.transpose(-2, -1)``, without
            a copy.
        offs: int32 ``[E]`` on the same GPU: the cumulative row counts, so
            group ``g`` owns rows ``offs[g-1]:offs[g]`` (``offs[-1]`` is 0), as
            ``torch.cumsum(rows_per_group, 0, dtype=torch.int32)`` makes them.
            Read on the device only: a captured graph follows the offsets the
            tensor holds when it replays.
        kernels: ``"auto"`` (torch's kernel where it is capturable, see
            :func:`grouped_mm_uses_torch`; graphed's elsewhere) or
            ``"graphed"`` (graphed's kernels always).

    Returns:
        ``[S, N]`` in ``input``'s dtype, products accumulated in float32. Rows
        past ``offs[-1]`` are zeros (``torch._grouped_mm`` leaves them
        uninitialized). Differentiable in ``input`` and ``weight`` (first
        order). Offsets out of range or out of order give wrong rows, never a
        fault: each is clamped into ``[0, S]`` and the running maximum is taken.

    Raises:
        graphed.GraphedError: when the shapes, dtypes or devices do not fit,
            before anything runs.
    """
    return _C.grouped_mm(input, weight, offs, kernels)


def grouped_mm_uses_torch(input: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when :func:`grouped_mm` of these operands runs torch's own
    capturable kernel (``torch._grouped_mm``: bfloat16 on compute capability
    9.x or 10.x, in layouts it takes), False when it runs graphed's kernels."""
    return bool(_C.grouped_mm_uses_torch(input, weight))
