"""One rank of the FSDP2 tests (test_fsdp2_gpu.py): ``python fsdp2_worker.py
SCENARIO OUT.json`` with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT set. Writes what it measured to OUT.json; the test asserts on it.
Exits 1 (with the traceback in OUT.json) when the scenario raised."""

from __future__ import annotations

import copy
import json
import sys
import time
import traceback
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

import graphed
from graphed import distributed, fsdp, workloads

from ddp_worker import refusal  # the worker scripts share a directory

STEPS = 10
LR = 1e-3
VOCAB, LENGTH, BATCH = 4096, 128, 8
# Losses and weights of graphed and eager FSDP2 must agree this closely (fp32).
TOLERANCE = 1e-5

Batch = Tuple[torch.Tensor, torch.Tensor]


def base_model() -> nn.Module:
    """The gpt_train model, identical on every rank (seed 0), not sharded."""
    torch.manual_seed(0)
    return workloads.GPT(vocab=VOCAB, context=LENGTH).cuda()


def shard(base: nn.Module, **block_kwargs: Any) -> nn.Module:
    """A copy of ``base`` with fully_shard on every block, then on the whole
    model (the root keeps the embeddings, final norm and head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    model = copy.deepcopy(base)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **block_kwargs)
    fully_shard(model, mesh=mesh)
    return model


def rank_batches(count: int) -> List[Batch]:
    generator = torch.Generator(device="cuda").manual_seed(1000 + dist.get_rank())
    return [tuple(torch.randint(0, VOCAB, (BATCH, LENGTH), device="cuda", generator=generator)
                  for _ in range(2)) for _ in range(count)]


def optimizer_of(model: nn.Module) -> torch.optim.Optimizer:
    # make_capturable on the eager one too, so that both run the same fused
    # AdamW with a device learning rate: the comparison is graph vs eager.
    return graphed.make_capturable(torch.optim.AdamW(model.parameters(), lr=LR))


def eager_losses(model: nn.Module, optimizer: torch.optim.Optimizer,
                 batches: List[Batch]) -> torch.Tensor:
    losses = []
    for tokens, targets in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = workloads.gpt_loss(model(tokens), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def local(model: nn.Module) -> List[torch.Tensor]:
    return [p._local_tensor.detach().clone() for p in model.parameters()]


def full(model: nn.Module) -> List[torch.Tensor]:
    """Every parameter gathered whole (a collective on every rank)."""
    return [p.full_tensor().detach() for p in model.parameters()]


def compare(name: str, losses: torch.Tensor, reference: torch.Tensor, model: nn.Module,
            eager_model: nn.Module, initial: List[torch.Tensor]) -> Dict[str, Any]:
    params, eager_params = full(model), full(eager_model)
    return {
        "name": name,
        "losses": losses.tolist(),
        "eager_losses": reference.tolist(),
        "loss_max_rel_diff": ((losses - reference).abs() / reference.abs()).max().item(),
        "weight_max_abs_diff": max((p - q).abs().max().item()
                                   for p, q in zip(params, eager_params)),
        "weights_close": all(torch.allclose(p, q, rtol=TOLERANCE, atol=TOLERANCE)
                             for p, q in zip(params, eager_params)),
        "weights_moved": max((p - w).abs().max().item() for p, w in zip(local(model), initial)),
    }


CONFIGS: Dict[str, Dict[str, Any]] = {
    "default": {},
    "reshard_after_forward=False": {"reshard_after_forward": False},
}


def trainstep_run(base: nn.Module, batches: List[Batch], config: str
                  ) -> Tuple[Dict[str, Any], graphed.TrainStep]:
    kwargs = CONFIGS[config]
    eager = shard(base, **kwargs)
    eager_optimizer = optimizer_of(eager)
    reference = eager_losses(eager, eager_optimizer, batches)

    model = shard(base, **kwargs)
    initial = local(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    step = graphed.TrainStep.from_parts(model, optimizer, workloads.gpt_loss, batches[0])
    unchanged = all(torch.equal(p, w) for p, w in zip(local(model), initial))
    state_untouched = all(torch.count_nonzero(v).item() == 0
                          for s in optimizer.state.values() for k, v in s.items()
                          if k in ("exp_avg", "exp_avg_sq"))
    losses = torch.stack([step(batch) for batch in batches])
    result = compare(f"trainstep {config}", losses, reference, model, eager, initial)
    result["capture_changed_nothing"] = unchanged and state_untouched
    result["grads_are_dtensors"] = all(type(p.grad).__name__ == "DTensor"
                                       for p in model.parameters())
    # An eager evaluation forward between steps leaves the root unsharded;
    # the next step() reshards it first, and training goes on as eager's.
    with torch.no_grad():
        evaluated = model(batches[0][0])
        eager_evaluated = eager(batches[0][0])
    result["eval_between_steps_matches"] = torch.allclose(evaluated, eager_evaluated,
                                                          rtol=TOLERANCE, atol=TOLERANCE)
    later = torch.stack([step(batch) for batch in batches[:2]])
    eager_later = eager_losses(eager, eager_optimizer, batches[:2])
    result["later_loss_max_rel_diff"] = ((later - eager_later).abs()
                                         / eager_later.abs()).max().item()
    result["steps"] = step.stats()["steps"]
    return result, step


def scenario_trainstep() -> Dict[str, Any]:
    base = base_model()
    batches = rank_batches(STEPS)
    runs, steps = [], []
    for config in CONFIGS:
        result, step = trainstep_run(base, batches, config)
        runs.append(result)
        steps.append(step)
    # Teardown with the graphs alive: shutdown must release them first.
    started = time.monotonic()
    distributed.shutdown(timeout=90)
    shutdown_s = time.monotonic() - started
    return {"runs": runs, "shutdown_s": shutdown_s,
            "released": [step.released for step in steps]}


def scenario_refusals() -> Dict[str, Any]:
    from torch.distributed.fsdp import CPUOffloadPolicy
    base = base_model()
    batch = rank_batches(1)[0]
    messages: Dict[str, str] = {}
    untouched = []

    def attempt(name: str, model: nn.Module, **from_parts: Any) -> None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        before = local(model)
        messages[name] = refusal(lambda: graphed.TrainStep.from_parts(
            model, optimizer, workloads.gpt_loss, batch, **from_parts))
        untouched.append(all(torch.equal(p, w) for p, w in zip(local(model), before)))

    model = shard(base)
    model.set_reshard_after_forward(True, recurse=False)
    attempt("root_reshards", model)
    model = shard(base)
    model.set_requires_gradient_sync(False)
    attempt("no_gradient_sync", model)
    model = shard(base)
    model.set_reshard_after_backward(False)
    attempt("no_reshard_after_backward", model)
    attempt("clip", shard(base), clip_grad_norm=1.0)
    # CPU offload needs the model on the CPU when it is sharded.
    offloaded = copy.deepcopy(base).cpu()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    for block in offloaded.blocks:
        fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(offloaded, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    messages["cpu_offload"] = refusal(lambda: graphed.TrainStep.from_parts(
        offloaded, torch.optim.AdamW(offloaded.parameters(), lr=LR), workloads.gpt_loss, batch))
    return {"messages": messages, "weights_untouched": all(untouched)}


def scenario_capture_failure() -> Dict[str, Any]:
    """A capture that fails after warm-up (a host sync in the loss) leaves the
    model, the optimizer and FSDP2 as they were: eager training afterwards
    equals eager training of a fresh copy."""
    base = base_model()
    batches = rank_batches(4)
    model = shard(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    before = local(model)

    def syncing_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = workloads.gpt_loss(logits, targets)
        return loss * (1.0 if loss.item() > -1 else 2.0)  # .item(): no graph can hold it

    error = refusal(lambda: graphed.TrainStep.from_parts(model, optimizer, syncing_loss,
                                                         batches[0]))
    torch.cuda.synchronize()
    weights_untouched = all(torch.equal(p, w) for p, w in zip(local(model), before))
    state_zero = all(torch.count_nonzero(v).item() == 0
                     for s in optimizer.state.values() for k, v in s.items()
                     if k in ("exp_avg", "exp_avg_sq", "step"))
    groups = [g for s in model._get_fsdp_state()._state_ctx.all_states
              for g in fsdp.param_groups(s)]
    fsdp_idle = all(g.is_sharded and g._training_state.name == "IDLE" for g in groups)
    losses = eager_losses(model, optimizer, batches)
    fresh = shard(base)
    reference = eager_losses(fresh, optimizer_of(fresh), batches)
    return {"message": error, "weights_untouched": weights_untouched,
            "optimizer_state_zero": state_zero, "fsdp_idle_and_sharded": fsdp_idle,
            "eager_after_failure_matches": torch.allclose(losses, reference, rtol=TOLERANCE,
                                                           atol=0)}


def main() -> int:
    scenario, out = sys.argv[1], sys.argv[2]
    result: Dict[str, Any] = {}
    try:
        distributed.init_process_group("nccl", nvlink_multicast=False)
        result["rank"] = dist.get_rank()
        result["device"] = torch.cuda.current_device()
        workloads_run = {"trainstep": scenario_trainstep, "refusals": scenario_refusals,
                         "capture_failure": scenario_capture_failure}[scenario]
        result.update(workloads_run())
        if dist.is_initialized():
            distributed.shutdown(timeout=90)
    except BaseException:
        result["error"] = traceback.format_exc()
        traceback.print_exc()
        with open(out, "w") as f:
            json.dump(result, f)
        return 1
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
