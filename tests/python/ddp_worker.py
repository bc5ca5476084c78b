"""One rank of the DistributedDataParallel tests (test_ddp_gpu.py):
``python ddp_worker.py SCENARIO OUT.json`` with RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT set. Writes what it measured to OUT.json; the test
asserts on it, so failures read the same from every rank. Exits 1 (with the
traceback in OUT.json) when the scenario raised."""

from __future__ import annotations

import copy
import json
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel

import graphed
from graphed import distributed, fp8, workloads

STEPS = 20
LR = 1e-3
VOCAB, LENGTH, BATCH = 4096, 128, 8
# The losses and weights of graphed and eager DDP must agree this closely (fp32).
RTOL, ATOL = 1e-6, 1e-7

Batch = Tuple[torch.Tensor, torch.Tensor]


def base_model() -> nn.Module:
    """The gpt_train model, identical on every rank (seed 0)."""
    torch.manual_seed(0)
    return workloads.GPT(vocab=VOCAB, context=LENGTH).cuda()


def rank_batches(count: int) -> List[Batch]:
    """Different tokens on every rank, so that only all-reduced gradients keep
    the ranks' weights equal."""
    generator = torch.Generator(device="cuda").manual_seed(1000 + dist.get_rank())
    return [tuple(torch.randint(0, VOCAB, (BATCH, LENGTH), device="cuda", generator=generator)
                  for _ in range(2)) for _ in range(count)]


