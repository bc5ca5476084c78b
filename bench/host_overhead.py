"""The host_overhead workload: CPU time per call of a graphed tiny Linear, the
forward alone and forward plus backward, for graphed.make_graphed_callables
against PyTorch's torch.cuda.make_graphed_callables (its Python `Graphed`
autograd.Function), with eager and a raw CUDAGraph replay of the forward as
references. The GPU work is a few microseconds, so the host is the bottleneck
and the wall time of a loop of calls measures the per-call host cost."""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any, Callable, Dict

import torch

import graphed

WIDTH = 64
BATCH = 8


def host_us(fn: Callable[[], Any], *, iters: int, repeats: int) -> float:
    """Median over `repeats` of the host microseconds per call of `iters` calls.
    The GPU is drained before each round and the clock stops before the final
    synchronize, so only the time the host spends issuing calls is counted."""
    for _ in range(20):
        fn()
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - started) / iters * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def run(quick: bool = False) -> Dict[str, Any]:
    torch.manual_seed(0)
    iters, repeats = (50, 3) if quick else (300, 7)
    base = torch.nn.Linear(WIDTH, WIDTH).cuda()
    x = torch.randn(BATCH, WIDTH, device="cuda")
    seed = torch.ones(BATCH, WIDTH, device="cuda")

    eager = copy.deepcopy(base)
    ours = graphed.make_graphed_callables(copy.deepcopy(base), (x.clone(),))
    theirs = torch.cuda.make_graphed_callables(copy.deepcopy(base), (x.clone(),))

    raw_module = copy.deepcopy(base)
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(3):
            raw_module(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    raw_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(raw_graph), torch.no_grad():
        raw_module(static_x)

    def forward(module):
        return lambda: module(x)

    def forward_backward(module):
        def call():
            module(x).backward(seed)
        return call

    def raw_replay():
        _ = raw_module  # the graph reads its weights: keep them alive
        raw_graph.replay()

    cases = {
        "raw_replay": raw_replay,
        "eager_fwd": forward(eager),
        "torch_mgc_fwd": forward(theirs),
        "graphed_mgc_fwd": forward(ours),
        "eager_fwd_bwd": forward_backward(eager),
        "torch_mgc_fwd_bwd": forward_backward(theirs),
        "graphed_mgc_fwd_bwd": forward_backward(ours),
    }
    results = {name: round(host_us(fn, iters=iters, repeats=repeats), 2)
               for name, fn in cases.items()}
    stats = graphed.graph_stats(ours)
    return {
        "description": f"host_overhead: Linear({WIDTH}, {WIDTH}) on a {BATCH}x{WIDTH} input; "
                       "host microseconds per call (median of rounds)",
        "host_us": results,
        "graphed_over_torch_fwd": round(results["graphed_mgc_fwd"] / results["torch_mgc_fwd"], 3),
        "graphed_over_torch_fwd_bwd": round(
            results["graphed_mgc_fwd_bwd"] / results["torch_mgc_fwd_bwd"], 3),
        "graphed_replays": {"forward": stats["forward_replays"],
                            "backward": stats["backward_replays"],
                            "eager_calls": stats["eager_calls"]},
    }
