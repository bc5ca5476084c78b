"""graphed.auto never costs more than eager (issue 29): a model whose every
block is refused against eager (``all_blocked_ratio``: the blocks go back to
their own forward, Note [A fallback costs nothing]); the host cost of one call
that falls back for its shape (``shape_fallback_us``); and transformers models
nobody here wrote (GPT-2, Llama, BERT, random init from configs) in inference
over a cycle of mixed batch sizes, with buckets ``{0: [1, 2, 4, 8, 16, 32]}``,
with the buckets graphed picks itself (the default) and with one graph per
size (``buckets=None``): time per call, the largest difference from eager,
and the graphs' memory. All side by side in one process, CUDA-event medians.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any, Dict

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import graphed  # noqa: E402
from graphed import measure  # noqa: E402

import zoo_models  # noqa: E402

#: Batch sizes of the inference cycle: 12 calls between 1 and 32.
CYCLE = (1, 2, 3, 5, 7, 8, 12, 16, 20, 24, 28, 32)
BUCKETS = {0: [1, 2, 4, 8, 16, 32]}
MODELS = ("hf_gpt2", "hf_llama", "hf_bert")


class RefusedBlock(nn.Module):
    """A block graphed.check refuses: it reads a device value on the host."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc(self.norm(x)))
        if h.abs().max().item() > 1e6:  # a host read: never capturable
            h = h.clamp(-1e6, 1e6)
        return x + h


def all_blocked(iters: int, repeats: int) -> Dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(*(RefusedBlock(256) for _ in range(12))).cuda().eval()
    managed = graphed.auto(copy.deepcopy(model))
    x = torch.randn(32, 256, device="cuda")
    with torch.no_grad():
        for _ in range(6):  # warm-up: each block found blocked, then its own forward back
            managed(x)
        times = measure.compare_ms({"eager": lambda: model(x), "auto": lambda: managed(x)},
                                   iters=iters, repeats=repeats)
    stats = managed.stats()
    return {"eager_ms": round(times["eager"], 4), "auto_ms": round(times["auto"], 4),
            "all_blocked_ratio": round(times["auto"] / times["eager"], 4),
            "blocks_on_own_forward": sum(1 for m in stats["modules"].values()
                                         if m.get("own_forward"))}


def shape_fallback(iters: int, repeats: int) -> Dict[str, Any]:
    torch.manual_seed(0)
    layer = nn.Linear(64, 64).cuda().eval()
    holder = nn.Sequential(copy.deepcopy(layer))
    managed = graphed.auto(holder, modules=["0"], buckets={0: [1, 2, 4, 8]}, warmup=1)
    x = torch.randn(16, 64, device="cuda")  # above the largest bucket: every call falls back
    with torch.no_grad():
        managed(x)
        times = measure.compare_ms({"eager": lambda: holder[0].__class__.forward(holder[0], x),
                                    "fallback": lambda: holder[0](x)},
                                   iters=iters * 20, repeats=repeats)
    stats = managed.stats()
    return {"eager_us": round(times["eager"] * 1000, 2),
            "fallback_us": round(times["fallback"] * 1000, 2),
            "shape_fallback_us": round((times["fallback"] - times["eager"]) * 1000, 2),
            "fallback_calls": stats["fallback_calls"]}


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]


