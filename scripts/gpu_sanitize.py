"""The sanitize phase of scripts/gpu-check: chosen GPU tests (C++ and Python)
and a short soak run under NVIDIA's compute-sanitizer, memcheck on the most,
racecheck and synccheck on a smaller subset. Parses every "ERROR SUMMARY: N
errors" line, writes OUT/sanitize.json and prints a summary:

    python scripts/gpu_sanitize.py OUT [--budget SECONDS] [--build-dir build/gpu]

Note [Sanitizing CUDA graphs with the caching allocator on]
PyTorch's advice for compute-sanitizer is PYTORCH_NO_CUDA_MEMORY_CACHING=1
(every tensor its own cudaMalloc, so memcheck sees each allocation's bounds).
That cannot work for graphs: with it set, torch's allocator calls cudaMalloc
directly and "deliberately" not through cudaMallocMaybeCapturing, "to force an
error if someone tries to use forceUncachedAllocator while capturing"
(c10/cuda/CUDACachingAllocator.cpp), and private graph pools do not exist
without the cache. Every capture would fail. So the runs keep the caching
allocator: memcheck then reports accesses outside the allocator's segments
(out of bounds past a segment, memory already returned to the driver, which
tests provoke with torch.cuda.empty_cache() after freeing what a graph must
not read, see tests/python/test_lifetimes_gpu.py), misaligned and illegal
addresses, and device-side faults; it cannot see a stale read inside a live
segment. GRAPHED_SANITIZE_NO_CACHING=1 sets the variable anyway, for runs of
eager-only code. CUDA API errors are not counted (--report-api-errors no):
the failed-capture tests provoke them on purpose."""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

PY = "tests/python/"
# Small tests of each component: capture, make_graphed_callables, TrainStep,
# auto with buckets and eviction, re-pointing, failed captures, lifetimes.
MEMCHECK_PYTEST = [
    PY + "test_capture_gpu.py::test_nested_inputs_kwargs_and_constants",
    PY + "test_capture_gpu.py::test_in_place_updates_of_inputs_reach_the_caller",
    PY + "test_capture_gpu.py::test_shared_pool_and_introspection",
    PY + "test_capture_gpu.py::test_capture_failure_names_the_operation_line_and_fix",
    PY + "test_capture_gpu.py::test_repointed_inputs_compute_on_the_new_tensor",
    PY + "test_graphed_callables_gpu.py::test_gradient_accumulation_over_four_microbatches_equals_eager",
    PY + "test_graphed_callables_gpu.py::test_keyword_arguments_tensors_and_constants",
    PY + "test_graphed_callables_gpu.py::test_a_second_forward_before_backward_is_refused_not_corrupted",
    PY + "test_graphed_callables_gpu.py::test_failed_capture_leaves_modules_gradients_and_memory_as_they_were",
    PY + "test_train_step_gpu.py::test_nonfinite_batch_is_skipped_bit_identically",
    PY + "test_train_step_gpu.py::test_failed_capture_leaves_state_bit_identical",
    PY + "test_train_step_gpu.py::test_eval_graph_shares_the_pool",
    PY + "test_skipped_step_gpu.py::test_skipped_step_leaves_weights_optimizer_and_buffers_bit_identical",
    PY + "test_auto_gpu.py::test_eviction_under_a_small_budget_keeps_working",
    PY + "test_auto_gpu.py::test_uncovered_size_falls_back_and_raise_raises",
    PY + "test_lifetimes_gpu.py::test_train_step_keeps_working_after_model_and_optimizer_are_deleted",
    PY + "test_lifetimes_gpu.py::test_release_twice_and_use_after_release_raise_clear_errors",
    PY + "test_lifetimes_gpu.py::test_capture_refuses_a_module_whose_tensors_were_moved_or_replaced",
    PY + "test_lifetimes_gpu.py::test_auto_model_moved_to_another_dtype_raises_or_is_right",
    PY + "test_lifetimes_gpu.py::test_inputs_that_are_other_inputs_static_buffers_are_read_first",
]
# Suites of C++ tests (gtest filters) per test binary: no Python in the way.
MEMCHECK_CPP = {
    "test_capture": "*OnGpu*",
    "test_train_step": "*OnGpu*",
    "test_grad_guard": "*OnGpu*",
    "test_graphed_callable": "*OnGpu*",
}
# racecheck and synccheck instrument every shared-memory access and barrier:
# slower still, so two tests each.
SMALL_PYTEST = [
    PY + "test_capture_gpu.py::test_shared_pool_and_introspection",
    PY + "test_train_step_gpu.py::test_eval_graph_shares_the_pool",
]
SOAK_QUICK = ["bench/run.py", "soak", "--quick"]

