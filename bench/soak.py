"""The soak workload (issue 13): 100,000 replays with changing inputs through
each API (graphed.capture, with input copies and with re-pointing;
graphed.make_graphed_callables, forward and backward; graphed.TrainStep;
graphed.auto with buckets and a memory budget that forces evictions) on a
small residual MLP (4 blocks of Linear(256, 256) -> GELU -> LayerNorm, batch
32). Records device memory after warm-up and at the end (growth must stay
within 1 MB), the largest difference from eager at ~10 sampled steps, and for
auto the graph memory against its budget. fp32, TF32 off, so that the
differences measure graphed, not rounding."""

from __future__ import annotations

import copy
import gc
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

import graphed
from graphed import workloads

from harness import max_abs_diff

REPLAYS = 100_000
QUICK_REPLAYS = 2_000
WIDTH, BATCH, DEPTH = 256, 32, 4
INPUTS = 16  # distinct input tensors each API cycles through
SAMPLES = 10  # steps compared with eager
GROWTH_LIMIT_MB = 1.0
DIFF_LIMIT = 1e-4
BUCKETS = (8, 16, 32)
AUTO_PHASES = 50  # how often auto's working set of bucket sizes changes
DEVICE = "cuda"  # tests/python/test_soak_bookkeeping.py runs the bookkeeping on the CPU


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return workloads.ResidualMLP(WIDTH, DEPTH).to(DEVICE)


def random_inputs(count: int, rows: Optional[int] = None, seed: int = 1) -> List[torch.Tensor]:
    rows = BATCH if rows is None else rows
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    return [torch.randn(rows, WIDTH, device=DEVICE, generator=generator) for _ in range(count)]


def settle() -> None:
    gc.collect()
    torch.cuda.synchronize()


