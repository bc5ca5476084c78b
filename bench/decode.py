"""The decode workload of DESIGN.md: batch sizes cycling through 1..64 over
one model. Eager; ``torch_buckets``, hand-written power-of-two bucket graphs
of the whole model on one pool (DESIGN.md's anchor); ``torch.compile(mode=
"reduce-overhead")``; ``graphed_auto`` (one graph per layer and batch size
seen, captured on first use into one pool); ``graphed_auto_buckets`` (the
same power-of-two buckets as torch_buckets); ``graphed_auto_repoint``
(graphed_auto re-pointing graphs at their inputs instead of copying them,
input_update="auto"). One step runs the next batch
size of the cycle; ms is per step, averaged over whole cycles."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List

import torch

import graphed
from graphed import measure, workloads

from harness import (Method, max_abs_diff, prepare, time_methods, torch_capture,
                     workload_record)

POWER_OF_TWO = [1, 2, 4, 8, 16, 32, 64]


def cycle_step(run_batch: Callable[[torch.Tensor], torch.Tensor], inputs) -> Callable[[], Any]:
    batches = itertools.cycle(inputs)
    return lambda: run_batch(next(batches))


def torch_buckets(model, width: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Power-of-two bucket graphs of the whole model, largest first into one
    pool, written as PyTorch's documentation shows (torch.cuda.graph per bucket)."""
    pool = torch.cuda.graph_pool_handle()
    graphs: Dict[int, Any] = {}
    for size in sorted(POWER_OF_TWO, reverse=True):
        static_x = torch.zeros(size, width, device="cuda")
        graph, static_y = torch_capture(lambda: model(static_x), pool=pool)
        graphs[size] = (graph, static_x, static_y)

    def run(x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        size = next(s for s in POWER_OF_TWO if s >= batch)
        graph, static_x, static_y = graphs[size]
        static_x[:batch].copy_(x)
        graph.replay()
        return static_y[:batch]

    return run


def run(quick: bool = False) -> Dict[str, Any]:
    workloads.configure_numerics()
    model, inputs = workloads.decode()
    width = inputs[0].shape[1]
    cycle = len(inputs)
    iters, repeats = (cycle * 2, 3) if quick else (cycle * 6, 7)

    with torch.no_grad():
        expected = [model(x) for x in inputs]

        def check(method: Method, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
            method.record["max_abs_diff_vs_eager"] = max(
                max_abs_diff(fn(x), want) for x, want in zip(inputs, expected))

        def eager():
            return cycle_step(model, inputs)

        def buckets():
            fn = torch_buckets(model, width)
            check(methods["torch_buckets"], fn)
            return cycle_step(fn, inputs)

        def compiled():
            # Bounded: one compile per distinct shape class, then cudagraph
            # recordings per batch size; warmed up over three cycles.
            fn = torch.compile(model, mode="reduce-overhead")
            for _ in range(3):
                for x in inputs:
                    fn(x)
            check(methods["compile_reduce_overhead"], lambda x: fn(x).clone())
            return cycle_step(fn, inputs)

        def auto(name: str, bucket_sizes, input_update: str = "copy"):
            # The copy of the weights (about 100 MB) is made here, before
            # prepare() reads its baseline: weights are not graph memory, and
            # torch_buckets graphs the original model without copying it.
            target = workloads.decode_copy(model)

            def setup():
                managed = graphed.auto(target, warmup=3, input_update=input_update,
                                       buckets=None if bucket_sizes is None else {0: bucket_sizes})
                started = time.perf_counter()
                for _ in range(3 + 1):  # warm-up cycles, then the cycle that captures
                    for x in inputs:
                        managed(x)
                torch.cuda.synchronize()
                stats = managed.stats()
                record = methods[name].record
                record["capture_s"] = round(stats["capture_ms"] / 1000, 3)
                record["warmup_and_capture_s"] = round(time.perf_counter() - started, 3)
                record["graphs"] = stats["graphs"]
                record["captures"] = stats["captures"]
                record["auto_graph_memory_mb"] = round(stats["graph_memory_bytes"] / 2**20, 2)
                record["pool_reserved_mb"] = round(stats["pool_reserved_bytes"] / 2**20, 2)
                record["fallbacks"] = stats["fallbacks"]
                check(methods[name], managed)
                return cycle_step(managed, inputs)
            return setup

        methods = {
            "eager": Method("eager", eager),
            "torch_buckets": Method("torch_buckets", buckets, True),
            "graphed_auto": Method("graphed_auto", auto("graphed_auto", None), True),
            "graphed_auto_buckets": Method("graphed_auto_buckets",
                                           auto("graphed_auto_buckets", POWER_OF_TWO), True),
            # Issue 6 item 4 on this workload: each layer's input is the
            # previous layer's graph output, at one address per batch size, so
            # input_update="auto" re-points each graph once instead of copying.
            "graphed_auto_repoint": Method("graphed_auto_repoint",
                                           auto("graphed_auto_repoint", None, "auto"), True),
        }
        # DECODE_METHODS=eager,torch_buckets,... runs a subset (eager always).
        # Without it, compile_reduce_overhead runs in a process of its own, so
        # that its speedup is measured against an eager run without the other
        # methods' graphs. (It once hit an illegal memory access here: PyTorch
        # frees the cuBLAS workspace hand-written graphs captured, Note
        # [cuBLAS workspaces of captured graphs]; bench/run.py now drops stale
        # workspaces between workloads.)
        chosen = os.environ.get("DECODE_METHODS")
        if chosen:
            keep = {"eager", *chosen.split(",")}
            if "compile_reduce_overhead" in keep:
                methods["compile_reduce_overhead"] = Method("compile_reduce_overhead", compiled,
                                                            True)
            methods = {name: m for name, m in methods.items() if name in keep}
        for method in methods.values():
            print(f"bench: decode: {method.name}", flush=True)
            prepare(method)
            if method.is_graph and "capture_ms" in method.record:
                method.record.setdefault("capture_s", round(method.record["capture_ms"] / 1000, 3))
        time_methods(methods, iters=iters, repeats=repeats)
        floor_ms = _cycle_floor_ms(model, inputs)

    record = workload_record(methods, floor_ms, float("nan"), workloads.DECODE_DESCRIPTION)
    record.pop("gpu_activities_per_iter")
    if "graphed_auto" in methods and "torch_buckets" in methods:
        auto_ms = methods["graphed_auto"].record["ms"]
        buckets_ms = methods["torch_buckets"].record["ms"]
        record["graphed_auto_vs_torch_buckets"] = {
            "speed_ratio": round(buckets_ms / auto_ms, 3),
            "graph_mb_ratio": _ratio(methods["graphed_auto"].record.get("graph_mb"),
                                     methods["torch_buckets"].record.get("graph_mb")),
        }
    if not quick and not chosen:
        compiled_record = _compiled_in_own_process(floor_ms)
        if "error" in compiled_record:
            record["compile_reduce_overhead_error"] = compiled_record["error"]
        else:
            record["methods"]["compile_reduce_overhead"] = compiled_record
    return record


def _compiled_in_own_process(floor_ms: float) -> Dict[str, Any]:
    """compile_reduce_overhead timed in a child process against that process's
    own eager run (its speedup is a same-process ratio; its ms are not)."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "decode_compile.json")
        env = dict(os.environ, DECODE_METHODS="compile_reduce_overhead")
        run_py = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run.py")
        done = subprocess.run([sys.executable, run_py, "--json", out, "decode"], env=env,
                              capture_output=True, text=True, timeout=180)
        if not os.path.exists(out):
            return {"error": done.stderr[-2000:] or f"exit code {done.returncode}"}
        with open(out) as file:
            child = json.load(file)["workloads"]["decode"]
    if "error" in child:
        return {"error": child["error"][-2000:]}
    record = dict(child["methods"]["compile_reduce_overhead"])
    record["ratio_to_floor"] = round(record["ms"] / floor_ms, 3)
    record["measured_in"] = "its own process, against that process's eager (speedup_vs_eager)"
    return record


def _ratio(a, b):
    if a is None or b in (None, 0):
        return None
    return round(a / b, 3)


def _cycle_floor_ms(model, inputs: List[torch.Tensor]) -> float:
    """The kernel floor of one step, averaged over the cycle."""
    total = 0.0
    for x in inputs:
        ms, _ = measure.kernel_floor_ms(lambda: model(x), iters=5)
        total += ms
    return total / len(inputs)
