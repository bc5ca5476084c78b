"""Workload gpt_fp8 (issue 17): the gpt_train model at d=2048, 16 heads, 8
layers, context 512, batch 8x512 tokens, fused AdamW with fp32 master weights,
bf16 autocast; against the same model with its Linear layers in FP8
(graphed.fp8: e4m3 forward, e5m2 gradients, delayed scaling), eager and
graphed (TrainStep.from_parts). Weight-cast caching is measured with
microbatches=4, cached against uncached. torchao's float8 training
(convert_to_float8_training, tensor-wise dynamic scaling) is the anchor, eager
and torch.compile'd, where a torchao wheel is importable (a missing one is an
`error` row). final_loss_rel_diff: FP8 against bf16, both graphed, after 200
steps on a fixed synthetic corpus of 200 distinct batches from a sparse Markov
chain (see corpus())."""

from __future__ import annotations

import copy
import math
import traceback
from typing import Any, Callable, Dict, List, Tuple

import torch

import graphed
from graphed import workloads

from harness import Method, prepare, time_methods

VOCAB, CONTEXT, WIDTH, DEPTH, HEADS = 4096, 512, 2048, 8, 16
BATCH = 8
LR = 3e-4
# The loss runs' schedule: linear warm-up to PEAK_LR, cosine decay to a tenth
# of it at the last step, so that both runs end settled rather than mid-descent
# (where a small difference in the rate of descent reads as a large one).
PEAK_LR, WARMUP_STEPS = 6e-4, 20
LOSS_STEPS = 200
CORPUS_BATCHES = LOSS_STEPS
DESCRIPTION = (f"gpt_fp8: GPT (vocab {VOCAB}, {DEPTH} pre-LN blocks, d={WIDTH}, {HEADS} heads, "
               f"context {CONTEXT}), batch {BATCH}x{CONTEXT} tokens, cross-entropy, fused "
               f"AdamW(lr={LR}), fp32 master weights, bf16 autocast; FP8 = graphed.fp8 "
               f"(e4m3 forward, e5m2 gradients, delayed scaling)")


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return workloads.GPT(vocab=VOCAB, context=CONTEXT, width=WIDTH, depth=DEPTH,
                         heads=HEADS).cuda()


