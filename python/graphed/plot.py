"""Timelines of GPU busy and idle time, eager against graphed, as a PNG
(matplotlib, Agg backend). Traces are graphed's: {'gpu': [(name, kind,
start_ns, duration_ns)], 'iterations': [(name, start_ns, duration_ns)], ...}."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

Trace = Dict[str, Any]


def _busy(trace: Trace) -> Tuple[List[Tuple[float, float]], float, float, int]:
    """Busy intervals (start_ms, width_ms) from the trace's start, its span in
    ms, the busy share and the iteration count."""
    iterations = trace.get("iterations") or []
    gpu = sorted(trace.get("gpu") or [], key=lambda a: a[2])
    starts = [it[1] for it in iterations] + [a[2] for a in gpu]
    ends = [it[1] + it[2] for it in iterations] + [a[2] + a[3] for a in gpu]
    if not starts:
        return [], 0.0, 0.0, 0
    origin, span_ns = min(starts), max(ends) - min(starts)
    merged: List[List[int]] = []
    for _, _, start, duration in gpu:
        end = start + duration
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    busy_ns = sum(end - start for start, end in merged)
    bars = [((start - origin) / 1e6, (end - start) / 1e6) for start, end in merged]
    return bars, span_ns / 1e6, busy_ns / span_ns if span_ns else 0.0, len(iterations)


def predicted_trace(eager: Trace, per_node_us: float, launch_us: float) -> Trace:
    """The eager trace's activities laid out as a replay would run them: back
    to back, ``per_node_us`` apart, ``launch_us`` before each iteration (Note
    [Predicting the graphed time] in src/advice.cpp)."""
    gpu = sorted(eager.get("gpu") or [], key=lambda a: a[2])
    iterations = sorted(eager.get("iterations") or [], key=lambda it: it[1])
    count = max(len(iterations), 1)
    per_iteration = len(gpu) / count
    t = 0.0
    out_gpu, out_iterations = [], []
    for index, (name, kind, _, duration) in enumerate(gpu):
        if index % max(int(round(per_iteration)), 1) == 0:
            out_iterations.append(("graphed::iteration", int(t), 0))
            t += launch_us * 1e3
        out_gpu.append((name, kind, int(t), duration))
        t += duration + per_node_us * 1e3
    return {"gpu": out_gpu, "iterations": out_iterations, "launches": []}


def timeline_png(path: str, rows: Sequence[Tuple[str, Optional[Trace]]], title: str) -> str:
    """Draws one timeline per ``(label, trace)`` row on a shared time axis and
    writes the PNG to ``path``. Rows without a trace say so. Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(rows), 1, figsize=(12, 1.2 + 1.3 * len(rows)), sharex=True,
                                squeeze=False)
    longest = max((_busy(trace)[1] for _, trace in rows if trace), default=1.0) or 1.0
    for axis, (label, trace) in zip(axes[:, 0], rows):
        axis.set_yticks([])
        axis.set_xlim(0, longest * 1.02)
        axis.set_ylim(0, 1)
        if not trace or not trace.get("gpu"):
            axis.text(0.01, 0.5, f"{label}: no GPU activities recorded", va="center",
                      transform=axis.transAxes)
            continue
        bars, span_ms, busy, iterations = _busy(trace)
        axis.axvspan(0, span_ms, color="#f4c7c3", label="GPU idle")
        axis.broken_barh(bars, (0.15, 0.7), color="#2e7d32", label="GPU busy")
        per_iteration = span_ms / max(iterations, 1)
        axis.set_ylabel(label, rotation=0, ha="right", va="center")
        axis.set_title(f"{label}: {per_iteration:.3f} ms per iteration over {iterations} "
                       f"iterations, GPU busy {100 * busy:.0f}%", fontsize=9, loc="left")
    axes[0, 0].legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("time since the first traced iteration started (ms)")
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
