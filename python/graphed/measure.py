"""Timing done right on a GPU: CUDA events around back-to-back calls, warm-up
first, the median of repeats; and the kernel-time floor from the profiler."""

from __future__ import annotations

import statistics
from typing import Callable, Dict, List, Tuple

import torch


def cuda_time_ms(fn: Callable[[], object], *, iters: int = 50, repeats: int = 7,
                 warmup: int = 5) -> float:
    """Milliseconds per call of ``fn``: the median over ``repeats`` of the mean of
    ``iters`` back-to-back calls, timed with CUDA events on the current stream."""
    return compare_ms({"fn": fn}, iters=iters, repeats=repeats, warmup=warmup)["fn"]


def compare_ms(fns: Dict[str, Callable[[], object]], *, iters: int = 50, repeats: int = 9,
               warmup: int = 5) -> Dict[str, float]:
    """Milliseconds per call of each function, measured side by side: every
    round times each function once (``iters`` back-to-back calls between CUDA
    events), rounds interleave the functions so drift hits all alike, and each
    result is the median over ``repeats`` rounds."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / iters)
    return {name: statistics.median(values) for name, values in samples.items()}


def kernel_floor_ms(fn: Callable[[], object], *, iters: int = 20) -> Tuple[float, float]:
    """The kernel-time floor of ``fn``: the summed duration of every GPU activity
    (kernels, copies, memsets) of one call, averaged over ``iters`` calls, from
    the profiler. Returns (milliseconds, GPU activities per call)."""
    fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total_us = 0.0
    count = 0
    for event in profile.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total_us += event.time_range.elapsed_us()
            count += 1
    return total_us / 1000.0 / iters, count / iters


def gpu_memory_mb() -> float:
    """Memory the caching allocator holds on the current device, in MiB."""
    return torch.cuda.memory_reserved() / 2**20