def corpus(batches: int = CORPUS_BATCHES) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Fixed token batches from a Markov chain in which each token has 4
    successors: the best possible loss is ln 4 (1.386), the uniform one ln 4096
    (8.3). Every batch is distinct and the loss run sees each once, so its loss
    measures how well the model learns the chain, not how well it memorizes a
    few batches (a memorized corpus drives the loss toward 0, where relative
    differences mean little)."""
    generator = torch.Generator(device="cuda").manual_seed(1234)
    successors = torch.randint(0, VOCAB, (VOCAB, 4), device="cuda", generator=generator)
    rows = batches * BATCH
    sequence = torch.empty(rows, CONTEXT + 1, dtype=torch.long, device="cuda")
    sequence[:, 0] = torch.randint(0, VOCAB, (rows,), device="cuda", generator=generator)
    choice = torch.randint(0, 4, (rows, CONTEXT), device="cuda", generator=generator)
    for t in range(CONTEXT):
        sequence[:, t + 1] = successors[sequence[:, t], choice[:, t]]
    return [(sequence[i * BATCH:(i + 1) * BATCH, :-1].contiguous(),
             sequence[i * BATCH:(i + 1) * BATCH, 1:].contiguous()) for i in range(batches)]


def _optimizer(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(net.parameters(), lr=LR, fused=True)


def eager_step(net: torch.nn.Module, fp8: bool) -> Callable[[Tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    optimizer = _optimizer(net)

    def step(batch):
        tokens, targets = batch
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            loss = workloads.gpt_loss(net(tokens), targets)
        loss.float().backward()
        if fp8:
            graphed.fp8.update_scales(net)
        optimizer.step()
        return loss.detach()

    return step


def graphed_step(net: torch.nn.Module, sample, microbatches: int = 1):
    train = graphed.TrainStep.from_parts(net, _optimizer(net), workloads.gpt_loss, sample,
                                         amp="bf16", microbatches=microbatches)
    return lambda batch: train(batch)


def fp8_model(base: torch.nn.Module, **recipe: Any) -> torch.nn.Module:
    net = copy.deepcopy(base)
    graphed.fp8.convert(net, graphed.fp8.Recipe(**recipe))
    return net


def torchao_model(base: torch.nn.Module) -> torch.nn.Module:
    from torchao.float8 import convert_to_float8_training

    net = copy.deepcopy(base)
    convert_to_float8_training(net)
    return net


def _lr_factor(step: int, steps: int) -> float:
    if step < WARMUP_STEPS:
        return (step + 1) / WARMUP_STEPS
    progress = min(1.0, (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS))
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


def _losses(net: torch.nn.Module, batches, steps: int) -> List[float]:
    """Graphed training for `steps` steps, one batch each, on the schedule above."""
    optimizer = torch.optim.AdamW(net.parameters(), lr=PEAK_LR, fused=True)
    train = graphed.TrainStep.from_parts(net, optimizer, workloads.gpt_loss, batches[0],
                                         amp="bf16")
    # After from_parts: the rate is a device tensor the scheduler fills in place.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: _lr_factor(i, steps))
    losses = []
    for i in range(steps):
        losses.append(train(batches[i % len(batches)]))
        schedule.step()
    return [loss.item() for loss in losses]


def run(quick: bool = False) -> Dict[str, Any]:
    workloads.configure_numerics()
    base = model()
    batches = corpus(20 if quick else CORPUS_BATCHES)
    batch = batches[0]
    iters, repeats = (3, 3) if quick else (10, 5)
    record: Dict[str, Any] = {"description": DESCRIPTION, "methods": {}}
    errors: Dict[str, Any] = {}

    def method(name: str, setup: Callable[[], Callable[[Any], torch.Tensor]], is_graph: bool):
        def prepared():
            step = setup()
            return lambda: step(batch)
        return Method(name, prepared, is_graph)

    candidates = {
        "bf16_eager": method("bf16_eager", lambda: eager_step(copy.deepcopy(base), False), False),
        "bf16_graphed": method("bf16_graphed",
                               lambda: graphed_step(copy.deepcopy(base), batch), True),
        "fp8_eager": method("fp8_eager", lambda: eager_step(fp8_model(base), True), False),
        "fp8_graphed": method("fp8_graphed", lambda: graphed_step(fp8_model(base), batch), True),
        "fp8_graphed_microbatches4": method(
            "fp8_graphed_microbatches4",
            lambda: graphed_step(fp8_model(base), batch, microbatches=4), True),
        "fp8_graphed_uncached_weights": method(
            "fp8_graphed_uncached_weights",
            lambda: graphed_step(fp8_model(base, cache_weights=False), batch, microbatches=4),
            True),
        "torchao_fp8_eager": method("torchao_fp8_eager",
                                    lambda: eager_step(torchao_model(base), False), False),
        "torchao_fp8_compiled": method(
            "torchao_fp8_compiled",
            lambda: eager_step(torch.compile(torchao_model(base)), False), False),
    }
    methods: Dict[str, Method] = {}
    for name, candidate in candidates.items():
        print(f"bench: gpt_fp8: {name}", flush=True)
        try:
            prepare(candidate)
            for _ in range(2):  # eager warm-up; compiles torch.compile's graphs
                candidate.run()
            torch.cuda.synchronize()
            methods[name] = candidate
        except Exception as error:  # a failed path is a result
            errors[name] = {"error": f"{type(error).__name__}: {error}"[-1500:],
                            "traceback": traceback.format_exc()[-1500:]}
            torch.cuda.empty_cache()
    time_methods(methods, iters=iters, repeats=repeats)
    for name, m in methods.items():
        record["methods"][name] = dict(m.record)
    record["methods"].update(errors)
    del methods, candidates
    torch.cuda.empty_cache()

    # Loss over LOSS_STEPS steps, bf16 against FP8, both graphed, same corpus;
    # and bf16 from another initialization, for the size of run-to-run noise.
    steps = 20 if quick else LOSS_STEPS
    tail = max(1, steps // 20)

    def final(losses: List[float]) -> float:
        return sum(losses[-tail:]) / tail

    bf16 = _losses(copy.deepcopy(base), batches, steps)
    torch.cuda.empty_cache()
    fp8 = _losses(fp8_model(base), batches, steps)
    torch.cuda.empty_cache()
    reseeded = _losses(model(seed=1), batches, steps)
    torch.cuda.empty_cache()
    bf16_end, fp8_end, reseeded_end = final(bf16), final(fp8), final(reseeded)
    record["losses"] = {"steps": steps, "schedule": f"linear warm-up to {PEAK_LR} over "
                        f"{WARMUP_STEPS} steps, cosine to {PEAK_LR / 10:g} at step {steps}",
                        "bf16_first": bf16[0], "fp8_first": fp8[0],
                        "bf16_final": round(bf16_end, 5), "fp8_final": round(fp8_end, 5),
                        "bf16_other_init_final": round(reseeded_end, 5),
                        "final_over_last_steps": tail}
    record["final_loss_rel_diff"] = round(abs(fp8_end - bf16_end) / bf16_end, 6)
    record["bf16_other_init_rel_diff"] = round(abs(reseeded_end - bf16_end) / bf16_end, 6)
    ms = {name: row.get("ms") for name, row in record["methods"].items()}
    if ms.get("fp8_graphed") and ms.get("bf16_graphed"):
        record["fp8_graphed_speedup_vs_bf16_graphed"] = round(ms["bf16_graphed"] / ms["fp8_graphed"], 3)
    if ms.get("fp8_graphed_uncached_weights") and ms.get("fp8_graphed_microbatches4"):
        record["weight_cache_speedup_microbatches4"] = round(
            ms["fp8_graphed_uncached_weights"] / ms["fp8_graphed_microbatches4"], 3)
    return record


def markdown(record: Dict[str, Any]) -> List[str]:
    lines = [f"### gpt_fp8 ({record['description']})", "",
             "| method | ms/step | x bf16_graphed | note |", "|---|---:|---:|---|"]
    base = record["methods"].get("bf16_graphed", {}).get("ms")
    for name, row in record["methods"].items():
        if "ms" in row:
            ratio = f"{base / row['ms']:.3f}" if base else ""
            lines.append(f"| {name} | {row['ms']:.3f} | {ratio} | |")
        else:
            lines.append(f"| {name} | failed | | {row.get('error', '')[:120]} |")
    losses = record.get("losses", {})
    lines += ["", f"loss after {losses.get('steps')} steps ({losses.get('schedule')}): bf16 "
              f"{losses.get('bf16_final')}, fp8 {losses.get('fp8_final')} (relative difference "
              f"{record.get('final_loss_rel_diff')}); bf16 from another initialization "
              f"{losses.get('bf16_other_init_final')} (relative difference "
              f"{record.get('bf16_other_init_rel_diff')})", ""]
    return lines
