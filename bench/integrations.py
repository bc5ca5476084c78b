"""Workload integrations (issue 15): HF GPT-2 (6 layers, d384, 8x128 tokens,
fused AdamW, use_cache=False, no dropout) trained through PyTorch Lightning's
``Trainer.fit`` and the Hugging Face ``Trainer``, each without graphed and with
it (``graphed.integrations.lightning.CUDAGraphs``,
``graphed.integrations.transformers.GraphedTrainer``), side by side in one
process. Rows: ``methods.lightning_eager``, ``lightning_graphed``,
``hf_trainer_eager``, ``hf_trainer_graphed``, and under DDP at world size 1
(bench/integrations_ddp.py, a torchrun launch) ``hf_trainer_ddp_eager``,
``hf_trainer_ddp_graphed``, ``lightning_ddp_eager``, ``lightning_ddp_graphed``
(with ``world_size``), each with ``ms`` per step; graphed
rows add ``speedup_vs_framework`` and ``loss_rel_diff_vs_eager`` (the largest
relative difference of the per-step losses), and what graphed reported (mode,
fallbacks). A path that fails records ``error``."""

from __future__ import annotations

from typing import Any, Dict

import integrations_ddp
import integrations_hf
import integrations_lightning


_attempt = integrations_ddp._attempt  # a failed path is a result, the same way


def _lightning(graphed: bool, quick: bool) -> Dict[str, Any]:
    steps, warmup, repeats = (12, 5, 3) if quick else (60, 10, 5)
    row = integrations_lightning.lightning_step_ms(graphed, steps=steps, warmup=warmup,
                                                   repeats=repeats)
    out = {"ms": round(row["ms_per_step"], 4), "steps": row["steps"], "losses": row["losses"]}
    if graphed:
        report = row.get("report") or {}
        out["report"] = {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v))
                         for k, v in dict(report).items()}
    return out


def _hf(graphed: bool, quick: bool) -> Dict[str, Any]:
    row = integrations_hf.hf_trainer_step_ms(graphed, steps=60, quick=quick)
    out = {"ms": row["ms"], "steps": row["steps"], "losses": row["losses"]}
    if graphed:
        out.update(mode=row["mode"], fallbacks=row["fallbacks"], notes=row["notes"],
                   graphed_steps=row.get("graphed_steps"), capture_ms=row.get("capture_ms"))
    return out


def _compare(methods: Dict[str, Any], eager: str, graphed: str) -> None:
    a, b = methods[eager], methods[graphed]
    if "ms" in a and "ms" in b:
        b["speedup_vs_framework"] = round(a["ms"] / b["ms"], 3)
        n = min(len(a["losses"]), len(b["losses"]))
        if n:
            b["loss_rel_diff_vs_eager"] = max(abs(x - y) / max(abs(x), 1e-12)
                                              for x, y in zip(a["losses"][:n], b["losses"][:n]))
            b["bit_equal_losses"] = a["losses"][:n] == b["losses"][:n]
    for row in (a, b):
        row["losses"] = row.get("losses", [])[:20]  # the first 20, for the record


def run(quick: bool = False) -> Dict[str, Any]:
    methods: Dict[str, Any] = {}
    methods["lightning_eager"] = _attempt(lambda: _lightning(False, quick))
    methods["lightning_graphed"] = _attempt(lambda: _lightning(True, quick))
    _compare(methods, "lightning_eager", "lightning_graphed")
    methods["hf_trainer_eager"] = _attempt(lambda: _hf(False, quick))
    methods["hf_trainer_graphed"] = _attempt(lambda: _hf(True, quick))
    _compare(methods, "hf_trainer_eager", "hf_trainer_graphed")
    # DDP at world size 1 (issue 25), in a torchrun launch of its own.
    methods.update(integrations_ddp.ddp_rows(quick=quick, world_size=1))
    return {"model": "HF GPT-2 6 layers d384 (6 heads), 8x128 tokens, fused AdamW, no dropout, "
                     "TF32 on in both paths", "methods": methods}


def markdown(record: Dict[str, Any]) -> list:
    """The table of bench/run.py's output."""
    lines = ["### integrations (ms per training step)\n",
             "| method | ms | x framework | loss rel diff | note |", "|---|---:|---:|---:|---|"]
    for name, row in record["methods"].items():
        if "error" in row:
            lines.append(f"| {name} | failed | | | {row['error'][:120]} |")
            continue
        speed = row.get("speedup_vs_framework", "")
        diff = row.get("loss_rel_diff_vs_eager")
        note = row.get("mode") or (row.get("report") or {}).get("active", "")
        lines.append(f"| {name} | {row['ms']:.4f} | {speed} | "
                     f"{'' if diff is None else f'{diff:.2e}'} | {note} |")
    lines.append("")
    return lines
