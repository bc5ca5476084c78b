"""graphed.fsdp without a GPU: FSDP2 (fully_shard) runs on the CPU over gloo
in a world of one process, which shows what TrainStep refuses under FSDP2,
and why, before any warm-up; that the pieces prepare_capture relies on hold
in eager FSDP2 (lazy initialisation, fresh unsharded Parameters, resharding
after an evaluation forward); and how DTensors are handed to the core as
their local shards. The captured step itself is tested on the GPU
(test_fsdp2_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphed
from graphed import distributed, fsdp

pytestmark = pytest.mark.skipif(not fsdp.available(),
                                reason="this torch build has no FSDP2 (fully_shard)")

_NCCL_VARIABLES = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING",
                   "TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")


@pytest.fixture
def mesh(tmp_path, monkeypatch):
    """A CPU device mesh over a gloo process group of one rank."""
    for name in _NCCL_VARIABLES:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(distributed, "_environment_at_init", None)
    from torch.distributed.device_mesh import init_device_mesh
    distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                                   world_size=1)
    yield init_device_mesh("cpu", (1,))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def plain_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(),
                         nn.Linear(8, 4))


def sharded(mesh, model=None, *, root=True, **kwargs) -> nn.Module:
    """fully_shard on the two hidden Linears and (with ``root``) on the whole
    model, which then owns the last Linear's parameters itself."""
    from torch.distributed.fsdp import fully_shard
    model = model or plain_model()
    fully_shard(model[0], mesh=mesh, **kwargs)
    fully_shard(model[2], mesh=mesh, **kwargs)
    if root:
        fully_shard(model, mesh=mesh)
    return model


def eager_steps(model: nn.Module, steps: int, between=None) -> list:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for i in range(steps):
        x = torch.randn(4, 8, generator=generator)
        y = torch.randn(4, 4, generator=generator)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if between is not None:
            between(i)
    return losses


CPU_PROBLEM = "FSDP2's parameters are on cpu; a captured step needs them on one GPU"


def only_cpu(problems):
    assert len(problems) == 1 and problems[0].startswith(CPU_PROBLEM), problems


def test_find_fsdp2_lists_the_sharded_modules_outermost_first(mesh):
    model = sharded(mesh)
    assert fsdp.find_fsdp2([model]) == [model, model[0], model[2]]
    assert fsdp.find_fsdp2([plain_model()]) == []
    assert fsdp.world_size(model) == 1


def test_check_wants_a_sharded_root(mesh):
    problems = fsdp.check_fsdp2(plain_model())
    assert problems == ["Expected a model sharded with fully_shard (an FSDPModule), got "
                        "Sequential."]
    blocks_only = sharded(mesh, root=False)
    (problem,) = fsdp.check_fsdp2(blocks_only)
    assert problem.startswith("Expected fully_shard on the whole Sequential too, found it only "
                              "on submodules (0, 2)")
    assert "fully_shard(model)" in problem


def test_the_default_configuration_is_refused_only_for_the_cpu(mesh):
    only_cpu(fsdp.check_fsdp2(sharded(mesh)))
    only_cpu(fsdp.check_fsdp2(sharded(mesh, reshard_after_forward=False)))
    from torch.distributed.fsdp import MixedPrecisionPolicy
    only_cpu(fsdp.check_fsdp2(sharded(mesh, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32))))
    model = sharded(mesh)
    model.set_unshard_in_backward(False)
    model.set_gradient_divide_factor(2.0)
    only_cpu(fsdp.check_fsdp2(model))
    # After an eager step everything is sharded again, and nothing is pending.
    eager_steps(model, 2)
    only_cpu(fsdp.check_fsdp2(model))


@pytest.mark.parametrize("setting, expected", [
    (lambda m: m.set_reshard_after_forward(True, recurse=False),
     "The root Sequential reshards its parameters after forward"),
    (lambda m: m.set_requires_gradient_sync(False),
     "Gradient reduction is off for `0` (set_requires_gradient_sync(False))"),
    (lambda m: m.set_reshard_after_backward(False),
     "`0` keeps its parameters unsharded after backward"),
    (lambda m: m.set_is_last_backward(False), "set_is_last_backward(False) is in effect"),
    (lambda m: m.set_post_optim_event(object()), "A post-optimizer event is set"),
])
def test_settings_a_capture_cannot_keep_are_refused_with_the_fix(mesh, setting, expected):
    model = sharded(mesh)
    setting(model)
    problems = fsdp.check_fsdp2(model)
    assert any(p.startswith(expected) for p in problems), problems
    assert problems[-1].startswith(CPU_PROBLEM)