def hf_model(name: str, iters: int, repeats: int) -> Dict[str, Any]:
    entry = zoo_models.build(name, "bench")
    model = copy.deepcopy(entry.model).eval()
    cycle = [entry.inference_inputs(b) for b in CYCLE]
    row: Dict[str, Any] = {}

    def run_cycle(m):
        def run():
            for a, k in cycle:
                m(*a, **k)
        return run

    variants = {"buckets": BUCKETS, "auto_buckets": "auto", "without_buckets": None}
    managed = {}
    with torch.no_grad():
        expected = [_logits(model(*a, **k)).clone() for a, k in cycle]
        for variant, buckets in variants.items():
            m = graphed.auto(copy.deepcopy(entry.model).eval(), buckets=buckets)
            for _ in range(5):  # warm-up (3 calls per block), captures, picked buckets
                run_cycle(m)()
            diff = max((_logits(m(*a, **k)).float() - e.float()).abs().max().item()
                       for (a, k), e in zip(cycle, expected))
            stats = m.stats()
            managed[variant] = m
            row[variant] = {"max_abs_diff": diff, "graphs": stats["graphs"],
                            "graph_mb": round(stats["graph_memory_bytes"] / 2**20, 2),
                            "fallbacks": [f"{f['module']}: {f['reason'][:160]} (x{f['count']})"
                                          for f in stats["fallbacks"]][:3],
                            "notes": stats["notes"][:2]}
        times = measure.compare_ms({"eager": run_cycle(model),
                                    **{v: run_cycle(m) for v, m in managed.items()}},
                                   iters=iters, repeats=repeats)
    for variant in variants:
        row[variant]["cycle_ms"] = round(times[variant], 4)
    b = row["buckets"]
    # TF32 (on above, as users serve) lets kernels picked for another row
    # count round differently; with it off the bucketed graphs are exact.
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            exact = [_logits(model(*a, **k)).clone() for a, k in cycle]
            m = graphed.auto(copy.deepcopy(entry.model).eval(), buckets=BUCKETS)
            for _ in range(4):
                run_cycle(m)()
            diff_fp32 = max((_logits(m(*a, **k)).float() - e.float()).abs().max().item()
                            for (a, k), e in zip(cycle, exact))
            del m
    finally:
        torch.backends.cuda.matmul.allow_tf32 = True
    return {
        "eager_cycle_ms": round(times["eager"], 4),
        "auto_cycle_ms": b["cycle_ms"],
        "speedup": round(times["eager"] / b["cycle_ms"], 2),
        "max_abs_diff": b["max_abs_diff"],
        "max_abs_diff_without_tf32": diff_fp32,
        "graph_mb": b["graph_mb"],
        "graph_mb_without_buckets": row["without_buckets"]["graph_mb"],
        "graph_mb_auto_buckets": row["auto_buckets"]["graph_mb"],
        "memory_ratio": round(b["graph_mb"] / max(row["without_buckets"]["graph_mb"], 1e-9), 3),
        "variants": row,
        "description": entry.description,
    }


def run(quick: bool = False) -> Dict[str, Any]:
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    iters, repeats = (3, 3) if quick else (10, 7)
    result: Dict[str, Any] = {"description": __doc__.split("\n\n")[0].replace("\n", " "),
                              "cycle": list(CYCLE), "buckets": BUCKETS}
    result.update(all_blocked(iters * 5, repeats))
    result.update(shape_fallback(iters, repeats))
    for name in MODELS:
        print(f"auto_overhead: {name}", flush=True)
        try:
            result[name] = hf_model(name, iters, repeats)
        except Exception as error:  # one model's failure must not hide the others
            import traceback
            result[name] = {"error": traceback.format_exc()}
            print(error, flush=True)
        torch.cuda.empty_cache()
    return result


def markdown(result: Dict[str, Any]) -> list:
    lines = [f"### auto_overhead\n",
             f"all blocks refused: auto {result['auto_ms']} ms, eager {result['eager_ms']} ms, "
             f"ratio {result['all_blocked_ratio']} ({result['blocks_on_own_forward']} blocks on "
             f"their own forward); one shape fallback: {result['shape_fallback_us']} us over "
             f"eager's {result['eager_us']} us\n",
             "| model | eager cycle ms | auto (buckets) ms | x eager | max abs diff (TF32) "
             "| max abs diff (fp32) | graph MB | MB picked buckets | MB without buckets "
             "| MB ratio |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in MODELS:
        r = result.get(name)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"| {name} | FAILED: {r['error'].strip().splitlines()[-1]} |||||||||")
            continue
        lines.append(f"| {name} | {r['eager_cycle_ms']} | {r['auto_cycle_ms']} | {r['speedup']} "
                     f"| {r['max_abs_diff']:.2e} | {r.get('max_abs_diff_without_tf32', float('nan')):.2e} "
                     f"| {r['graph_mb']} | {r['graph_mb_auto_buckets']} "
                     f"| {r['graph_mb_without_buckets']} | {r['memory_ratio']} |")
    lines.append("")
    return lines
