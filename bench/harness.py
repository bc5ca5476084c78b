"""Shared pieces of the benchmarks: timing every method of a workload side by side
in one process, capture time and graph memory, and the result records."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

import torch

from graphed import measure


@dataclass
class Method:
    """One way of running a workload: ``setup()`` prepares it (warm-up, capture,
    compilation) and returns the callable that runs one iteration."""

    name: str
    setup: Callable[[], Callable[[], Any]]
    is_graph: bool = False
    record: Dict[str, Any] = field(default_factory=dict)
    run: Optional[Callable[[], Any]] = None


def prepare(method: Method) -> None:
    """Runs ``method.setup`` and records how long it took and how much device
    memory it kept (the graph, its pool and static buffers)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    started = time.perf_counter()
    method.run = method.setup()
    torch.cuda.synchronize()
    setup_ms = (time.perf_counter() - started) * 1000
    if method.is_graph:
        method.record["capture_ms"] = round(setup_ms, 2)
        torch.cuda.empty_cache()
        held_mb = (torch.cuda.memory_reserved() - reserved) / 2**20
        if held_mb >= 0:
            method.record["graph_mb"] = round(held_mb, 2)
        else:
            # The method released more cached memory than it kept (torch.compile's
            # trees manage their own pool): its graph memory cannot be read this way.
            method.record["graph_mb"] = None
    else:
        method.record["setup_ms"] = round(setup_ms, 2)


def torch_capture(fn: Callable[[], Any], *, warmup: int = 3, pool=None):
    """PyTorch's documented manual capture: ``warmup`` eager calls on a side
    stream, then ``torch.cuda.graph``. Returns the graph and what ``fn``
    returned during capture (its static outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = fn()
    return graph, output


def time_methods(methods: Dict[str, Method], *, iters: int, repeats: int) -> None:
    """Times every prepared method side by side and stores ``ms`` in its record."""
    times = measure.compare_ms({name: m.run for name, m in methods.items()}, iters=iters,
                               repeats=repeats)
    for name, ms in times.items():
        methods[name].record["ms"] = round(ms, 4)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def workload_record(methods: Dict[str, Method], floor_ms: float, activities: float,
                    description: str) -> Dict[str, Any]:
    """The JSON record of a timed workload: each method's numbers with its ratio
    to the kernel floor and its speedup over the ``eager`` method."""
    records = {}
    for name, method in methods.items():
        record = dict(method.record)
        record["ratio_to_floor"] = round(record["ms"] / floor_ms, 3)
        record["speedup_vs_eager"] = round(methods["eager"].record["ms"] / record["ms"], 3)
        records[name] = record
    return {
        "description": description,
        "kernel_floor_ms": round(floor_ms, 4),
        "gpu_activities_per_iter": activities,
        "methods": records,
    }
