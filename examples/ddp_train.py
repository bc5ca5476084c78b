"""Data-parallel training with the whole iteration, all-reduces included,
captured as one CUDA graph per GPU.

    torchrun --standalone --nproc-per-node 2 examples/ddp_train.py [--steps 100]

Each rank trains the gpt_train model of graphed.workloads on its own random
tokens; DistributedDataParallel averages the gradients inside the graph. The
script prints rank 0's loss and the time per step of eager DDP and of the
captured step, then shuts down cleanly.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import graphed
from graphed import distributed, workloads


def ms_per_step(step, batches) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    for batch in batches:
        step(batch)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1000 / len(batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()

    # NCCL with the settings capture needs, on the GPU of LOCAL_RANK, with
    # NVLink multicast off (it can take a shared host's GPUs out of service).
    distributed.init_process_group("nccl", nvlink_multicast=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    workloads.configure_numerics()
    base, _, _ = workloads.gpt_train()  # seed 0: the same model on every rank
    generator = torch.Generator(device="cuda").manual_seed(rank)
    batches = [tuple(torch.randint(0, 4096, (8, 128), device="cuda", generator=generator)
                     for _ in range(2)) for _ in range(args.steps)]

    # Eager DDP, for comparison.
    eager = DistributedDataParallel(copy.deepcopy(base), device_ids=[torch.cuda.current_device()])
    eager_optimizer = torch.optim.AdamW(eager.parameters(), lr=1e-4)

    def eager_step(batch):
        tokens, targets = batch
        eager_optimizer.zero_grad(set_to_none=False)
        loss = workloads.gpt_loss(eager(tokens), targets)
        loss.backward()
        eager_optimizer.step()
        return loss.detach()

    # graphed: DDP built on the capture stream; TrainStep warms up 11
    # iterations, captures forward, backward, all-reduces and AdamW, and from
    # then on each step is one graph launch.
    model = distributed.prepare_ddp(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    started = time.perf_counter()
    step = graphed.TrainStep.from_parts(model, optimizer, workloads.gpt_loss, batches[0])
    capture_s = time.perf_counter() - started

    eager_ms = ms_per_step(eager_step, batches)
    graphed_ms = ms_per_step(step, batches)
    loss = step(batches[0])
    if rank == 0:
        print(f"{world} ranks, {args.steps} steps; capture took {capture_s:.1f} s")
        print(f"eager DDP      {eager_ms:8.3f} ms/step")
        print(f"graphed DDP    {graphed_ms:8.3f} ms/step  ({eager_ms / graphed_ms:.2f}x)")
        print(f"loss after {step.stats()['steps']} graphed steps: {loss.item():.4f}")

    # Releases the graph (it holds the NCCL communicator), then destroys the
    # process group, with a time limit instead of a hang.
    distributed.shutdown()


if __name__ == "__main__":
    main()
