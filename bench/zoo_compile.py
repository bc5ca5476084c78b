"""The zoo's training steps with torch.compile (issue 26): graphed.optimize
with its compiled candidate (compile=True) against torch.compile's own
mode="reduce-overhead", each model in a fresh process with empty Inductor
and Triton caches (TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR point at a
new temporary directory), so that both build times are cold.

In that process, in this order: optimize(..., compile=True) from the cold
cache (its whole run timed: check, advise, the graphed candidate, the
compiled candidate, verification, measurement), then reduce-overhead (its
time to the first 3 steps; it may reuse Inductor kernels optimize compiled
for the same graphs in memory, which can only shorten it), then eager,
optimize's step and reduce-overhead's step timed side by side.

``python bench/zoo_compile.py --json OUT.json [MODEL...]``; zoo.run merges
``compile_rows(name)`` into each model's record.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))


def measure_in_this_process(name: str) -> Dict[str, Any]:
    import torch

    sys.path.insert(0, HERE)
    import graphed
    from graphed import measure
    from graphed.train import batch_loss

    import zoo_models

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    entry = zoo_models.build(name)
    base = {k: v.detach().clone() for k, v in entry.model.state_dict().items()}
    row: Dict[str, Any] = {"cache": "fresh TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR, "
                                    "new process"}

    import copy

    def fresh():
        model = copy.deepcopy(entry.model)
        model.load_state_dict(base)
        return model, entry.make_optimizer(model)

    model, optimizer = fresh()
    started = time.perf_counter()
    report = graphed.optimize(model, optimizer, entry.loss_fn, sample_batch=entry.batch,
                              compile=True, progress=False)
    row["optimize_total_s"] = round(time.perf_counter() - started, 3)
    compiled = report.compiled
    row["optimize_applied"] = bool(report.applied)
    row["optimize_reason"] = report.reason
    row["optimize_compiled"] = {k: v for k, v in compiled.items() if k != "options"}
    row["optimize_compile_s"] = compiled.get("compile_s")
    row["optimize_compiled_ms"] = compiled.get("ms")
    row["optimize_graphed_ms"] = compiled.get("graphed_ms")
    row["optimize_choice"] = "compiled" if compiled.get("chosen") else "graphed"
    row["optimize_prediction_error"] = report.prediction_error
    advice = report.advice.to_dict() if report.advice is not None else {}
    row["advise_predicted_ms"] = advice.get("predicted_ms")
    row["advise_predicted_compiled_ms"] = (advice.get("compiled") or {}).get("predicted_ms")

    model_ro, optimizer_ro = fresh()
    compiled_model = torch.compile(model_ro, mode="reduce-overhead")

    def ro_step():
        optimizer_ro.zero_grad(set_to_none=True)
        loss = batch_loss(compiled_model, entry.loss_fn, entry.batch)
        loss.backward()
        optimizer_ro.step()
        return loss.detach()

    started = time.perf_counter()
    for _ in range(3):
        ro_step()
    torch.cuda.synchronize()
    row["compile_ro_first_steps_s"] = round(time.perf_counter() - started, 3)

    model_eager, optimizer_eager = fresh()

    def eager_step():
        optimizer_eager.zero_grad()
        loss = batch_loss(model_eager, entry.loss_fn, entry.batch)
        loss.backward()
        optimizer_eager.step()
        return loss.detach()

    runs = {"eager": eager_step, "compile_ro": ro_step}
    if report.applied:
        runs["optimize"] = lambda: report.step(entry.batch)
    times = measure.compare_ms(runs, iters=10, repeats=5)
    row["eager_ms"] = round(times["eager"], 4)
    row["compile_ro_ms"] = round(times["compile_ro"], 4)
    if "optimize" in times:
        row["optimize_best_ms"] = round(times["optimize"], 4)
        row["optimize_best_vs_compile_ro"] = round(times["optimize"] / times["compile_ro"], 4)
    row["optimize_run_vs_compile_ro_first_steps"] = round(
        row["optimize_total_s"] / row["compile_ro_first_steps_s"], 3)
    return row


def compile_rows(name: str, timeout_s: float = 420.0) -> Dict[str, Any]:
    """measure_in_this_process(name) in a new process with empty caches."""
    with tempfile.TemporaryDirectory(prefix="graphed-zoo-compile-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(cache, "triton"))
        out = os.path.join(cache, "row.json")
        try:
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", name,
                                   "--json", out], env=env, capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"compile_error": f"timed out after {timeout_s:.0f} s"}
        if done.returncode != 0 or not os.path.exists(out):
            return {"compile_error": (done.stdout + done.stderr)[-3000:]}
        with open(out) as f:
            return json.load(f)


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*")
    parser.add_argument("--json", required=True)
    parser.add_argument("--one", metavar="MODEL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        row = measure_in_this_process(args.one)
        with open(args.json, "w") as f:
            json.dump(row, f, indent=2, default=str)
        return 0
    sys.path.insert(0, HERE)
    import zoo_models

    results: Dict[str, Any] = {"description": __doc__.split("\n\n")[0].replace("\n", " "),
                               "models": {}}
    for name in args.models or list(zoo_models.BUILDERS):
        started = time.perf_counter()
        results["models"][name] = compile_rows(name)
        print(f"zoo_compile: {name}: {time.perf_counter() - started:.0f} s "
              f"{json.dumps({k: v for k, v in results['models'][name].items() if k.endswith(('_ms', '_s', 'choice', 'error'))})}",
              flush=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
