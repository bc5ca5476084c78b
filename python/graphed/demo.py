"""``graphed demo``: the launch-bound MLP of DESIGN.md, eager against captured."""

from __future__ import annotations

import sys
from typing import TextIO

import torch

from . import measure, workloads
from .capture import capture


def run(out: TextIO = sys.stdout) -> int:
    """Runs the demo; returns the process exit code (0 when outputs match)."""
    if not torch.cuda.is_available():
        print(
            "graphed demo: capturing CUDA graphs needs an NVIDIA GPU, and this machine has none "
            "(torch.cuda.is_available() is False), so nothing was run.\n"
            "On a GPU the demo runs this workload eagerly and as one captured graph:\n"
            f"  {workloads.MLP_INFERENCE_DESCRIPTION}\n"
            "It checks that both give the same output, then prints the time per call of each, "
            "the speedup, and the ratio of the graph's time to the kernel-time floor (the summed "
            "duration of the workload's kernels).",
            file=out,
        )
        return 0

    workloads.configure_numerics()
    model, x = workloads.mlp_inference()
    with torch.no_grad():
        expected = model(x)
        fast = capture(model, x)
        got = fast(x).clone()
        max_diff = (expected - got).abs().max().item()
        matches = torch.allclose(expected, got, rtol=1e-5, atol=1e-5)
        eager_ms = measure.cuda_time_ms(lambda: model(x))
        graphed_ms = measure.cuda_time_ms(lambda: fast(x))
        floor_ms, kernels = measure.kernel_floor_ms(lambda: model(x))
    stats = fast.stats()
    print(f"graphed demo on {torch.cuda.get_device_name()}", file=out)
    print(f"  workload       {workloads.MLP_INFERENCE_DESCRIPTION}", file=out)
    print(f"  outputs        {'match' if matches else 'DIFFER'} (max |eager - graphed| = "
          f"{max_diff:.3g})", file=out)
    print(f"  eager          {eager_ms:.3f} ms per call ({kernels:.0f} GPU activities)", file=out)
    print(f"  graphed        {graphed_ms:.3f} ms per call ({stats['kernels']} kernels in one "
          f"graph, captured in {stats['capture_ms']:.1f} ms)", file=out)
    print(f"  speedup        {eager_ms / graphed_ms:.2f}x", file=out)
    print(f"  kernel floor   {floor_ms:.3f} ms: graphed runs at {graphed_ms / floor_ms:.2f}x the "
          f"floor, eager at {eager_ms / floor_ms:.2f}x", file=out)
    return 0 if matches else 1