def test_cpu_offload_is_refused(mesh):
    from torch.distributed.fsdp import CPUOffloadPolicy
    model = sharded(mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    problems = fsdp.check_fsdp2(model)
    assert [p for p in problems if "CPUOffloadPolicy" in p][0].startswith(
        "FSDP2 offloads `0`'s parameters to the CPU (CPUOffloadPolicy)")


def test_unsharded_parameters_are_refused_and_prepare_reshards_them(mesh):
    model = sharded(mesh)
    with torch.no_grad():
        model(torch.randn(2, 8))  # evaluation: the root keeps its parameters unsharded
    root_group = fsdp.param_groups(model._get_fsdp_state())[0]
    assert not root_group.is_sharded
    problems = fsdp.check_fsdp2(model)
    assert problems[0].startswith("`Sequential`'s parameters are unsharded"), problems
    with pytest.raises(graphed.GraphedError, match=CPU_PROBLEM.replace("(", r"\(")) as error:
        fsdp.prepare_capture([model])
    assert "unsharded" not in str(error.value)
    assert root_group.is_sharded
    assert type(model[4].weight).__name__ == "DTensor"


def test_at_several_ranks_nccl_and_its_environment_are_required(mesh, monkeypatch):
    model = sharded(mesh)
    monkeypatch.setattr(fsdp, "_world_size", lambda group: 2)
    # As if the process group had been made without graphed's settings.
    monkeypatch.setattr(distributed, "_environment_at_init", {})
    problems = fsdp.check_fsdp2(model, error_mode="global")
    text = "\n".join(problems)
    assert "shards over a process group with the 'gloo' backend" in text
    assert "NCCL's asynchronous error handling is on" in text
    assert "when FSDP2's collectives are captured" in text
    assert 'capture_error_mode="thread_local"' in text
    assert fsdp.world_size(model) == 2


def test_prepare_capture_raises_every_problem_before_any_work(mesh):
    assert fsdp.prepare_capture([plain_model()]) is None
    model = sharded(mesh)
    model.set_requires_gradient_sync(False)
    with pytest.raises(graphed.GraphedError) as error:
        fsdp.prepare_capture([model])
    message = str(error.value)
    assert message.startswith("Cannot capture FSDP2's all-gathers and reduce-scatters:\n  1. ")
    assert "set_requires_gradient_sync(True)" in message and CPU_PROBLEM in message
    # Refused before the lazy initialisation a forward would run.
    assert model._get_fsdp_state()._is_root is None


def test_train_step_refuses_an_fsdp2_model_it_cannot_capture_and_trains_nothing(mesh):
    model = sharded(mesh)
    before = [p._local_tensor.clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = (torch.randn(4, 8), torch.randn(4, 4))
    with pytest.raises(graphed.GraphedError, match="Cannot capture FSDP2's"):
        graphed.TrainStep.from_parts(model, optimizer, nn.functional.mse_loss, batch)
    with pytest.raises(graphed.GraphedError,
                       match=r"clip_grad_norm, skip_nonfinite under FSDP2 is not supported yet"):
        graphed.TrainStep.from_parts(model, optimizer, nn.functional.mse_loss, batch,
                                     clip_grad_norm=1.0, skip_nonfinite=True)
    assert all(torch.equal(p._local_tensor, b) for p, b in zip(model.parameters(), before))
    assert not optimizer.state


def test_step_settings_graphed_does_not_support_under_fsdp2_yet():
    assert fsdp.check_step_settings(clip_grad_norm=None, skip_nonfinite=False, amp="bf16",
                                    loss_scaling=None, float8=False) == []
    (problem,) = fsdp.check_step_settings(clip_grad_norm=None, skip_nonfinite=False,
                                          amp="fp16", loss_scaling=None, float8=False)
    assert problem.startswith('amp="fp16" under FSDP2 is not supported yet')
    problems = fsdp.check_step_settings(clip_grad_norm=None, skip_nonfinite=False, amp=None,
                                        loss_scaling=None, float8=True)
    assert problems[0].startswith("graphed.fp8 layers under FSDP2 are not supported yet")


def test_optimize_and_auto_refuse_fsdp2_models(mesh):
    model = sharded(mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = (torch.randn(4, 8), torch.randn(4, 4))
    with pytest.raises(graphed.GraphedError, match="graphed.optimize does not take a model "
                       "sharded with fully_shard"):
        graphed.optimize(model, optimizer, nn.functional.mse_loss, sample_batch=batch)
    with pytest.raises(graphed.GraphedError, match="graphed.auto does not take a model sharded "
                       "with fully_shard"):
        graphed.auto(model)
    assert "TrainStep.from_parts" in str(pytest.raises(
        graphed.GraphedError, graphed.auto, model).value)


def test_fresh_unsharded_parameters_train_as_before(mesh):
    """Dropping FSDP2's unsharded Parameters between steps (prepare_capture
    does, Note [FSDP2 inside a captured step], point 4) makes FSDP2 create
    new ones at the next unshard and changes no loss or weight."""
    reference = sharded(mesh)
    expected = eager_steps(reference, 4)
    model = sharded(mesh)
    states = model._get_fsdp_state()
    replaced = []

    def drop(i):
        fsdp_param = fsdp.param_groups(model[0]._get_fsdp_state())[0].fsdp_params[0]
        replaced.append(fsdp_param._unsharded_param)
        fsdp._drop_unsharded_parameters(states._state_ctx.all_states)
        assert not hasattr(fsdp_param, "_unsharded_param")

    assert eager_steps(model, 4, between=drop) == expected
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p._local_tensor, q._local_tensor)
    assert len({id(p) for p in replaced}) == 4, "FSDP2 did not make new unsharded Parameters"


def test_prepare_capture_runs_the_lazy_init_first(mesh, monkeypatch):
    model = sharded(mesh)
    monkeypatch.setattr(fsdp, "check_fsdp2", lambda module, error_mode=None: [])
    capture = fsdp.prepare_capture([model])
    assert capture.roots == [model] and capture.world_size == 1
    state = model._get_fsdp_state()
    assert state._is_root is True
    assert [s._is_root for s in state._state_ctx.all_states] == [True, False, False]
    # The streams FSDP2's first forward would create exist.
    assert hasattr(state._comm_ctx, "reduce_scatter_stream")


def test_dtensors_reach_the_core_as_their_local_shards(mesh):
    model = sharded(mesh)
    eager_steps(model, 1)
    params = list(model.parameters())
    grads = [p.grad for p in params]
    tensors = params + grads + [None, params[0]]
    local = fsdp.local_tensors(tensors)
    assert len(local) == 2 * len(params)
    assert all(type(t) is torch.Tensor for t in local)
    assert local[0] is params[0]._local_tensor and local[len(params)] is grads[0]._local_tensor
    buffered = nn.BatchNorm1d(4)
    dicts = fsdp.tensor_dicts([model[0], buffered])
    assert dicts[0] == {"weight": model[0].weight._local_tensor,
                        "bias": model[0].bias._local_tensor}
    assert dicts[1] is buffered._parameters  # no DTensors: the live dict
    assert dicts[2] is model[0]._buffers and dicts[3] is buffered._buffers


def test_capture_eval_is_refused_under_fsdp2():
    step = graphed.TrainStep.__new__(graphed.TrainStep)
    step._fsdp_groups = [object()]
    with pytest.raises(graphed.GraphedError, match="capture_eval is not supported under FSDP2"):
        step.capture_eval(lambda x: x, torch.zeros(1))


class Failing(nn.Module):
    """Raises in forward while ``fail`` is set (a capture failing mid-step)."""

    def __init__(self):
        super().__init__()
        self.fail = False

    def forward(self, x):
        if self.fail:
            raise RuntimeError("failed mid-forward")
        return x


def test_reset_after_failure_leaves_fsdp2_as_after_a_finished_step(mesh):
    def model_with_failing_block():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), Failing(),
                              nn.Linear(8, 4))
        return sharded(mesh, model)

    reference = model_with_failing_block()
    expected = eager_steps(reference, 3)
    model = model_with_failing_block()
    model[3].fail = True
    with pytest.raises(RuntimeError, match="failed mid-forward"):
        model(torch.randn(2, 8)).sum().backward()
    states = model._get_fsdp_state()._state_ctx.all_states
    assert any(g._training_state.name != "IDLE" or not g.is_sharded
               for s in states for g in fsdp.param_groups(s)), "nothing to reset"
    fsdp.reset_after_failure(fsdp.FSDP2Capture(roots=[model]))
    for state in states:
        assert state._training_state.name == "IDLE"
        for group in fsdp.param_groups(state):
            assert group.is_sharded and group._training_state.name == "IDLE"
            assert group._all_gather_result is None
    assert all(type(p).__name__ == "DTensor" for p in model.parameters())
    only_cpu(fsdp.check_fsdp2(model))
    model[3].fail = False
    assert eager_steps(model, 3) == expected


