"""The gpt_train workload of DESIGN.md: eager; PyTorch's hand-written
full-iteration capture (capturable AdamW, as in the DESIGN.md anchor);
graphed.TrainStep; and graphed.TrainStep around the model compiled by
torch.compile without its cudagraphs. Every method trains its own copy of the
same initial model."""

from __future__ import annotations

import copy
from typing import Any, Dict

import torch

import graphed
from graphed import measure, workloads

from harness import Method, workload_record, prepare, time_methods, torch_capture

COMPILE_MODE_WITHOUT_GRAPHS = "default"
LR = 1e-4


def eager_step(model, tokens, targets):
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def step():
        optimizer.zero_grad(set_to_none=False)
        loss = workloads.gpt_loss(model(tokens), targets)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def torch_full_graph(model, tokens, targets):
    """The hand-written whole-iteration capture PyTorch's documentation shows."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, capturable=True)
    static_tokens, static_targets = tokens.clone(), targets.clone()

    def iteration():
        optimizer.zero_grad(set_to_none=False)
        loss = workloads.gpt_loss(model(static_tokens), static_targets)
        loss.backward()
        optimizer.step()
        return loss

    graph, static_loss = torch_capture(iteration)

    def step():
        # The graph reads the model's and optimizer's memory: keep them alive
        # (a hand-written capture must; graphed.TrainStep holds its function).
        _ = (model, optimizer)
        static_tokens.copy_(tokens)
        static_targets.copy_(targets)
        graph.replay()
        return static_loss.detach().clone()

    return step


def mgc_step(base, tokens, targets, *, graphed_impl: bool, per_layer: bool):
    """make_graphed_callables on the whole model or on each block, optimizer
    eager: PyTorch's (torch.cuda) or graphed's, set up identically."""
    model = copy.deepcopy(base)
    make = graphed.make_graphed_callables if graphed_impl else torch.cuda.make_graphed_callables
    if per_layer:
        hidden = model.position.shape[1]
        sample = torch.randn(tokens.shape[0], tokens.shape[1], hidden, device=tokens.device,
                             requires_grad=True)
        blocks = tuple(model.blocks)
        make(blocks, tuple((sample.clone().detach().requires_grad_(True),) for _ in blocks))
    else:
        make(model, (tokens.clone(),))
    return eager_step(model, tokens, targets)


def run(quick: bool = False) -> Dict[str, Any]:
    workloads.configure_numerics()
    base, tokens, targets = workloads.gpt_train()
    iters, repeats = (5, 3) if quick else (20, 7)

    eager_model = copy.deepcopy(base)
    first_loss = eager_step(copy.deepcopy(base), tokens, targets)()

    def graphed_trainstep(compiled: bool):
        def setup():
            model = copy.deepcopy(base)
            forward = torch.compile(model, mode=COMPILE_MODE_WITHOUT_GRAPHS) if compiled else model
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
            train = graphed.TrainStep.from_parts(forward, optimizer, workloads.gpt_loss,
                                                 (tokens, targets))
            name = "graphed_trainstep_compiled" if compiled else "graphed_trainstep"
            methods[name].record["kernels"] = train.stats()["kernels"]
            if compiled:
                methods[name].record["compile_mode"] = COMPILE_MODE_WITHOUT_GRAPHS
            return lambda: train((tokens, targets))
        return setup

    methods = {
        "eager": Method("eager", lambda: eager_step(eager_model, tokens, targets)),
        "torch_full_graph": Method("torch_full_graph",
                                   lambda: torch_full_graph(copy.deepcopy(base), tokens, targets),
                                   True),
        "graphed_trainstep": Method("graphed_trainstep", graphed_trainstep(False), True),
        # make_graphed_callables, optimizer eager (the side-by-side set).
        "torch_mgc_model": Method("torch_mgc_model", lambda: mgc_step(
            base, tokens, targets, graphed_impl=False, per_layer=False), True),
        "graphed_mgc_model": Method("graphed_mgc_model", lambda: mgc_step(
            base, tokens, targets, graphed_impl=True, per_layer=False), True),
        "torch_mgc_layers": Method("torch_mgc_layers", lambda: mgc_step(
            base, tokens, targets, graphed_impl=False, per_layer=True), True),
        "graphed_mgc_layers": Method("graphed_mgc_layers", lambda: mgc_step(
            base, tokens, targets, graphed_impl=True, per_layer=True), True),
        "graphed_trainstep_compiled": Method("graphed_trainstep_compiled",
                                             graphed_trainstep(True), True),
    }
    for method in methods.values():
        print(f"bench: gpt_train: {method.name}", flush=True)
        prepare(method)
        loss = method.run()
        method.record["first_loss_diff_vs_eager"] = abs(loss.item() - first_loss.item())
    time_methods(methods, iters=iters, repeats=repeats)
    floor_ms, activities = measure.kernel_floor_ms(eager_step(copy.deepcopy(base), tokens, targets))

    return workload_record(methods, floor_ms, activities, workloads.GPT_TRAIN_DESCRIPTION)


# graphed.auto (issue 6): per-block forward and backward graphs, captured
# together in the recorded order, with the optimizer eager. "fallbacks" lists
# the blocks that run eagerly (block 3 of gpt_train_blocker) with the reason.

def auto_step(model, tokens, targets, record: Dict[str, Any], warmup_steps: int = 4):
    managed = graphed.auto(model, warmup=3)
    step = eager_step(managed, tokens, targets)
    for _ in range(warmup_steps):  # warm-up calls, then the step that captures
        step()
    torch.cuda.synchronize()
    stats = managed.stats()
    record["captures"] = stats["captures"]
    record["auto_capture_ms"] = round(stats["capture_ms"], 2)
    record["fallback_calls_during_setup"] = stats["fallback_calls"]
    record["fallbacks"] = [{k: f[k] for k in ("module", "reason")} for f in stats["fallbacks"]]
    return step


def _eager_vs_auto(base, tokens, targets, label: str, quick: bool) -> Dict[str, Method]:
    """Eager and graphed.auto (optimizer eager) on copies of ``base``, timed side by side."""
    methods = {
        "eager": Method("eager", lambda: eager_step(copy.deepcopy(base), tokens, targets)),
        "graphed_auto": Method("graphed_auto", lambda: auto_step(
            copy.deepcopy(base), tokens, targets, methods["graphed_auto"].record), True),
    }
    for method in methods.values():
        print(f"bench: {label}: {method.name}", flush=True)
        prepare(method)
    iters, repeats = (5, 3) if quick else (20, 7)
    time_methods(methods, iters=iters, repeats=repeats)
    return methods


def run_with_auto(quick: bool = False) -> Dict[str, Any]:
    """gpt_train: run() plus graphed.auto, timed against an eager run of its own
    (auto's warm-up steps update the weights, so it cannot share run()'s first-loss check)."""
    result = run(quick)
    workloads.configure_numerics()
    base, tokens, targets = workloads.gpt_train()
    methods = _eager_vs_auto(base, tokens, targets, "gpt_train (auto comparison)", quick)
    auto = dict(methods["graphed_auto"].record)
    auto["speedup_vs_eager"] = round(methods["eager"].record["ms"] / auto["ms"], 3)
    auto["ratio_to_floor"] = round(auto["ms"] / result["kernel_floor_ms"], 3)
    auto["eager_ms_side_by_side"] = methods["eager"].record["ms"]
    result["methods"]["graphed_auto"] = auto
    return result


def run_blocker(quick: bool = False) -> Dict[str, Any]:
    """gpt_train_blocker: the GPT with a .item() in block 3, eager vs graphed.auto
    (block 3 falls back to eager; the other blocks stay graphed)."""
    workloads.configure_numerics()
    base, tokens, targets = workloads.gpt_train_blocker()
    methods = _eager_vs_auto(base, tokens, targets, "gpt_train_blocker", quick)
    floor_ms, activities = measure.kernel_floor_ms(eager_step(copy.deepcopy(base), tokens, targets))
    return workload_record(methods, floor_ms, activities,
                           workloads.GPT_TRAIN_BLOCKER_DESCRIPTION)
