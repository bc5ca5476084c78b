"""The hf_decode table (bench/hf_decode.py's record), the hf_decode_models
table (bench/hf_decode_models.py's) and the hf_serving table
(bench/hf_serving.py's), without importing graphed or torch, for bench/run.py
and scripts/gpu_check_summary.py."""

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


def _cell(value: Any, digits: int = 4) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "-"


def _short_note(note: str) -> str:
    """A decoder note (graphed.Decoder.notes) in a few words."""
    if "fused selective state update" in note:
        return "fused state-space steps"
    if "keep transformers' torch reference" in note:
        return "state-space steps unfused (not float32 on a GPU)"
    if "sliding window" in note:
        return "sliding layers held whole, masked to the window"
    if "recurrent states" in note or "state-space layers" in note:
        return "state-space states sized once"
    if "graphed_grouped_mm" in note:
        return "experts on graphed's grouped GEMM"
    if "run graphed's rms_norm" in note:
        return "RMSNorms in 3 kernels (bitwise)"
    if "run graphed's rotary_embedding" in note:
        return "rotary in 1 kernel (bitwise)"
    return note[:60]


def _hf_floor(row: Dict[str, Any]) -> str:
    """transformers' own eager step floor and graphed's ratio to it, where
    graphed's step runs fused kernels of its own (else '-': the floors agree)."""
    if not row.get("hf_kernel_floor_ms"):
        return "-"
    return f"{_cell(row['hf_kernel_floor_ms'])} ({_cell(row.get('ratio_to_hf_floor'), 2)})"


def _bound(most: Any) -> str:
    """' (of X)': the most a graph of the step could give against transformers'
    DynamicCache (its time over the kernel floor), where measured."""
    return f" (of {_cell(most, 2)})" if most else ""


def models_markdown(record: Dict[str, Any]) -> List[str]:
    """bench/hf_decode_models.py's rows: per model and batch, graphed's ms per
    new token, the decode step's kernel floor and the ratio to it, the ratio
    to the kernels of the whole call (prefill included), the marginal time of one more token (the decode step alone) and its ratio,
    transformers' DynamicCache ms per token and graphed's speedup over it (of
    the most a graph of the step could give, DynamicCache over the floor), and
    whether the tokens equal transformers' (which cache); failures show their
    error."""
    lines = [f"### hf_decode_models ({record.get('prompt')}-token prompts, "
             f"{record.get('new_tokens')} new tokens, greedy; ms per new token; fp32 with "
             f"TF32 {'on' if record.get('tf32') else 'off'}, qwen3_moe bf16)\n",
             "| model | batch | graphed | kernel floor | x floor | x the call's kernels "
             "| decode step alone (x floor) | transformers' step floor (x) "
             "| HF dynamic "
             "| x HF dynamic (of the most) | same tokens | notes |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    batches = record.get("batches") or [1, 8]
    for name, model in record.get("models", {}).items():
        if "error" in model and not any(f"b{b}" in model for b in batches):
            lines.append(f"| {name} | | FAILED: {model['error'][:200]} | | | | | | | | | |")
            continue
        for batch in batches:
            row = model.get(f"b{batch}", {})
            if "error" in row:
                lines.append(f"| {name} | {batch} | FAILED: {row['error'][:200]} |" + " |" * 9)
                continue
            same = row.get("same_tokens")
            if same is None:
                same = "-"
            else:
                same = f"{same} (vs {row.get('compared_with')})"
                if not row.get("same_tokens") and "new_tokens_equal_fraction" in row:
                    same += f", {row['new_tokens_equal_fraction']:.1%} of new tokens"
            notes = [_short_note(note) for note in row.get("graph_notes") or []]
            for path, error in (row.get("errors") or {}).items():
                notes.append(f"{path} failed: {str(error.get('error', error))[:100]}")
            ratio, speedup = row.get("ratio_to_floor"), row.get("speedup_vs_hf_dynamic")
            lines.append(
                f"| {name} | {batch} | {_cell(row.get('ms_per_token'))} | "
                f"{_cell(row.get('kernel_floor_ms'))} | {_cell(ratio, 2)} | "
                f"{_cell(row.get('ratio_to_call_floor'), 2)} | "
                f"{_cell(row.get('decode_ms_per_token'))} "
                f"({_cell(row.get('decode_ratio_to_floor'), 2)}) | "
                f"{_hf_floor(row)} | "
                f"{_cell(row.get('hf_dynamic_ms_per_token'))} | {_cell(speedup, 2)}"
                f"{_bound(row.get('max_speedup_vs_hf_dynamic'))} | {same} | "
                f"{'; '.join(notes)} |")
    lines.append("")
    return lines


def _fraction(value: Any) -> str:
    return f"{value:.0%}" if isinstance(value, (int, float)) else "-"


def _weights(label: Any) -> str:
    """' (bf16)' and the like, from a model label that names its dtype."""
    words = str(label or "").replace(",", " ").replace("(", " ").split()
    found = [w for w in ("bf16", "fp16", "fp32") if w in words]
    return f" ({found[0]})" if found else ""


def serving_markdown(workload: Dict[str, Any]) -> List[str]:
    """bench/hf_serving.py's rows: tokens per second per path and model,
    graphed's speedup over transformers' fastest continuous batching, and the
    token agreement: graphed's requests equal to transformers' continuous
    batching (the fraction of requests where not all are), beside how often
    transformers' continuous batching equals its own static batch (near-tied
    logits that a batch's shape flips make that the most one can ask)."""
    lines = [f"### hf_serving (tokens per second, higher is better; each model's weights in "
             f"parentheses; float32 matmuls with TF32 {'on' if workload.get('tf32') else 'off'})", "",
             "| model | graphed (first pass) | HF generate_batch | "
             "HF generate_batch, CUDA graphs | HF static batch | x fastest HF generate_batch | "
             "same tokens (requests) | HF generate_batch = its static batch (requests) | "
             "p50 / p99 ms per token |",
             "|---|---:|---:|---:|---:|---:|---|---:|---|"]
    for name, row in workload.get("models", {}).items():
        if "error" in row:
            lines.append(f"| {name} | FAILED: {row['error'][:200]} |" + " |" * 7)
            continue
        graphs = row.get("hf_generate_batch_cuda_graphs_tokens_per_s")
        graphs = graphs if isinstance(graphs, (int, float)) else f"failed: {str(graphs)[:80]}"
        same = row.get("same_tokens")
        if same is False:
            same = f"False ({_fraction(row.get('same_tokens_fraction'))})"
        lines.append(f"| {name}{_weights(row.get('model'))} | {row.get('graphed_tokens_per_s')} "
                     f"({row.get('graphed_first_pass_tokens_per_s', '-')}) | "
                     f"{row.get('hf_generate_batch_tokens_per_s')} | {graphs} | "
                     f"{row.get('hf_generate_static_batch_tokens_per_s')} | "
                     f"{row.get('speedup_vs_fastest_hf_generate_batch', '-')} | {same} | "
                     f"{_fraction(row.get('hf_generate_batch_vs_static_batch_fraction'))} | "
                     f"{row.get('p50_ms_per_token')} / {row.get('p99_ms_per_token')} |")
    lines.append("")
    return lines
