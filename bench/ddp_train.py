"""gpt_train under DistributedDataParallel and FSDP2, one process per GPU:
eager DDP against graphed.TrainStep over DDP (forward, backward, all-reduces
and AdamW captured as one graph), and eager FSDP2 (fully_shard on every block
and the whole model) against graphed.TrainStep over it (unshards,
all-gathers, reduce-scatters and AdamW on the shards captured), side by side
in each process.

    torchrun --standalone --nproc-per-node 2 bench/ddp_train.py \\
        --json bench/results/h200x2.json [--markdown OUT.md] [--quick]

Every rank times both methods with CUDA events (medians of interleaved
rounds, harness.time_methods); a job's step takes as long as its slowest rank,
so speedups use the maximum over ranks. Rank 0 writes the results."""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys
import traceback
from typing import Any, Dict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import graphed  # noqa: E402
from graphed import distributed, workloads  # noqa: E402

from gpt_train import LR, eager_step  # noqa: E402
from harness import Method, prepare, time_methods  # noqa: E402

WORKLOAD = "gpt_train_ddp"


def eager_ddp(base: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor):
    """gpt_train's eager step (DESIGN.md) on a DDP model built the usual way."""
    model = DistributedDataParallel(copy.deepcopy(base), device_ids=[torch.cuda.current_device()])
    return eager_step(model, tokens, targets)