def test_make_capturable_steps_the_dtensor_shards_as_torchs_fused_adamw(mesh, monkeypatch):
    """The optimizer of a captured FSDP2 step stays on the DTensor shards
    (Note [FSDP2 inside a captured step], point 9): graphed's capturable
    AdamW (fused, device learning rate, pre-made state) trains them as
    torch's fused AdamW does. On the CPU here, so the GPU check is skipped."""
    from graphed import train
    monkeypatch.setattr(train, "_device_of", lambda optimizer: torch.device("cpu"))
    reference = sharded(mesh)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    model = sharded(mesh)
    optimizer = graphed.make_capturable(torch.optim.AdamW(model.parameters(), lr=1e-2))
    state = optimizer.state[next(model.parameters())]
    assert type(state["exp_avg"]).__name__ == "DTensor" and type(state["step"]) is torch.Tensor
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    for net, opt in ((reference, reference_optimizer), (model, optimizer)):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
    moved = False
    for p, q, w in zip(model.parameters(), reference.parameters(), sharded(mesh).parameters()):
        assert torch.equal(p._local_tensor, q._local_tensor)
        moved = moved or not torch.equal(p._local_tensor, w._local_tensor)
    assert moved
    tensors = train.training_state([model], [optimizer])
    local = fsdp.local_tensors(tensors)
    assert len(local) == len(tensors) and all(type(t) is torch.Tensor for t in local)
