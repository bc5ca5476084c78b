"""Workload gpt_fp8 (issue 17): the gpt_train model at d=2048, 16 heads, 8
layers, context 512, batch 8x512 tokens, fused AdamW with fp32 master weights,
bf16 autocast; against the same model with its Linear layers in FP8
(graphed.fp8: e4m3 forward, e5m2 gradients, delayed scaling), eager and
graphed (TrainStep.from_parts). Weight-cast caching is measured with
microbatches=4, cached against uncached. torchao's float8 training
(convert_to_float8_training, tensor-wise dynamic scaling) is the anchor, eager
and torch.compile'd, where a torchao wheel is importable (a missing one is an
`error` row). final_loss_rel_diff: FP8 against bf16, both graphed, after 200
steps on a fixed synthetic corpus (a sparse Markov chain, so that the loss
falls well below uniform and the comparison means something)."""

from __future__ import annotations

import copy
import traceback
from typing import Any, Callable, Dict, List, Tuple

import torch

import graphed
from graphed import workloads

from harness import Method, prepare, time_methods

VOCAB, CONTEXT, WIDTH, DEPTH, HEADS = 4096, 512, 2048, 8, 16
BATCH = 8
LR = 3e-4
CORPUS_BATCHES = 16
LOSS_STEPS = 200
DESCRIPTION = (f"gpt_fp8: GPT (vocab {VOCAB}, {DEPTH} pre-LN blocks, d={WIDTH}, {HEADS} heads, "
               f"context {CONTEXT}), batch {BATCH}x{CONTEXT} tokens, cross-entropy, fused "
               f"AdamW(lr={LR}), fp32 master weights, bf16 autocast; FP8 = graphed.fp8 "
               f"(e4m3 forward, e5m2 gradients, delayed scaling)")


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return workloads.GPT(vocab=VOCAB, context=CONTEXT, width=WIDTH, depth=DEPTH,
                         heads=HEADS).cuda()


def corpus(batches: int = CORPUS_BATCHES) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Fixed token batches from a Markov chain in which each token has 4
    successors: the best possible loss is about ln 4, the uniform one ln 4096."""
    generator = torch.Generator(device="cuda").manual_seed(1234)
    successors = torch.randint(0, VOCAB, (VOCAB, 4), device="cuda", generator=generator)
    out = []
    for _ in range(batches):
        sequence = torch.empty(BATCH, CONTEXT + 1, dtype=torch.long, device="cuda")
        sequence[:, 0] = torch.randint(0, VOCAB, (BATCH,), device="cuda", generator=generator)
        choice = torch.randint(0, 4, (BATCH, CONTEXT), device="cuda", generator=generator)
        for t in range(CONTEXT):
            sequence[:, t + 1] = successors[sequence[:, t], choice[:, t]]
        out.append((sequence[:, :-1].contiguous(), sequence[:, 1:].contiguous()))
    return out


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


def _losses(step, batches, steps: int) -> List[float]:
    losses = [step(batches[i % len(batches)]) for i in range(steps)]
    return [loss.item() for loss in losses]


def run(quick: bool = False) -> Dict[str, Any]:
    workloads.configure_numerics()
    base = model()
    batches = corpus(4 if quick else CORPUS_BATCHES)
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

    # Loss over LOSS_STEPS steps, bf16 against FP8, both graphed, same corpus.
    steps = 20 if quick else LOSS_STEPS
    bf16 = _losses(graphed_step(copy.deepcopy(base), batch), batches, steps)
    torch.cuda.empty_cache()
    fp8 = _losses(graphed_step(fp8_model(base), batch), batches, steps)
    tail = max(1, steps // 20)
    bf16_end = sum(bf16[-tail:]) / tail
    fp8_end = sum(fp8[-tail:]) / tail
    record["losses"] = {"steps": steps, "bf16_first": bf16[0], "fp8_first": fp8[0],
                        "bf16_final": round(bf16_end, 5), "fp8_final": round(fp8_end, 5),
                        "final_over_last_steps": tail}
    record["final_loss_rel_diff"] = round(abs(fp8_end - bf16_end) / bf16_end, 6)
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
    lines += ["", f"loss after {losses.get('steps')} steps: bf16 {losses.get('bf16_final')}, "
              f"fp8 {losses.get('fp8_final')} (relative difference "
              f"{record.get('final_loss_rel_diff')})", ""]
    return lines
