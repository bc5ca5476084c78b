"""The zoo's training steps with torch.compile (issue 26): graphed.optimize
with its compiled candidate (compile=True) against torch.compile's own
mode="reduce-overhead", each measured in a fresh process with empty Inductor
and Triton caches (TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR point at a
new temporary directory), so that both build times are cold and neither
reuses the other's kernels.

Per model, two processes. optimize: optimize(..., compile=True) timed whole
(check, advise, the graphed candidate, the compiled candidate, verification,
measurement); its candidates' times and their eager time side by side come
from its report. reduce-overhead: the user's loop over torch.compile(model,
mode="reduce-overhead") timed to the end of its first 3 steps, then its
steady step and eager side by side. Steps in different processes are
compared through their eager times (``*_vs_eager``).

``python bench/zoo_compile.py --json OUT.json [MODEL...]``, or workload
``zoo_compile`` of bench/run.py.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE_NOTE = ("fresh TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR, a new process per method, "
              "the file cache warmed beforehand by a throwaway process")


def _setup(name: str) -> Tuple[Any, Callable[[], Tuple[Any, Any]]]:
    import torch

    sys.path.insert(0, HERE)
    import zoo_models

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    entry = zoo_models.build(name)
    base = {k: v.detach().clone() for k, v in entry.model.state_dict().items()}

    def fresh():
        model = copy.deepcopy(entry.model)
        model.load_state_dict(base)
        return model, entry.make_optimizer(model)

    return entry, fresh


def optimize_row(name: str) -> Dict[str, Any]:
    """optimize(..., compile=True) from cold caches."""
    import graphed

    entry, fresh = _setup(name)
    model, optimizer = fresh()
    stages: List[Tuple[str, float]] = []
    started = time.perf_counter()
    report = graphed.optimize(model, optimizer, entry.loss_fn, sample_batch=entry.batch,
                              compile=True,
                              progress=lambda stage: stages.append((stage, time.perf_counter())))
    finished = time.perf_counter()
    row: Dict[str, Any] = {"optimize_total_s": round(finished - started, 3),
                           "optimize_applied": bool(report.applied),
                           "optimize_reason": report.reason}
    # Where optimize's run goes: seconds from each stage's start to the next's.
    ends = [t for _, t in stages[1:]] + [finished]
    row["optimize_stage_s"] = {stage: round(end - begun, 3)
                               for (stage, begun), end in zip(stages, ends)}
    compiled = report.compiled
    row["optimize_compiled"] = {k: v for k, v in compiled.items() if k != "options"}
    row["optimize_compile_s"] = compiled.get("compile_s")
    row["optimize_compiled_ms"] = compiled.get("ms")
    row["optimize_graphed_ms"] = compiled.get("graphed_ms", report.graphed_ms)
    row["optimize_choice"] = "compiled" if compiled.get("chosen") else "graphed"
    row["optimize_best_ms"] = report.graphed_ms if report.applied else None
    row["optimize_eager_ms"] = report.eager_ms
    if report.applied and report.eager_ms:
        row["optimize_best_vs_eager"] = round(report.graphed_ms / report.eager_ms, 4)
    row["optimize_prediction_error"] = report.prediction_error
    advice = report.advice.to_dict() if report.advice is not None else {}
    row["advise_predicted_ms"] = advice.get("predicted_ms")
    row["advise_predicted_compiled_ms"] = (advice.get("compiled") or {}).get("predicted_ms")
    return row


def reduce_overhead_row(name: str) -> Dict[str, Any]:
    """The user's loop over torch.compile(model, mode="reduce-overhead") from
    cold caches: time to its first 3 steps, then its step against eager."""
    import torch

    from graphed import measure
    from graphed.train import batch_loss

    entry, fresh = _setup(name)

    def loop_step(model, optimizer):
        def step():
            optimizer.zero_grad(set_to_none=True)
            loss = batch_loss(model, entry.loss_fn, entry.batch)
            loss.backward()
            optimizer.step()
            return loss.detach()
        return step

    model, optimizer = fresh()
    compiled = loop_step(torch.compile(model, mode="reduce-overhead"), optimizer)
    started = time.perf_counter()
    for _ in range(3):
        compiled()
    torch.cuda.synchronize()
    row: Dict[str, Any] = {"compile_ro_first_steps_s": round(time.perf_counter() - started, 3)}
    eager_model, eager_optimizer = fresh()
    times = measure.compare_ms({"eager": loop_step(eager_model, eager_optimizer),
                                "compile_ro": compiled}, iters=10, repeats=5)
    row["compile_ro_ms"] = round(times["compile_ro"], 4)
    row["compile_ro_eager_ms"] = round(times["eager"], 4)
    row["compile_ro_vs_eager"] = round(times["compile_ro"] / times["eager"], 4)
    return row


METHODS = {"optimize": optimize_row, "reduce_overhead": reduce_overhead_row}


def _in_fresh_process(name: str, method: str, timeout_s: float) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="graphed-zoo-compile-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(cache, "triton"))
        out = os.path.join(cache, "row.json")
        try:
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", name,
                                   "--method", method, "--json", out], env=env,
                                  capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {f"{method}_error": f"timed out after {timeout_s:.0f} s"}
        if done.returncode != 0 or not os.path.exists(out):
            return {f"{method}_error": (done.stdout + done.stderr)[-3000:]}
        with open(out) as f:
            return json.load(f)


WARM_FILES = """
import torch, torch._inductor.compile_fx, graphed, transformers, timm, torchvision
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).cuda()
torch.compile(model)(torch.randn(4, 8, device="cuda")).sum().backward()
"""


def warm_file_cache(timeout_s: float = 300.0) -> None:
    """Reads torch's, Inductor's and the model libraries' files once, in a
    throwaway process with its own empty caches: the operating system's file
    cache is then warm for both methods' processes alike, while their Inductor
    and Triton caches stay empty (otherwise the first process measured pays
    for the disk)."""
    with tempfile.TemporaryDirectory(prefix="graphed-zoo-compile-warm-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(cache, "triton"))
        subprocess.run([sys.executable, "-c", WARM_FILES], env=env, capture_output=True,
                       timeout=timeout_s)


def compile_rows(name: str, timeout_s: float = 300.0) -> Dict[str, Any]:
    """Both methods on model ``name``, each in a new process with empty caches."""
    row: Dict[str, Any] = {"cache": CACHE_NOTE}
    for method in METHODS:
        row.update(_in_fresh_process(name, method, timeout_s))
    if row.get("optimize_best_vs_eager") and row.get("compile_ro_vs_eager"):
        row["optimize_best_vs_compile_ro"] = round(
            row["optimize_best_vs_eager"] / row["compile_ro_vs_eager"], 4)
    if row.get("optimize_total_s") and row.get("compile_ro_first_steps_s"):
        row["optimize_run_vs_compile_ro_first_steps"] = round(
            row["optimize_total_s"] / row["compile_ro_first_steps_s"], 3)
    return row


def run(quick: bool = False, models: Optional[List[str]] = None) -> Dict[str, Any]:
    """Every zoo model (or ``models``), each in its own cold process."""
    sys.path.insert(0, HERE)
    import zoo_models

    results: Dict[str, Any] = {"description": __doc__.split("\n\n")[0].replace("\n", " "),
                               "models": {}}
    warm_file_cache()
    for name in models or list(zoo_models.BUILDERS):
        started = time.perf_counter()
        results["models"][name] = compile_rows(name)
        _show(name, results["models"][name], started)
    return results


def _show(name: str, row: Dict[str, Any], started: float) -> None:
    shown = {k: v for k, v in row.items() if k.endswith(("_ms", "_s", "choice", "error"))}
    print(f"zoo_compile: {name}: {time.perf_counter() - started:.0f} s {json.dumps(shown)}",
          flush=True)


def markdown(results: Dict[str, Any]) -> List[str]:
    """The table of bench/run.py's report."""
    def ms(row: Dict[str, Any], key: str) -> str:
        value = row.get(key)
        return f"{value:.2f}" if isinstance(value, (int, float)) else "-"

    lines = ["### zoo_compile: optimize(compile=True) against torch.compile reduce-overhead "
             "(ms per step; s from cold caches)", "",
             "| model | reduce-overhead (x eager) | optimize graphed | optimize compiled | "
             "optimize best (x eager) | choice | RO first 3 steps s | optimize run s | "
             "compile s |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for name, r in results["models"].items():
        errors = [r[k] for k in r if k.endswith("_error") and isinstance(r[k], str)]
        if errors:
            lines.append(f"| {name} | error: {errors[0][-200:]!r} | | | | | | | | |")
            continue
        lines.append(
            f"| {name} | {ms(r, 'compile_ro_ms')} ({ms(r, 'compile_ro_vs_eager')}) | "
            f"{ms(r, 'optimize_graphed_ms')} | {ms(r, 'optimize_compiled_ms')} | "
            f"{ms(r, 'optimize_best_ms')} ({ms(r, 'optimize_best_vs_eager')}) | "
            f"{r.get('optimize_choice', '-')} | "
            f"{ms(r, 'compile_ro_first_steps_s')} | {ms(r, 'optimize_total_s')} | "
            f"{ms(r, 'optimize_compile_s')} |")
    lines.append("")
    return lines


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*")
    parser.add_argument("--json", required=True)
    parser.add_argument("--one", metavar="MODEL", help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=sorted(METHODS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        row = METHODS[args.method](args.one)
        with open(args.json, "w") as f:
            json.dump(row, f, indent=2, default=str)
        return 0
    sys.path.insert(0, HERE)
    import zoo_models

    results: Dict[str, Any] = {"description": __doc__.split("\n\n")[0].replace("\n", " "),
                               "models": {}}
    warm_file_cache()
    for name in args.models or list(zoo_models.BUILDERS):
        started = time.perf_counter()
        results["models"][name] = compile_rows(name)
        _show(name, results["models"][name], started)
        with open(args.json, "w") as f:  # after every model: a time limit keeps what was done
            json.dump(results, f, indent=2, default=str)
    print("\n".join(markdown(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