def fsdp2_model(base: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``base`` sharded the usual way: fully_shard on every block,
    then on the whole model (default resharding: blocks after forward, the
    root not)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    model = copy.deepcopy(base)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def run(quick: bool) -> Dict[str, Any]:
    workloads.configure_numerics()
    base, _, _ = workloads.gpt_train()  # seed 0: the same model on every rank
    generator = torch.Generator(device="cuda").manual_seed(dist.get_rank())
    tokens, targets = (torch.randint(0, 4096, (8, 128), device="cuda", generator=generator)
                       for _ in range(2))
    iters, repeats = (5, 3) if quick else (20, 7)

    def graphed_trainstep():
        model = distributed.prepare_ddp(copy.deepcopy(base))
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        train = graphed.TrainStep.from_parts(model, optimizer, workloads.gpt_loss,
                                             (tokens, targets))
        methods["graphed_trainstep"].record["kernels"] = train.stats()["kernels"]
        return lambda: train((tokens, targets))

    def fsdp2_graphed():
        model = fsdp2_model(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        train = graphed.TrainStep.from_parts(model, optimizer, workloads.gpt_loss,
                                             (tokens, targets))
        methods["fsdp2_graphed"].record["kernels"] = train.stats()["kernels"]
        return lambda: train((tokens, targets))

    methods = {
        "eager": Method("eager", lambda: eager_ddp(base, tokens, targets)),
        "graphed_trainstep": Method("graphed_trainstep", graphed_trainstep, True),
        # gpt_train's eager step on the FSDP2 model (zero_grad(set_to_none=False),
        # AdamW's default implementation over the DTensor shards).
        "fsdp2_eager": Method("fsdp2_eager",
                              lambda: eager_step(fsdp2_model(base), tokens, targets)),
        "fsdp2_graphed": Method("fsdp2_graphed", fsdp2_graphed, True),
    }
    first_losses = {}
    for name, method in methods.items():
        if dist.get_rank() == 0:
            print(f"bench: {WORKLOAD}: {name}", flush=True)
        prepare(method)
        first_losses[name] = method.run().item()
    time_methods(methods, iters=iters, repeats=repeats)

    world = dist.get_world_size()
    per_rank = torch.tensor([[m.record["ms"] for m in methods.values()]], device="cuda")
    gathered = [torch.empty_like(per_rank) for _ in range(world)]
    dist.all_gather(gathered, per_rank)
    table = torch.cat(gathered).cpu()  # [rank, method]
    records = {}
    slowest = {name: table[:, i].max().item() for i, name in enumerate(methods)}
    for i, (name, method) in enumerate(methods.items()):
        record = dict(method.record)
        record["ms_per_rank"] = [round(v, 4) for v in table[:, i].tolist()]
        record["ms"] = round(slowest[name], 4)
        record["speedup_vs_eager"] = round(slowest["eager"] / slowest[name], 3)
        record["first_loss_diff_vs_eager"] = abs(first_losses[name] - first_losses["eager"])
        if name.startswith("fsdp2_"):
            record["speedup_vs_fsdp2_eager"] = round(slowest["fsdp2_eager"] / slowest[name], 3)
        record["world_size"] = world
        records[name] = record
    # Graphs before the process group: see graphed.distributed.shutdown.
    for method in methods.values():
        method.run = None
    return {
        "description": (workloads.GPT_TRAIN_DESCRIPTION + f"; DistributedDataParallel "
                        f"(eager, graphed_trainstep) and FSDP2 fully_shard per block and on the "
                        f"root (fsdp2_eager, fsdp2_graphed) over {world} GPUs (one process "
                        "each, NCCL), batch 8x128 tokens per rank; ms is the slowest rank's "
                        "median"),
        "world_size": world,
        "methods": records,
    }


def markdown(results: Dict[str, Any]) -> str:
    lines = []
    for name, workload in results["workloads"].items():
        if "error" in workload:
            lines.append(f"### {name}: FAILED\n\n```\n{workload['error']}\n```\n")
            continue
        lines.append(f"### {name} ({workload['world_size']} GPUs)\n")
        lines.append("| method | ms (slowest rank) | ms per rank | x eager DDP | x eager FSDP2 | "
                     "capture ms | graph MB |")
        lines.append("|---|---:|---|---:|---:|---:|---:|")
        for method, r in workload["methods"].items():
            ranks = ", ".join(f"{v:.4f}" for v in r["ms_per_rank"])
            capture = f"{r['capture_ms']:.1f}" if "capture_ms" in r else ""
            memory = "" if r.get("graph_mb") is None else f"{r['graph_mb']:.1f}"
            fsdp2 = (f"{r['speedup_vs_fsdp2_eager']:.2f}" if "speedup_vs_fsdp2_eager" in r
                     else "")
            lines.append(f"| {method} | {r['ms']:.4f} | {ranks} | {r['speedup_vs_eager']:.2f} | "
                         f"{fsdp2} | {capture} | {memory} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where rank 0 writes the results")
    parser.add_argument("--markdown", help="where rank 0 writes the markdown table")
    parser.add_argument("--quick", action="store_true", help="fewer iterations (smoke test)")
    args = parser.parse_args()
    if not torch.cuda.is_available() or "RANK" not in os.environ:
        print("bench/ddp_train.py: run it under torchrun on a machine with NVIDIA GPUs, e.g. "
              "torchrun --standalone --nproc-per-node 2 bench/ddp_train.py --json OUT.json",
              file=sys.stderr)
        return 2
    distributed.init_process_group("nccl", nvlink_multicast=False)
    rank = dist.get_rank()
    results = {
        "device": torch.cuda.get_device_name(),
        "gpus": dist.get_world_size(),
        "torch": torch.__version__,
        "nccl": ".".join(str(v) for v in torch.cuda.nccl.version()),
        "graphed": graphed.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": {name: os.environ.get(name) for name in
                        list(distributed.NVLINK_MULTICAST_OFF) + list(distributed.CAPTURE_ENVIRONMENT)},
        "workloads": {},
    }
    failed = False
    try:
        results["workloads"][WORKLOAD] = run(args.quick)
    except Exception:  # reported in the results; the other rank fails alike or times out
        failed = True
        results["workloads"][WORKLOAD] = {"error": traceback.format_exc()}
        traceback.print_exc()
    if rank == 0:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
        table = markdown(results)
        if args.markdown:
            with open(args.markdown, "w") as out:
                out.write(table)
        print(table, flush=True)
    if not failed:
        distributed.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
