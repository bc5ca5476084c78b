"""The model zoo (bench/zoo_models.py), trained and served the ways a user
would try: eager; graphed.TrainStep.from_parts; graphed.auto with the
optimizer eager; graphed.optimize (check -> advise -> apply -> verify); and
for inference graphed.capture at the training batch size and graphed.auto
over batch sizes cycling through 1..64. Every method of a model starts from
the same weights and runs side by side in one process; ratios are the result.

``python bench/zoo.py --json OUT.json [--quick] [MODEL...]`` or, through
bench/run.py, workload ``zoo``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import graphed  # noqa: E402
from graphed import measure  # noqa: E402
from graphed.train import batch_loss, training_iteration  # noqa: E402

import zoo_models  # noqa: E402
from zoo_report import markdown  # noqa: E402,F401 - bench/run.py formats through zoo

#: Batch sizes the inference rows cycle through (as the decode workload does).
CYCLE = (1, 3, 5, 8, 13, 21, 32, 47, 64)


def _eager_step(model, optimizer, loss_fn) -> Callable[[Any], torch.Tensor]:
    def step(batch):
        optimizer.zero_grad()
        loss = batch_loss(model, loss_fn, batch)
        loss.backward()
        optimizer.step()
        return loss.detach()
    return step


def _fresh(entry: zoo_models.ZooModel, base_state: Dict[str, torch.Tensor]):
    model = copy.deepcopy(entry.model)
    model.load_state_dict(base_state)
    return model, entry.make_optimizer(model)


def _held_mb(before: int) -> float:
    torch.cuda.synchronize()
    return round((torch.cuda.memory_reserved() - before) / 2**20, 2)


def _losses(step: Callable[[Any], torch.Tensor], batch: Any, count: int) -> List[float]:
    return [float(step(batch)) for _ in range(count)]


def _max_rel(a: List[float], b: List[float]) -> float:
    return max(abs(x - y) / max(abs(x), 1e-6) for x, y in zip(a, b))


def train_rows(entry: zoo_models.ZooModel, iters: int, repeats: int, steps: int
               ) -> Dict[str, Any]:
    """Training: eager, TrainStep, auto (optimizer eager), optimize."""
    row: Dict[str, Any] = {}
    base_state = {k: v.detach().clone() for k, v in entry.model.state_dict().items()}
    batch, loss_fn = entry.batch, entry.loss_fn
    torch.manual_seed(1)
    runs: Dict[str, Callable[[], Any]] = {}

    model, optimizer = _fresh(entry, base_state)
    eager = _eager_step(model, optimizer, loss_fn)
    rng = torch.cuda.get_rng_state()
    eager_losses = _losses(eager, batch, steps)
    runs["eager"] = lambda: eager(batch)

    torch.cuda.set_rng_state(rng)
    model_ts, optimizer_ts = _fresh(entry, base_state)
    before = torch.cuda.memory_reserved()
    started = time.perf_counter()
    try:
        trainstep = graphed.TrainStep.from_parts(model_ts, optimizer_ts, loss_fn, batch)
        row["trainstep_capture_s"] = round(time.perf_counter() - started, 3)
        row["trainstep_graph_mb"] = _held_mb(before)
        row["trainstep_notes"] = trainstep.notes
        row["trainstep_loss_rel_diff"] = _max_rel(eager_losses, _losses(trainstep, batch, steps))
        runs["trainstep"] = lambda: trainstep(batch)
    except Exception as error:  # noqa: BLE001 - a model TrainStep cannot capture is a result
        row["trainstep_error"] = f"{type(error).__name__}: {error}"[:2000]

    torch.cuda.set_rng_state(rng)
    model_auto, optimizer_auto = _fresh(entry, base_state)
    graphed.auto(model_auto)
    auto_step = _eager_step(model_auto, optimizer_auto, loss_fn)
    started = time.perf_counter()
    auto_losses = _losses(auto_step, batch, steps)  # warm-up, capture, replays
    row["auto_first_steps_s"] = round(time.perf_counter() - started, 3)
    row["auto_loss_rel_diff"] = _max_rel(eager_losses, auto_losses)
    runs["auto"] = lambda: auto_step(batch)

    torch.cuda.set_rng_state(rng)
    model_opt, optimizer_opt = _fresh(entry, base_state)
    started = time.perf_counter()
    report = graphed.optimize(model_opt, optimizer_opt, loss_fn, sample_batch=batch)
    row["optimize_s"] = round(time.perf_counter() - started, 3)
    row["optimize_applied"] = bool(report.applied)
    row["optimize_strategy"] = report.strategy
    row["optimize_reason"] = report.reason
    row["optimize_notes"] = report.notes
    row["optimize_own_speedup"] = report.speedup
    row["check_false_findings"] = report.check_false_findings
    if report.advice is not None:
        row["advise_predicted_ms"] = round(report.advice.predicted_ms, 4)
        row["advise_strategy"] = report.advice.strategy
        row["advise_blockers"] = report.advice.blockers
    if report.applied:
        runs["optimize"] = lambda: report.step(batch)

    times = measure.compare_ms(runs, iters=iters, repeats=repeats)
    for name, ms in times.items():
        row[f"{name}_ms"] = round(ms, 4)
    stats = graphed.auto_stats(model_auto)
    row["auto_replays"] = stats["replays"]
    row["auto_graphs"] = stats["graphs"]
    row["auto_graph_mb"] = round(stats["graph_memory_bytes"] / 2**20, 2)
    row["auto_fallbacks"] = [f"{f['module']}: {f['reason']} (x{f['count']})"
                             for f in stats["fallbacks"]]
    row["auto_notes"] = stats["notes"]
    row["check_false_findings"] += stats["check_false_findings"]
    # The check itself, on the iteration TrainStep captures: what would it report?
    check_model, check_optimizer = _fresh(entry, base_state)
    iteration, _ = training_iteration(check_model, check_optimizer, loss_fn, batch)
    report_check = graphed.check(iteration, batch)
    row["check_findings"] = [f.to_dict() for f in report_check.findings]
    row["check_harmless"] = len(report_check.harmless)
    row["check_verdict"] = report_check.verdict
    eager_ms = row["eager_ms"]
    for name in ("trainstep", "auto", "optimize"):
        if f"{name}_ms" in row:
            row[f"{name}_speedup"] = round(eager_ms / row[f"{name}_ms"], 3)
    if "optimize_ms" in row and "trainstep_ms" in row:
        row["optimize_vs_trainstep"] = round(row["optimize_ms"] / row["trainstep_ms"], 4)
    if "advise_predicted_ms" in row and "optimize_ms" in row:
        row["advise_error"] = round(row["advise_predicted_ms"] / row["optimize_ms"] - 1, 4)
    return row


#: The step most transformer training runs (issue 26): bf16 autocast over fp32
#: weights and gradient clipping.
USUAL_SETTINGS = {"amp": "bf16", "clip_grad_norm": 1.0}


def usual_settings_rows(entry: zoo_models.ZooModel, iters: int, repeats: int
                        ) -> Dict[str, Any]:
    """optimize(..., **USUAL_SETTINGS) against TrainStep.from_parts with the same
    settings, side by side: is optimize's step the one people run, as fast?"""
    row: Dict[str, Any] = {"settings": dict(USUAL_SETTINGS)}
    base_state = {k: v.detach().clone() for k, v in entry.model.state_dict().items()}
    batch, loss_fn = entry.batch, entry.loss_fn
    runs: Dict[str, Callable[[], Any]] = {}
    model_ts, optimizer_ts = _fresh(entry, base_state)
    try:
        trainstep = graphed.TrainStep.from_parts(model_ts, optimizer_ts, loss_fn, batch,
                                                 **USUAL_SETTINGS)
        runs["trainstep"] = lambda: trainstep(batch)
    except Exception as error:  # noqa: BLE001 - a result
        row["trainstep_error"] = f"{type(error).__name__}: {error}"[:2000]
    model_opt, optimizer_opt = _fresh(entry, base_state)
    report = graphed.optimize(model_opt, optimizer_opt, loss_fn, sample_batch=batch,
                              **USUAL_SETTINGS)
    row["optimize_applied"] = bool(report.applied)
    row["optimize_strategy"] = report.strategy
    row["optimize_reason"] = report.reason
    row["optimize_max_abs_diff"] = report.max_abs_diff
    if report.applied:
        runs["optimize"] = lambda: report.step(batch)
    if runs:
        for name, ms in measure.compare_ms(runs, iters=iters, repeats=repeats).items():
            row[f"{name}_ms"] = round(ms, 4)
    if "optimize_ms" in row and "trainstep_ms" in row:
        row["optimize_vs_trainstep"] = round(row["optimize_ms"] / row["trainstep_ms"], 4)
    return row


