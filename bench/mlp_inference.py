"""The mlp_inference workload of DESIGN.md: eager, PyTorch's manual
``torch.cuda.graph``, ``torch.compile(mode="reduce-overhead")``, ``graphed.capture``
and ``graphed.capture`` of the model compiled without cudagraphs."""

from __future__ import annotations

from typing import Any, Dict

import torch

import graphed
from graphed import measure, workloads

from harness import (Method, workload_record, max_abs_diff, prepare, time_methods,
                     torch_capture)

# The mode of torch.compile whose kernels graphed captures: the same fusion as
# "reduce-overhead", without its cudagraphs, so the comparison isolates the graph mechanism.
COMPILE_MODE_WITHOUT_GRAPHS = "default"


def torch_manual_graph(model: torch.nn.Module, x: torch.Tensor):
    static_x = x.clone()
    graph, static_y = torch_capture(lambda: model(static_x))

    def step():
        static_x.copy_(x)
        graph.replay()
        return static_y

    return step


def run(quick: bool = False) -> Dict[str, Any]:
    workloads.configure_numerics()
    model, x = workloads.mlp_inference()
    iters, repeats = (20, 3) if quick else (100, 9)
    with torch.no_grad():
        expected = model(x)
        floor_ms, activities = measure.kernel_floor_ms(lambda: model(x))

        def compiled_with_graphs():
            compiled = torch.compile(model, mode="reduce-overhead")
            for _ in range(3):
                compiled(x)
            return lambda: compiled(x)

        def graphed_capture():
            fast = graphed.capture(model, x)
            methods["graphed_capture"].record["kernels"] = fast.stats()["kernels"]
            return lambda: fast(x)

        def graphed_capture_compiled():
            compiled = torch.compile(model, mode=COMPILE_MODE_WITHOUT_GRAPHS)
            fast = graphed.capture(compiled, x)
            methods["graphed_capture_compiled"].record["compile_mode"] = COMPILE_MODE_WITHOUT_GRAPHS
            methods["graphed_capture_compiled"].record["kernels"] = fast.stats()["kernels"]
            return lambda: fast(x)

        methods = {
            "eager": Method("eager", lambda: (lambda: model(x))),
            "torch_graph": Method("torch_graph", lambda: torch_manual_graph(model, x), True),
            "compile_reduce_overhead": Method("compile_reduce_overhead", compiled_with_graphs,
                                              True),
            "graphed_capture": Method("graphed_capture", graphed_capture, True),
            "graphed_capture_compiled": Method("graphed_capture_compiled",
                                               graphed_capture_compiled, True),
        }
        for method in methods.values():
            print(f"bench: mlp_inference: {method.name}", flush=True)
            prepare(method)
            got = method.run()
            method.record["max_abs_diff_vs_eager"] = max_abs_diff(got, expected)
        time_methods(methods, iters=iters, repeats=repeats)

    return workload_record(methods, floor_ms, activities, workloads.MLP_INFERENCE_DESCRIPTION)
