"""Runs the benchmarks side by side in one process and writes the results:
``python bench/run.py --json OUT.json --markdown OUT.md [--quick] [WORKLOAD...]``."""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import graphed  # noqa: E402
import graphed.bench  # noqa: E402
from graphed._progress import Progress  # noqa: E402
import gpt_train  # noqa: E402
import host_overhead  # noqa: E402
import mlp_inference  # noqa: E402

WORKLOADS = {"mlp_inference": mlp_inference.run, "gpt_train": gpt_train.run_with_auto,
             "host_overhead": host_overhead.run}

# graphed.auto
import decode  # noqa: E402
import graph_update  # noqa: E402

WORKLOADS["decode"] = decode.run
WORKLOADS["graph_update"] = graph_update.run
WORKLOADS["gpt_train_blocker"] = gpt_train.run_blocker

# Real models (transformers, timm, torchvision)
import zoo  # noqa: E402

WORKLOADS["zoo"] = zoo.run

# LLM decoding of Hugging Face models (issue 14)
import hf_decode  # noqa: E402
import hf_decode_report  # noqa: E402
import integrations  # noqa: E402

WORKLOADS["hf_decode"] = hf_decode.run
WORKLOADS["integrations"] = integrations.run

# Memory safety and state under stress (issue 13)
import soak  # noqa: E402

WORKLOADS["soak"] = soak.run

# FP8 training inside graphs (issue 17)
import gpt_fp8  # noqa: E402

WORKLOADS["gpt_fp8"] = gpt_fp8.run

# graphed.auto never costs more than eager (issue 29)
import auto_overhead  # noqa: E402

WORKLOADS["auto_overhead"] = auto_overhead.run

# Today's architectures: mixture-of-experts, state-space, hybrids (issue 28)
import zoo_modern  # noqa: E402

WORKLOADS["zoo_modern"] = zoo_modern.run

# optimize's compiled candidate against torch.compile's reduce-overhead (issue 26)
import zoo_compile  # noqa: E402

WORKLOADS["zoo_compile"] = zoo_compile.run

# RL post-training: TRL's GRPOTrainer with graphed rollouts and update (issue 30)
import rl_grpo  # noqa: E402

WORKLOADS["rl_grpo"] = rl_grpo.run
# Many requests at once: continuous batching against transformers' own (issue 27)
import hf_serving  # noqa: E402

WORKLOADS["hf_serving"] = hf_serving.run
# graphed.generate on sliding-window, state-space, hybrid and experts models (issue 27)
import hf_decode_models  # noqa: E402

WORKLOADS["hf_decode_models"] = hf_decode_models.run
# Run only when named: soak measures safety, not speed (a minute or more);
# gpt_fp8 trains a 400M-parameter model for minutes; zoo_modern trains seven
# models in two setups for minutes; zoo_compile compiles each zoo model twice
# from cold caches (a minute or more each); rl_grpo trains five GRPO runs
# (TRL needs trl and datasets installed); hf_serving runs transformers'
# continuous batching three ways on two models (minutes); hf_decode_models
# decodes six models at two batches with transformers' slow paths beside
# (two to three minutes).
OPT_IN = {"soak", "gpt_fp8", "zoo_modern", "zoo_compile", "rl_grpo", "hf_serving",
          "hf_decode_models"}


def markdown(results) -> str:
    lines = []
    for name, workload in results["workloads"].items():
        if "error" in workload:
            lines.append(f"### {name}: FAILED\n\n```\n{workload['error']}\n```\n")
            continue
        if name == "zoo_modern":
            lines.extend(zoo_modern.markdown(workload))
            continue
        if name == "zoo_compile":
            lines.extend(zoo_compile.markdown(workload))
            continue
        if name == "rl_grpo":
            lines.extend(rl_grpo.markdown(workload))
            continue
        if name == "hf_serving":
            lines.extend(hf_serving.markdown(workload))
            continue
        if name == "hf_decode_models":
            lines.extend(hf_decode_models.markdown(workload))
            continue
        if "models" in workload:
            lines.append(zoo.markdown(workload))
            continue
        if "apis" in workload:
            verdict = "ok" if workload.get("ok") else "FAILED checks"
            lines.append(f"### {name} ({workload['replays_per_api']} replays per API: "
                         f"{verdict})\n")
            lines.extend(soak.markdown(workload))
            lines.append("")
            continue
        if "host_us" in workload:
            lines.append(f"### {name}\n\n| case | host us per call |\n|---|---:|")
            lines.extend(f"| {case} | {us:.2f} |" for case, us in workload["host_us"].items())
            lines.append("")
            continue
        if name == "integrations":
            lines.extend(integrations.markdown(workload))
            continue
        if name == "gpt_fp8":
            lines.extend(gpt_fp8.markdown(workload))
            continue
        if name == "auto_overhead":
            lines.extend(auto_overhead.markdown(workload))
            continue
        if isinstance(workload.get("kernel_floor_ms"), dict):  # hf_decode: per batch
            lines.extend(hf_decode_report.markdown(workload))
            lines.append("")
            continue
        lines.append(f"### {name} (kernel floor {workload['kernel_floor_ms']:.4f} ms)\n")
        lines.append("| method | ms | x floor | x eager | capture ms | graph MB |")
        lines.append("|---|---:|---:|---:|---:|---:|")
        for method, r in workload["methods"].items():
            capture = f"{r['capture_ms']:.1f}" if "capture_ms" in r else ""
            memory = "" if r.get("graph_mb") is None else f"{r['graph_mb']:.1f}"
            lines.append(f"| {method} | {r['ms']:.4f} | {r['ratio_to_floor']:.2f} | "
                         f"{r['speedup_vs_eager']:.2f} | {capture} | {memory} |")
        lines.append("")
    return "\n".join(lines)