def _outputs(value: Any) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _outputs(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _outputs(v)]
    return []


def _max_diff(a: Any, b: Any) -> float:
    pairs = list(zip(_outputs(a), _outputs(b)))
    return max(((x.float() - y.float()).abs().max().item() for x, y in pairs), default=0.0)


def inference_rows(entry: zoo_models.ZooModel, iters: int, repeats: int) -> Dict[str, Any]:
    """Inference: eager and graphed.capture at the training batch size; eager
    and graphed.auto over batch sizes cycling through CYCLE."""
    row: Dict[str, Any] = {}
    model = copy.deepcopy(entry.model).eval()
    batch_size = next(t for t in _outputs(entry.batch)).shape[0]
    args, kwargs = entry.inference_inputs(batch_size)
    with torch.no_grad():
        expected = model(*args, **kwargs)
        before = torch.cuda.memory_reserved()
        started = time.perf_counter()
        fast = graphed.capture(model, *args, sample_kwargs=kwargs)
        row["infer_capture_s"] = round(time.perf_counter() - started, 3)
        row["infer_capture_graph_mb"] = _held_mb(before)
        row["infer_capture_max_diff"] = _max_diff(expected, fast(*args, **kwargs))
        times = measure.compare_ms({"eager": lambda: model(*args, **kwargs),
                                    "capture": lambda: fast(*args, **kwargs)},
                                   iters=iters, repeats=repeats)
        row["infer_eager_ms"] = round(times["eager"], 4)
        row["infer_capture_ms"] = round(times["capture"], 4)
        del fast

        cycle = [entry.inference_inputs(b) for b in CYCLE]
        auto_model = graphed.auto(copy.deepcopy(entry.model).eval())
        before = torch.cuda.memory_reserved()
        started = time.perf_counter()
        for _ in range(4):  # warm-up (3 calls per size) and captures
            for a, k in cycle:
                auto_model(*a, **k)
        row["infer_auto_setup_s"] = round(time.perf_counter() - started, 3)
        row["infer_auto_max_diff"] = max(_max_diff(model(*a, **k), auto_model(*a, **k))
                                         for a, k in cycle)

        def run_cycle(m):
            def run():
                for a, k in cycle:
                    m(*a, **k)
            return run

        times = measure.compare_ms({"eager": run_cycle(model), "auto": run_cycle(auto_model)},
                                   iters=max(1, iters // 5), repeats=repeats)
        row["infer_cycle_eager_ms"] = round(times["eager"] / len(CYCLE), 4)
        row["infer_cycle_auto_ms"] = round(times["auto"] / len(CYCLE), 4)
        stats = graphed.auto_stats(auto_model)
        row["infer_auto_graphs"] = stats["graphs"]
        row["infer_auto_graph_mb"] = round(stats["graph_memory_bytes"] / 2**20, 2)
        row["infer_auto_capture_s"] = round(stats["capture_ms"] / 1000, 3)
        row["infer_auto_fallbacks"] = [f"{f['module']}: {f['reason']} (x{f['count']})"
                                       for f in stats["fallbacks"]]
    return row


def run(quick: bool = False, models: Optional[List[str]] = None) -> Dict[str, Any]:
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    iters, repeats, steps = (3, 3, 3) if quick else (10, 5, 5)
    results: Dict[str, Any] = {"description": __doc__.split("\n\n")[0].replace("\n", " "),
                               "models": {}}
    for name in models or list(zoo_models.BUILDERS):
        print(f"zoo: {name}", flush=True)
        record: Dict[str, Any] = {}
        try:
            entry = zoo_models.build(name)
            record.update(library=entry.library, description=entry.description,
                          is_transformer=entry.is_transformer)
            record.update(train_rows(entry, iters, repeats, steps))
            record.update(inference_rows(entry, iters, repeats))
            if entry.is_transformer:
                record["usual_settings"] = usual_settings_rows(entry, iters, repeats)
        except Exception:  # noqa: BLE001 - one broken model must not hide the others
            record["error"] = traceback.format_exc()[-4000:]
            traceback.print_exc()
        results["models"][name] = record
        print(f"zoo: {name}: " + json.dumps({k: v for k, v in record.items()
                                             if k.endswith(("_ms", "_applied", "error"))}),
              flush=True)
        entry = None
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("models", nargs="*", help=f"of {', '.join(zoo_models.BUILDERS)}")
    parser.add_argument("--json", required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    results = run(args.quick, args.models or None)
    with open(args.json, "w") as out:
        json.dump(results, out, indent=2, default=str)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