def eager_ddp_losses(model: nn.Module, optimizer: torch.optim.Optimizer,
                     batches: List[Batch]) -> torch.Tensor:
    losses = []
    for tokens, targets in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = workloads.gpt_loss(model(tokens), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def compare(name: str, losses: torch.Tensor, eager_losses: torch.Tensor, model: nn.Module,
            eager_model: nn.Module, initial: List[torch.Tensor]) -> Dict[str, Any]:
    """Losses and weights against eager DDP on this rank, and the weights
    against every other rank's."""
    params = [p.detach() for p in model.parameters()]
    eager_params = [p.detach() for p in eager_model.parameters()]
    flat = torch.cat([p.flatten() for p in params])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return {
        "name": name,
        "losses": losses.tolist(),
        "eager_losses": eager_losses.tolist(),
        "loss_max_rel_diff": ((losses - eager_losses).abs() / eager_losses.abs()).max().item(),
        "weights_close": all(torch.allclose(p, q, rtol=RTOL, atol=ATOL)
                             for p, q in zip(params, eager_params)),
        "weight_max_abs_diff": max((p - q).abs().max().item()
                                   for p, q in zip(params, eager_params)),
        "weights_moved": max((p - w).abs().max().item() for p, w in zip(params, initial)),
        "ranks_agree": all(torch.equal(gathered[0], g) for g in gathered),
    }


def trainstep_run(base: nn.Module, batches: List[Batch], **ddp_kwargs: Any
                  ) -> Tuple[Dict[str, Any], graphed.TrainStep]:
    index = torch.cuda.current_device()
    eager = DistributedDataParallel(copy.deepcopy(base), device_ids=[index], **ddp_kwargs)
    eager_optimizer = graphed.make_capturable(torch.optim.AdamW(eager.parameters(), lr=LR))
    eager_losses = eager_ddp_losses(eager, eager_optimizer, batches)

    model = distributed.prepare_ddp(copy.deepcopy(base), **ddp_kwargs)
    initial = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    step = graphed.TrainStep.from_parts(model, optimizer, workloads.gpt_loss, batches[0])
    captured_unchanged = all(torch.equal(p, w) for p, w in zip(model.parameters(), initial))
    losses = torch.stack([step(batch) for batch in batches])
    name = "trainstep " + ",".join(f"{k}={v}" for k, v in ddp_kwargs.items())
    result = compare(name, losses, eager_losses, model, eager, initial)
    result["capture_changed_nothing"] = captured_unchanged
    result["steps"] = step.stats()["steps"]
    return result, step


def scenario_trainstep() -> Dict[str, Any]:
    base = base_model()
    batches = rank_batches(STEPS)
    runs, steps = [], []
    for bucket_view in (False, True):
        result, step = trainstep_run(base, batches, gradient_as_bucket_view=bucket_view)
        runs.append(result)
        steps.append(step)
    # Teardown with both graphs alive: shutdown must release them first.
    started = time.monotonic()
    distributed.shutdown(timeout=90)
    shutdown_s = time.monotonic() - started
    try:
        steps[0](batches[0])
        after_release = "no error"
    except graphed.GraphedError as error:
        after_release = str(error)
    return {"runs": runs, "shutdown_s": shutdown_s, "step_after_shutdown": after_release,
            "released": [s.released for s in steps]}


def scenario_make_graphed_callables() -> Dict[str, Any]:
    base = base_model()
    batches = rank_batches(STEPS)
    index = torch.cuda.current_device()
    eager = DistributedDataParallel(copy.deepcopy(base), device_ids=[index])
    eager_losses = eager_ddp_losses(eager, torch.optim.AdamW(eager.parameters(), lr=LR), batches)

    # A DDP built the usual way keeps its gradient accumulators on the default
    # stream, which graphing refuses with the fix (checked below); prepare_ddp
    # builds it on graphed's capture stream.
    plain = DistributedDataParallel(copy.deepcopy(base), device_ids=[index])
    refused = refusal(lambda: graphed.make_graphed_callables(plain, (batches[0][0],)))
    model = distributed.prepare_ddp(copy.deepcopy(base))
    initial = [p.detach().clone() for p in model.parameters()]
    graphed_model = graphed.make_graphed_callables(model, (batches[0][0],))
    losses = eager_ddp_losses(graphed_model, torch.optim.AdamW(model.parameters(), lr=LR),
                              batches)
    result = compare("make_graphed_callables", losses, eager_losses, model, eager, initial)
    result["returned_the_ddp_model"] = graphed_model is model
    result["plain_ddp_refusal"] = refused
    started = time.monotonic()
    distributed.shutdown(timeout=90)
    return {"runs": [result], "shutdown_s": time.monotonic() - started}


def refusal(make: Callable[[], Any]) -> str:
    try:
        make()
    except graphed.GraphedError as error:
        return str(error)
    return "no error"


def scenario_refusals() -> Dict[str, Any]:
    """What TrainStep refuses under DDP, before any warm-up runs."""
    base = base_model()
    batch = rank_batches(1)[0]
    index = torch.cuda.current_device()
    plain = DistributedDataParallel(copy.deepcopy(base), device_ids=[index])
    weights = [p.detach().clone() for p in plain.parameters()]
    prepared = distributed.prepare_ddp(copy.deepcopy(base))

    def from_parts(model: nn.Module, **kwargs: Any) -> graphed.TrainStep:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        return graphed.TrainStep.from_parts(model, optimizer, workloads.gpt_loss, batch, **kwargs)

    messages = {
        "default_stream": refusal(lambda: from_parts(plain)),
        "short_warmup": refusal(lambda: from_parts(prepared, warmup=3)),
        "global_mode": refusal(lambda: from_parts(prepared, capture_error_mode="global")),
    }
    untouched = all(torch.equal(p, w) for p, w in zip(plain.parameters(), weights))
    distributed.shutdown(timeout=90)
    return {"messages": messages, "weights_untouched": untouched}


def nccl_kernels(run_step: Callable[[], Any]) -> List[str]:
    """The NCCL kernels one call of ``run_step`` (a replay) launches, named by
    the profiler."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run_step()
        torch.cuda.synchronize()
    return [e.name for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.name.startswith("nccl")]


def eager_fp8_ddp_losses(model: nn.Module, optimizer: torch.optim.Optimizer,
                         batches: List[Batch], microbatches: int) -> torch.Tensor:
    """The iteration TrainStep.from_parts(..., amp="bf16", microbatches=N)
    captures, written out: update_scales once, after the last backward."""
    losses = []
    for tokens, targets in batches:
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device="cuda")
        for x, y in zip(tokens.chunk(microbatches), targets.chunk(microbatches)):
            with torch.autocast("cuda", torch.bfloat16, cache_enabled=False):
                loss = workloads.gpt_loss(model(x), y)
            loss = loss.float() / microbatches
            loss.backward()
            total = total + loss.detach()
        fp8.update_scales(model)
        optimizer.step()
        losses.append(total)
    return torch.stack(losses)


def scenario_fp8() -> Dict[str, Any]:
    """The GPT converted to FP8 (delayed scaling) under DDP, two microbatches
    per step: TrainStep against the eager FP8 DDP loop; the ranks' scaling
    state equal (one all_reduce(MAX) of every layer's amax per step, after
    the last backward); the NCCL kernels of a replay counted against those of
    the same model graphed in bf16."""
    microbatches = 2
    base = base_model()
    batches = rank_batches(STEPS)
    index = torch.cuda.current_device()
    eager = DistributedDataParallel(fp8.convert(copy.deepcopy(base)), device_ids=[index])
    eager_optimizer = graphed.make_capturable(torch.optim.AdamW(eager.parameters(), lr=LR))
    eager_losses = eager_fp8_ddp_losses(eager, eager_optimizer, batches, microbatches)

    model = distributed.prepare_ddp(fp8.convert(copy.deepcopy(base)))
    initial = [p.detach().clone() for p in model.parameters()]
    step = graphed.TrainStep.from_parts(model, torch.optim.AdamW(model.parameters(), lr=LR),
                                        workloads.gpt_loss, batches[0], amp="bf16",
                                        microbatches=microbatches)
    losses = torch.stack([step(batch) for batch in batches])
    result = compare("trainstep fp8 microbatches=2", losses, eager_losses, model, eager, initial)

    state_names = fp8.state_buffer_names(model.module)
    # Every layer's history slot is one tensor: named_buffers would list it once.
    buffers = dict(model.module.named_buffers(remove_duplicate=False))
    eager_buffers = dict(eager.module.named_buffers(remove_duplicate=False))
    state = torch.cat([buffers[n].detach().float().flatten() for n in state_names])
    gathered = [torch.empty_like(state) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, state)
    result["fp8_state_buffers"] = len(state_names)
    result["fp8_state_ranks_agree"] = all(torch.equal(gathered[0], g) for g in gathered)
    result["fp8_state_equals_eager"] = all(torch.equal(buffers[n], eager_buffers[n])
                                           for n in state_names)
    result["fp8_scales_moved"] = any(
        not torch.all(buffers[n] == 1) for n in state_names if n.endswith("fp8_scale"))

    bf16_model = distributed.prepare_ddp(copy.deepcopy(base))
    bf16_step = graphed.TrainStep.from_parts(
        bf16_model, torch.optim.AdamW(bf16_model.parameters(), lr=LR), workloads.gpt_loss,
        batches[0], amp="bf16", microbatches=microbatches)
    result["nccl_kernels_fp8"] = nccl_kernels(lambda: step(batches[1]))
    result["nccl_kernels_bf16"] = nccl_kernels(lambda: bf16_step(batches[1]))
    started = time.monotonic()
    distributed.shutdown(timeout=90)
    return {"runs": [result], "shutdown_s": time.monotonic() - started}


SCENARIOS = {
    "fp8": scenario_fp8,
    "trainstep": scenario_trainstep,
    "make_graphed_callables": scenario_make_graphed_callables,
    "refusals": scenario_refusals,
}


def main() -> int:
    scenario, out = sys.argv[1], sys.argv[2]
    result: Dict[str, Any] = {"scenario": scenario}
    status = 0
    try:
        distributed.init_process_group(nvlink_multicast=False)
        result["rank"] = dist.get_rank()
        result["device"] = torch.cuda.current_device()
        # fp32 throughout, and the deterministic attention kernels: graphed and
        # eager must agree to 1e-6 after 20 Adam steps.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        with sdpa_kernel(SDPBackend.MATH):
            result.update(SCENARIOS[scenario]())
    except BaseException:  # reported to the test, which fails with it
        result["error"] = traceback.format_exc()
        status = 1
    with open(out, "w") as file:
        json.dump(result, file, indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main())