def add_advice(results, name: str, out_dir: str, quick: bool) -> bool:
    """The ``advice`` entry of workload ``name``: graphed.advise's predicted
    graphed time against the graphed method's time measured just before, and
    the relative error; the GPT timeline PNG goes next to the JSON. Runs right
    after its workload, before any later workload can spoil the process.
    True when the prediction is off by more than graphed.bench.TOLERANCE or
    failed."""
    record = results["workloads"][name]
    method = graphed.bench.GRAPHED_METHOD.get(name)
    if method is None or "error" in record:
        return False  # no graphed method to predict (host_overhead, decode...) or it failed
    print(f"bench: advice: {name}", flush=True)
    measured = record.get("methods", {}).get(method, {}).get("ms")
    failed = False
    try:
        entry = graphed.bench.advice_entry(
            name, measured_ms=measured, plot_dir=out_dir if name == "gpt_train" else None,
            quick=quick)
        failed = not entry["within_tolerance"]
    except Exception:  # a broken prediction must not hide the timings
        failed = True
        entry = {"error": traceback.format_exc()}
        traceback.print_exc()
    results.setdefault("advice", {})[name] = entry
    return failed


def forget_cublas_workspaces() -> None:
    """Between workloads, while none of the last one's hand-written graphs
    live: drops PyTorch's cuBLAS workspaces, as torch 2.14 does when a graph
    is destroyed. On torch 2.11 a hand-written torch.cuda.graph leaves
    its capture stream's workspace in its own pool when it dies; the next
    workload's hand-written capture on that stream writes into it, and once
    torch.compile's cudagraph trees clear the workspaces (mlp_inference's
    compile_reduce_overhead) the dead pool is returned to the driver and that
    replay hits an illegal memory access: PyTorch's bug, Note [cuBLAS
    workspaces of captured graphs] in src/cublas_workspace.h. graphed's own
    graphs write only into workspaces graphed owns, so this cannot hide a
    fault of graphed's."""
    gc.collect()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("workloads", nargs="*", metavar="WORKLOAD",
                        help="workloads to run (default: all of "
                             f"{', '.join(w for w in WORKLOADS if w not in OPT_IN)}; "
                             f"{', '.join(sorted(OPT_IN))} only when named)")
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--markdown", help="where to write the markdown table")
    parser.add_argument("--quick", action="store_true", help="fewer iterations (smoke test)")
    args = parser.parse_args()
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    args.workloads = args.workloads or [w for w in WORKLOADS if w not in OPT_IN]
    if not torch.cuda.is_available():
        print("bench: needs an NVIDIA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "graphed": graphed.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "workloads": {},
    }
    failed = False
    # A bar on stderr when it is a terminal; the "bench: <name>" lines stay for logs.
    progress = Progress(len(args.workloads), "bench", unit="workload")
    for name in args.workloads:
        progress(name)
        print(f"bench: {name}", flush=True)
        forget_cublas_workspaces()
        try:
            results["workloads"][name] = WORKLOADS[name](quick=args.quick)
        except Exception:  # a broken workload must not hide the others' results
            failed = True
            results["workloads"][name] = {"error": traceback.format_exc()}
            traceback.print_exc()
        failed |= results["workloads"][name].get("ok") is False  # soak's checks
        failed |= add_advice(results, name, os.path.dirname(os.path.abspath(args.json)),
                             args.quick)
        with open(args.json, "w") as out:  # after each workload: a crash keeps the rest
            json.dump(results, out, indent=2)
    progress.close()
    # Issue 13's check: every default workload ran in this one process, and none failed.
    results["one_process_all_workloads"] = (
        not failed and set(args.workloads) >= {w for w in WORKLOADS if w not in OPT_IN})
    with open(args.json, "w") as out:
        json.dump(results, out, indent=2)
    table = markdown(results) + "\n" + graphed.bench.markdown(results.get("advice", {}))
    if args.markdown:
        with open(args.markdown, "w") as out:
            out.write(table)
    print(table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
