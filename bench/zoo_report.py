"""The markdown tables of the zoo workload (bench/zoo.py), without importing
graphed or torch: scripts/gpu_check_summary.py formats results with it."""

from __future__ import annotations

from typing import Any, Dict


def markdown(zoo: Dict[str, Any]) -> str:
    def ms(record, key):
        value = record.get(key)
        return f"{value:.2f}" if isinstance(value, (int, float)) else "-"

    lines = ["### zoo: training step (ms; speedup over eager)", "",
             "| model | eager | TrainStep | auto | optimize (applied) | advise predicted | "
             "auto fallbacks | check findings |", "|---|---:|---:|---:|---|---:|---:|---:|"]
    for name, r in zoo["models"].items():
        if "error" in r and "eager_ms" not in r:
            lines.append(f"| {name} | error | | | | | | |")
            continue
        opt = (f"{ms(r, 'optimize_ms')} ({'yes' if r.get('optimize_applied') else 'no'})")
        lines.append(
            f"| {name} | {ms(r, 'eager_ms')} | {ms(r, 'trainstep_ms')} "
            f"({r.get('trainstep_speedup', '-')}x) | {ms(r, 'auto_ms')} "
            f"({r.get('auto_speedup', '-')}x) | {opt} | {ms(r, 'advise_predicted_ms')} | "
            f"{len(r.get('auto_fallbacks', []))} | {len(r.get('check_findings', []))} |")
    lines += ["", "### zoo: inference (ms per call)", "",
              "| model | eager | capture | cycle 1..64 eager | cycle auto | auto graphs | "
              "auto MB |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in zoo["models"].items():
        lines.append(f"| {name} | {ms(r, 'infer_eager_ms')} | {ms(r, 'infer_capture_ms')} | "
                     f"{ms(r, 'infer_cycle_eager_ms')} | {ms(r, 'infer_cycle_auto_ms')} | "
                     f"{r.get('infer_auto_graphs', '-')} | {ms(r, 'infer_auto_graph_mb')} |")
    usual = {name: r["usual_settings"] for name, r in zoo["models"].items()
             if isinstance(r.get("usual_settings"), dict)}
    if usual:
        lines += ["", "### zoo: the usual step (bf16 autocast, clip 1.0; ms per step)", "",
                  "| model | TrainStep.from_parts | optimize | optimize / TrainStep | "
                  "strategy | max abs diff |", "|---|---:|---:|---:|---|---:|"]
        for name, u in usual.items():
            strategy = u.get("optimize_strategy") if u.get("optimize_applied") else (
                f"not applied: {u.get('optimize_reason', '-')}")
            diff = u.get("optimize_max_abs_diff")
            lines.append(f"| {name} | {ms(u, 'trainstep_ms')} | {ms(u, 'optimize_ms')} | "
                         f"{u.get('optimize_vs_trainstep', '-')} | {strategy} | "
                         f"{'-' if diff is None else f'{diff:.1e}'} |")
    return "\n".join(lines) + "\n"
