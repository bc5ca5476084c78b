"""The hf_decode table (bench/hf_decode.py's record), without importing graphed
or torch, for bench/run.py and scripts/gpu_check_summary.py."""

from __future__ import annotations

from typing import Any, Dict, List


def markdown(record: Dict[str, Any]) -> List[str]:
    """Rows per path and batch: ms per token, the ratio to the decode step's
    kernel time (and, for a compiled step, to that step's own kernel time), the
    speedup over HF's DynamicCache generate, and whether the tokens equal HF's
    static-cache tokens (else the fraction that do); a failed path shows its
    error."""
    floors = record.get("kernel_floor_ms", {})
    lines = [f"### hf_decode ({record.get('model', '')}, {record.get('new_tokens')} new tokens; "
             "ms per token)\n",
             "| path | batch | ms/token | x kernel floor | x own step's floor | x HF dynamic | "
             "same tokens | capture s |",
             "|---|---:|---:|---:|---:|---:|---|---:|"]
    for name, row in record.get("methods", {}).items():
        path, _, batch = name.rpartition("_b")
        if "error" in row:
            lines.append(f"| {path} | {batch} | failed: {row['error'][:120]} | | | | | |")
            continue
        if "ms" not in row:
            continue
        floor = floors.get(batch)
        dynamic = record["methods"].get(f"hf_eager_dynamic_b{batch}", {}).get("ms")
        ratio = f"{row['ms'] / floor:.2f}" if floor else ""
        speedup = f"{dynamic / row['ms']:.2f}" if dynamic else ""
        own = f"{row['ratio_to_own_floor']:.2f}" if "ratio_to_own_floor" in row else ""
        same = "" if "same_tokens_as_hf_static" not in row else str(row["same_tokens_as_hf_static"])
        if same == "False" and "new_tokens_equal_to_hf_static" in row:
            same = f"{row['new_tokens_equal_to_hf_static']:.1%} of new tokens"
        capture = "" if "capture_s" not in row else f"{row['capture_s']:.3f}"
        if "compile_s" in row:
            capture += f" (+{row['compile_s']:.1f} compile)"
        lines.append(f"| {path} | {batch} | {row['ms']:.4f} | {ratio} | {own} | {speedup} | "
                     f"{same} | {capture} |")
    lines.append("")
    lines.append("kernel floor (ms per decode step): " +
                 ", ".join(f"b{b} {ms}" for b, ms in floors.items()))
    return lines