# Torch alone under the sanitizer: whether the tool works on this machine at all.
PROBE = ("import torch; x = torch.ones(1 << 20, device='cuda'); "
         "print(float((x * 2).sum())); torch.cuda.synchronize()")
# memcheck and synccheck end with "ERROR SUMMARY: N errors"; racecheck with
# "RACECHECK SUMMARY: H hazards displayed (N errors, W warnings)".
SUMMARY = re.compile(r"(?:ERROR SUMMARY:\s*(\d+)\s+error|RACECHECK SUMMARY:[^(\n]*\((\d+)\s+error)")
PYTEST_TAIL = re.compile(r"=+ (.*(?:passed|failed|error|skipped|deselected).*) in [\d.]+s")


def find_sanitizer() -> Optional[str]:
    """compute-sanitizer from PATH, CUDA_HOME, /usr/local/cuda*, or the
    nvidia-cuda-sanitizer-api wheel."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    candidates = []
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidates.append(os.path.join(root, "bin", "compute-sanitizer"))
    candidates += sorted(glob.glob("/usr/local/cuda-*/bin/compute-sanitizer"), reverse=True)
    candidates += sorted(glob.glob("/opt/nvidia/*/compute-sanitizer/compute-sanitizer"))
    try:
        import nvidia  # noqa: PLC0415 (the pip CUDA wheels, when installed)

        for base in nvidia.__path__:
            for pattern in ("*/compute-sanitizer/compute-sanitizer", "*/bin/compute-sanitizer"):
                candidates += glob.glob(os.path.join(base, pattern))
    except ImportError:
        pass
    return next((c for c in candidates if os.access(c, os.X_OK)), None)


def run_one(sanitizer: str, tool: str, name: str, command: List[str], log_path: str,
            limit_s: float) -> Dict[str, object]:
    """One process tree under ``tool``: its error count (summed over the
    processes it traced), exit status, time and the pytest outcome line."""
    env = dict(os.environ)
    env.setdefault("CUDA_MODULE_LOADING", "LAZY")  # instrument only the kernels that run
    if os.environ.get("GRAPHED_SANITIZE_NO_CACHING") == "1":
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    full = [sanitizer, "--tool", tool, "--target-processes", "all", "--print-limit", "50",
            "--report-api-errors", "no"] + command
    started = time.time()
    timed_out = False
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(full)}\n")
        log.flush()
        # A session of its own: on timeout the whole tree (the sanitizer and the
        # Python it traces) goes, and the pipe closes.
        process = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   env=env, text=True, errors="replace", start_new_session=True)
        try:
            output, _ = process.communicate(timeout=max(limit_s, 1))
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(process.pid, signal.SIGTERM)
            try:
                output, _ = process.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                output, _ = process.communicate()
        status = None if timed_out else process.returncode
        log.write(output)
    counts = summary_counts(output)
    outcome = PYTEST_TAIL.findall(output)
    return {
        "tool": tool,
        "name": name,
        "command": " ".join(command),
        "errors": sum(counts) if counts else None,
        "processes": len(counts),
        "exit_status": status,
        "timed_out": timed_out,
        "seconds": round(time.time() - started, 1),
        "outcome": outcome[-1] if outcome else None,
        "unsupported": "Device not supported" in output,
    }


def cpp_binary(build_dir: str, name: str) -> Optional[str]:
    for path in glob.glob(os.path.join(build_dir, "**", name), recursive=True):
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def summary_counts(output: str) -> List[int]:
    """The error count of every sanitizer summary line in ``output``."""
    return [int(error or hazard) for error, hazard in SUMMARY.findall(output)]


def plan(build_dir: str, python: str) -> List[tuple]:
    """(tool, name, command, share of the time budget) for each run."""
    pytest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header", "-rfE"]
    runs = [("memcheck", "python tests", pytest + MEMCHECK_PYTEST, 0.45)]
    for binary, gtest_filter in MEMCHECK_CPP.items():
        path = cpp_binary(build_dir, binary)
        if path:
            runs.append(("memcheck", f"C++ {binary}", [path, f"--gtest_filter={gtest_filter}"],
                         0.04))
    runs.append(("memcheck", "soak --quick (replays of every API)",
                 [python] + SOAK_QUICK + ["--json", os.devnull], 0.12))
    runs.append(("racecheck", "python tests (small)", pytest + SMALL_PYTEST, 0.1))
    runs.append(("synccheck", "python tests (small)", pytest + SMALL_PYTEST, 0.1))
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="folder for sanitize.json and sanitize.log")
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds for all runs together (default 420)")
    parser.add_argument("--build-dir", default="build/gpu", help="where the C++ tests were built")
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "sanitize.log")
    open(log_path, "w").close()
    result: Dict[str, object] = {"runs": [], "tools": {}}
    sanitizer = find_sanitizer()
    if sanitizer is None:
        result["error"] = ("compute-sanitizer not found (PATH, CUDA_HOME, /usr/local/cuda*, the "
                           "nvidia-cuda-sanitizer-api wheel): install the CUDA toolkit's "
                           "sanitizer or set CUDA_HOME")
    else:
        result["sanitizer"] = sanitizer
        deadline = time.time() + args.budget
        probe = run_one(sanitizer, "memcheck", "probe: torch alone", [args.python, "-c", PROBE],
                        log_path, 120)
        print(f"[sanitize] probe: errors={probe['errors']} exit={probe['exit_status']} "
              f"{probe['seconds']}s", flush=True)
        result["probe"] = probe
        if probe.get("unsupported") or probe["errors"] is None or probe["exit_status"] != 0:
            result["error"] = (
                "compute-sanitizer could not run torch on this machine's GPU"
                + (" (\"Device not supported\": a gVisor runtime; run the sanitize phase on a "
                   "Firecracker machine, e.g. the nvidia-h200-x2 kind)" if probe.get("unsupported")
                   else f" (exit {probe['exit_status']}, see sanitize.log)"))
        runs = [] if "error" in result else plan(args.build_dir, args.python)
        total_share = sum(share for *_, share in runs)
        for tool, name, command, share in runs:
            left = deadline - time.time()
            if left < 20:
                result["runs"].append({"tool": tool, "name": name, "skipped": "time budget spent"})
                continue
            limit = min(left, args.budget * share / total_share * 1.5)
            print(f"[sanitize] {tool}: {name} (limit {limit:.0f}s)", flush=True)
            entry = run_one(sanitizer, tool, name, command, log_path, limit)
            result["runs"].append(entry)
            print(f"[sanitize]   errors={entry['errors']} exit={entry['exit_status']} "
                  f"timed_out={entry['timed_out']} {entry['seconds']}s {entry['outcome'] or ''}",
                  flush=True)
    tools: Dict[str, Dict[str, object]] = {}
    for entry in result["runs"]:
        summary = tools.setdefault(entry["tool"], {"tool": entry["tool"], "tests": [],
                                                   "errors": 0, "complete": True})
        summary["tests"].append(entry["name"])
        if entry.get("errors") is None:
            summary["complete"] = False  # timed out, skipped or crashed before its summary
        else:
            summary["errors"] += entry["errors"]
    result["tools"] = tools
    with open(os.path.join(args.out, "sanitize.json"), "w") as out:
        json.dump(result, out, indent=2)
    print("\n".join(markdown(result)))
    clean = "error" not in result and all(
        t["complete"] and t["errors"] == 0 for t in tools.values())
    return 0 if clean else 1


def markdown(result: Dict[str, object]) -> List[str]:
    """The sanitize table, for this script and scripts/gpu_check_summary.py."""
    if "error" in result:
        return [f"\nsanitize: not run: {result['error']}"]
    lines = ["\n| sanitizer | run | errors | exit | time s | tests |",
             "|---|---|---:|---:|---:|---|"]
    for entry in result["runs"]:
        if "skipped" in entry:
            lines.append(f"| {entry['tool']} | {entry['name']} | skipped: {entry['skipped']} "
                         "| | | |")
            continue
        errors = "none found" if entry["errors"] == 0 else entry["errors"]
        if entry["errors"] is None:
            errors = "TIMED OUT" if entry["timed_out"] else "no summary"
        lines.append(f"| {entry['tool']} | {entry['name']} | {errors} | {entry['exit_status']} "
                     f"| {entry['seconds']} | {entry['outcome'] or ''} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