def soak(call: Callable[[int], Any], check: Callable[[int], float], *, calls: int,
         warmup_calls: int, replays: Callable[[], int],
         on_call: Callable[[int], None] = lambda i: None) -> Dict[str, Any]:
    """Calls ``call(i)`` for i in range(calls), except at ~SAMPLES evenly spaced
    steps after warm-up, where ``check(i)`` makes the call and returns its
    largest difference from eager (the last warm-up call is a check too, not
    counted). Device memory is read after ``warmup_calls``
    and at the end (synchronized, after a garbage collection)."""
    measured = calls - warmup_calls
    samples = {warmup_calls + (k * measured) // SAMPLES for k in range(SAMPLES)}
    diffs: List[float] = []
    for i in range(warmup_calls):
        on_call(i)
        if i == warmup_calls - 1:
            # The eager side's lazy state (its streams' cuBLAS workspaces, the
            # twin optimizer's state) must exist before memory is read.
            check(i)
        else:
            call(i)
    settle()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    replays_before = replays()
    started = time.perf_counter()
    for i in range(warmup_calls, calls):
        on_call(i)
        if i in samples:
            diffs.append(check(i))
        else:
            call(i)
    settle()
    seconds = time.perf_counter() - started
    done = replays()
    allocated_growth = (torch.cuda.memory_allocated() - allocated) / 2**20
    reserved_growth = (torch.cuda.memory_reserved() - reserved) / 2**20
    max_diff = max(diffs) if diffs else float("nan")
    return {
        "replays": done,
        "calls": calls,
        "seconds": round(seconds, 2),
        "us_per_replay": round(seconds / max(done - replays_before, 1) * 1e6, 2),
        "allocated_mb_after_warmup": round(allocated / 2**20, 2),
        "reserved_mb_after_warmup": round(reserved / 2**20, 2),
        "allocated_growth_mb": round(allocated_growth, 3),
        "reserved_growth_mb": round(reserved_growth, 3),
        "max_abs_diff_vs_eager": max_diff,
        "samples": len(diffs),
        "ok": bool(abs(allocated_growth) <= GROWTH_LIMIT_MB and
                   abs(reserved_growth) <= GROWTH_LIMIT_MB and max_diff <= DIFF_LIMIT),
    }


def soak_capture(replays: int, input_update: str) -> Dict[str, Any]:
    model = mlp().eval()
    inputs = random_inputs(INPUTS)
    with torch.no_grad():
        fast = graphed.capture(model, inputs[0], input_update=input_update)

        def call(i: int) -> None:
            fast(inputs[i % INPUTS])

        def check(i: int) -> float:
            x = inputs[i % INPUTS]
            return max_abs_diff(fast(x), model(x))

        record = soak(call, check, calls=replays, warmup_calls=max(replays // 20, 10),
                      replays=lambda: fast.stats()["replays"])
    stats = fast.stats()
    record.update(input_copies=stats["input_copies"], input_repoints=stats["input_repoints"],
                  repointable_inputs=stats["repointable_inputs"])
    return record


def soak_make_graphed_callables(replays: int) -> Dict[str, Any]:
    """Each call replays the forward graph and, through backward(), the backward
    graph: two replays per call. Gradients are dropped before each call."""
    model = mlp()
    reference = copy.deepcopy(model)
    inputs = random_inputs(INPUTS)
    seed = torch.ones(BATCH, WIDTH, device=DEVICE)
    layer = graphed.make_graphed_callables(model, (inputs[0].clone(),))
    params, reference_params = list(model.parameters()), list(reference.parameters())

    def call(i: int) -> None:
        for p in params:
            p.grad = None
        layer(inputs[i % INPUTS]).backward(seed)

    def check(i: int) -> float:
        x = inputs[i % INPUTS]
        for p, q in zip(params, reference_params):
            p.grad, q.grad = None, None
        out = layer(x)
        out.backward(seed)
        expected = reference(x)
        expected.backward(seed)
        return max([max_abs_diff(out, expected)] +
                   [max_abs_diff(p.grad, q.grad) for p, q in zip(params, reference_params)])

    def replay_count() -> int:
        stats = graphed.graph_stats(layer)
        return stats["forward_replays"] + stats["backward_replays"]

    calls = (replays + 1) // 2
    record = soak(call, check, calls=calls, warmup_calls=max(calls // 20, 10),
                  replays=replay_count)
    record["eager_calls"] = graphed.graph_stats(layer)["eager_calls"]
    return record


def soak_train_step(replays: int) -> Dict[str, Any]:
    """At each sampled step a twin model and optimizer take the graphed ones'
    weights and state, take one eager step on the same batch, and the
    parameters are compared after both steps."""
    model = mlp()
    twin = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    twin_optimizer = graphed.make_capturable(torch.optim.AdamW(twin.parameters(), lr=1e-4))
    targets = random_inputs(INPUTS, seed=2)
    data = list(zip(random_inputs(INPUTS), targets))
    step = graphed.TrainStep.from_parts(model, optimizer, nn.functional.mse_loss, data[0])
    params, twin_params = list(model.parameters()), list(twin.parameters())

    def call(i: int) -> None:
        step(data[i % INPUTS])

    def check(i: int) -> float:
        x, y = data[i % INPUTS]
        with torch.no_grad():
            for p, q in zip(params, twin_params):
                q.copy_(p)
                twin_state = twin_optimizer.state[q]
                for key, value in optimizer.state[p].items():
                    if isinstance(value, torch.Tensor) and key in twin_state:
                        twin_state[key].copy_(value)
                    else:
                        twin_state[key] = value.clone() if isinstance(value, torch.Tensor) \
                            else value
        twin_optimizer.zero_grad(set_to_none=True)
        expected = nn.functional.mse_loss(twin(x), y)
        expected.backward()
        twin_optimizer.step()
        loss = step((x, y))
        return max([max_abs_diff(loss, expected.detach())] +
                   [max_abs_diff(p, q) for p, q in zip(params, twin_params)])

    record = soak(call, check, calls=replays, warmup_calls=max(replays // 20, 10),
                  replays=lambda: step.stats()["steps"])
    step.release()
    return record


def auto_inputs() -> Dict[int, List[torch.Tensor]]:
    """Per bucket, inputs of two sizes it covers (one padded, one exact)."""
    return {bucket: [random_inputs(1, rows=rows, seed=bucket + rows)[0]
                     for rows in (bucket - 3, bucket)] for bucket in BUCKETS}


def auto_phase_inputs(inputs: Dict[int, List[torch.Tensor]], phase: int) -> List[torch.Tensor]:
    """The inputs of a phase: those of two of the three buckets, rotating."""
    first, second = BUCKETS[phase % 3], BUCKETS[(phase + 1) % 3]
    return [x for pair in zip(inputs[first], inputs[second]) for x in pair]


def soak_auto(replays: int) -> Dict[str, Any]:
    """graphed.auto on the MLP's blocks with buckets {0: [8, 16, 32]}. Calls
    run in phases that each use two of the three buckets. A probe with no
    budget runs one cycle of phases to measure the graphs' memory; the soak
    runs with a budget one byte below it, so graphs are evicted and
    captured again when the working set moves on."""
    reference = mlp().eval()
    inputs = auto_inputs()
    calls = max(replays // DEPTH, 30)
    phase_calls = max(calls // AUTO_PHASES, 10)
    buckets = {0: list(BUCKETS)}

    with torch.no_grad():
        probe = graphed.auto(copy.deepcopy(reference), warmup=1, buckets=buckets)
        for phase in range(3):
            for x in auto_phase_inputs(inputs, phase) * 2:
                probe(x)
        budget = probe.stats()["graph_memory_bytes"] - 1
        del probe
        settle()
        torch.cuda.empty_cache()

        model = graphed.auto(copy.deepcopy(reference), warmup=1, buckets=buckets,
                             memory_budget=budget)
        watched = {"graphs_max": 0, "graph_memory_max_bytes": 0}

        def current(i: int) -> torch.Tensor:
            chosen = auto_phase_inputs(inputs, i // phase_calls)
            return chosen[i % len(chosen)]

        def on_call(i: int) -> None:
            if i % phase_calls == 0:
                stats = model.stats()
                watched["graphs_max"] = max(watched["graphs_max"], stats["graphs"])
                watched["graph_memory_max_bytes"] = max(watched["graph_memory_max_bytes"],
                                                        stats["graph_memory_bytes"])

        def call(i: int) -> None:
            model(current(i))

        def check(i: int) -> float:
            x = current(i)
            return max_abs_diff(model(x), reference(x))

        record = soak(call, check, calls=calls, warmup_calls=3 * phase_calls,
                      replays=lambda: model.stats()["replays"], on_call=on_call)
    stats = model.stats()
    record.update(
        memory_budget_bytes=budget,
        evictions=stats["evictions"],
        captures=stats["captures"],
        graphs=stats["graphs"],
        graphs_max=max(watched["graphs_max"], stats["graphs"]),
        graph_memory_max_bytes=max(watched["graph_memory_max_bytes"],
                                   stats["graph_memory_bytes"]),
        fallback_calls=stats["fallback_calls"],
    )
    record["within_budget"] = record["graph_memory_max_bytes"] <= budget
    record["ok"] = bool(record["ok"] and record["within_budget"] and stats["evictions"] > 0
                        and stats["fallback_calls"] == 0)
    return record


APIS = {
    "capture": lambda n: soak_capture(n, "copy"),
    "capture_repoint": lambda n: soak_capture(n, "repoint"),
    "make_graphed_callables": soak_make_graphed_callables,
    "train_step": soak_train_step,
    "auto": soak_auto,
}


def run(quick: bool = False) -> Dict[str, Any]:
    replays = QUICK_REPLAYS if quick else REPLAYS
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results: Dict[str, Any] = {}
    try:
        for name, soak_api in APIS.items():
            print(f"bench: soak: {name} ({replays} replays)", flush=True)
            try:
                results[name] = soak_api(replays)
            except Exception:  # one broken API must not hide the others
                results[name] = {"error": traceback.format_exc(), "ok": False}
                traceback.print_exc()
            print(f"bench: soak: {name}: {results[name]}", flush=True)
            settle()
            torch.cuda.empty_cache()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    return {
        "description": __doc__.split("\n\n")[0].strip().replace("\n", " "),
        "replays_per_api": replays,
        "growth_limit_mb": GROWTH_LIMIT_MB,
        "diff_limit": DIFF_LIMIT,
        "apis": results,
        "ok": all(r.get("ok", False) for r in results.values()),
    }


def markdown(workload: Dict[str, Any]) -> List[str]:
    """Table rows of a soak record for bench/run.py and scripts/gpu_check_summary.py."""
    lines = ["| api | replays | us/replay | allocated growth MB | reserved growth MB | "
             "max diff vs eager | ok |", "|---|---:|---:|---:|---:|---:|---|"]
    for api, r in workload["apis"].items():
        if "error" in r:
            lines.append(f"| {api} | FAILED: {r['error'].splitlines()[-1]} | | | | | no |")
            continue
        extra = ""
        if "evictions" in r:
            extra = (f" (evictions {r['evictions']}, graphs max {r['graphs_max']}, "
                     f"within budget {r['within_budget']})")
        lines.append(f"| {api}{extra} | {r['replays']} | {r['us_per_replay']:.2f} | "
                     f"{r['allocated_growth_mb']:.3f} | {r['reserved_growth_mb']:.3f} | "
                     f"{r['max_abs_diff_vs_eager']:.2e} | {'yes' if r['ok'] else 'NO'} |")
    return lines
