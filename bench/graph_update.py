"""The graph_update workload (issue 6, item 4): how a graph gets an input that
arrives at a new address. ``copy_<size>``: graphed.capture(input_update=
"copy") copies it into the static buffer; ``repoint_<size>``:
input_update="repoint" re-points the graph's kernels at it
(cudaGraphExecKernelNodeSetParams), see Note [Re-pointing a graph]. Every call
alternates between two input tensors, so each one arrives at a new address.
``stable_copy``/``stable_auto``: the largest input at one address on every
call (copied each time vs re-pointed once). The function is a short chain of
elementwise kernels, two of which read the input; ``eager`` runs it eagerly at
the largest size (the kernel floor is of that size too)."""

from __future__ import annotations

import itertools
from typing import Any, Dict

import torch

import graphed
from graphed import measure

from harness import Method, max_abs_diff, prepare, time_methods, workload_record

SIZES_KIB = (64, 1024, 16384, 131072)


def function(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x) * 2.0 + x.abs()


def label(kib: int) -> str:
    return f"{kib // 1024}MiB" if kib >= 1024 else f"{kib}KiB"


def run(quick: bool = False) -> Dict[str, Any]:
    iters, repeats = (20, 3) if quick else (100, 7)
    methods: Dict[str, Method] = {}
    largest = None
    for kib in SIZES_KIB:
        elements = kib * 1024 // 4
        pair = [torch.randn(elements, device="cuda") for _ in range(2)]
        largest = pair
        for mode in ("copy", "repoint"):
            def setup(pair=pair, mode=mode, name=f"{mode}_{label(kib)}"):
                fast = graphed.capture(function, pair[0], input_update=mode)
                inputs = itertools.cycle(pair)
                for x in pair:
                    methods[name].record["max_abs_diff_vs_eager"] = max(
                        methods[name].record.get("max_abs_diff_vs_eager", 0.0),
                        max_abs_diff(fast(x), function(x)))
                stats = fast.stats()
                methods[name].record["repointable_inputs"] = stats["repointable_inputs"]
                methods[name].record["kernels"] = stats["kernels"]
                return lambda: fast(next(inputs))
            name = f"{mode}_{label(kib)}"
            methods[name] = Method(name, setup, True)

    x = largest[0]

    def stable(mode: str):
        def setup():
            fast = graphed.capture(function, x, input_update=mode)
            return lambda: fast(x)
        return setup

    methods["stable_copy"] = Method("stable_copy", stable("copy"), True)
    methods["stable_auto"] = Method("stable_auto", stable("auto"), True)
    methods = {"eager": Method("eager", lambda: (lambda: function(x))), **methods}
    for method in methods.values():
        print(f"bench: graph_update: {method.name}", flush=True)
        prepare(method)
    time_methods(methods, iters=iters, repeats=repeats)
    floor_ms, activities = measure.kernel_floor_ms(lambda: function(x))
    record = workload_record(methods, floor_ms, activities, __doc__.split("\n\n")[0].strip())
    record["crossover"] = {
        label(kib): round(methods[f"copy_{label(kib)}"].record["ms"] /
                          methods[f"repoint_{label(kib)}"].record["ms"], 3)
        for kib in SIZES_KIB
    }
    return record
