"""graphed.distributed without a GPU: a world of one process over gloo shows
what TrainStep refuses under DistributedDataParallel, and why, before any
capture; the settings init_process_group applies; teardown; and how DDP
wrappers are taken apart for make_graphed_callables."""

import os

import pytest
import torch
from torch import nn

import graphed
from graphed import distributed

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="this torch build has no torch.distributed")

_NCCL_VARIABLES = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING",
                   "TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")


@pytest.fixture
def clean_environment(monkeypatch):
    for name in _NCCL_VARIABLES + tuple(distributed.NVLINK_MULTICAST_OFF):
        # setenv first, so that the variable is restored (or removed) afterwards
        # even when the test's code sets it.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(distributed, "_environment_at_init", None)
    return monkeypatch


@pytest.fixture
def gloo_world(tmp_path, clean_environment):
    """A process group of one rank over gloo, created by graphed."""
    distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                                   world_size=1)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def ddp(module=None, **kwargs):
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(module or nn.Linear(4, 2), **kwargs)


def test_the_warmup_rule_comes_from_the_core():
    assert distributed.COLLECTIVE_WARMUP_ITERS == 11
    assert distributed.COLLECTIVE_CAPTURE_ERROR_MODE == "thread_local"


def test_init_sets_the_capture_environment_and_keeps_the_users(tmp_path, clean_environment):
    clean_environment.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                                   world_size=1, nvlink_multicast=False)
    try:
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
        for name, value in distributed.NVLINK_MULTICAST_OFF.items():
            assert os.environ[name] == value
        # What NCCL would have read at init is what the checks look at.
        clean_environment.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        problems = distributed._nccl_environment_problems()
        assert len(problems) == 1 and "TORCH_NCCL_BLOCKING_WAIT=1" in problems[0]
        with pytest.raises(graphed.GraphedError, match="already exists"):
            distributed.init_process_group("gloo")
    finally:
        torch.distributed.destroy_process_group()


def test_nccl_environment_problems_name_the_variable_and_the_fix(clean_environment):
    problems = distributed._nccl_environment_problems()
    assert len(problems) == 1
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING is unset" in problems[0]
    assert "graphed.distributed.init_process_group()" in problems[0]
    clean_environment.setenv("NCCL_ASYNC_ERROR_HANDLING", "1")  # the old name counts too
    assert "NCCL_ASYNC_ERROR_HANDLING is '1'" in distributed._nccl_environment_problems()[0]
    clean_environment.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")  # the new name wins
    assert distributed._nccl_environment_problems() == []
    clean_environment.setenv("NCCL_BLOCKING_WAIT", "true")
    assert "NCCL_BLOCKING_WAIT=true" in distributed._nccl_environment_problems()[0]


def test_check_ddp_names_backend_and_device(gloo_world):
    problems = distributed.check_ddp(ddp())
    assert any("'gloo' backend" in p and "backend='nccl'" in p for p in problems), problems
    assert any("parameters are on cpu" in p for p in problems), problems
    assert distributed.check_ddp(nn.Linear(2, 2)) == [
        "Expected a DistributedDataParallel model, got Linear."]


@pytest.mark.filterwarnings("ignore:You passed find_unused_parameters=true:UserWarning")
def test_unused_parameter_search_and_no_sync_are_refused(gloo_world):
    searching = ddp(find_unused_parameters=True)
    assert any("find_unused_parameters=True" in p for p in distributed.check_ddp(searching))
    static = ddp(find_unused_parameters=True, static_graph=True)
    assert not any("find_unused_parameters" in p for p in distributed.check_ddp(static))
    model = ddp()
    with model.no_sync():
        assert any("no_sync()" in p for p in distributed.check_ddp(model))
    assert not any("no_sync()" in p for p in distributed.check_ddp(model))


def test_trainstep_lists_every_ddp_problem_before_touching_anything(gloo_world):
    model = ddp(find_unused_parameters=True)
    weight = model.module.weight.detach().clone()
    optimizer = torch.optim.AdamW(model.parameters())
    batch = (torch.ones(3, 4), torch.ones(3, 2))
    with pytest.raises(graphed.GraphedError) as raised:
        graphed.TrainStep.from_parts(model, optimizer, nn.functional.mse_loss, batch)
    message = str(raised.value)
    assert message.startswith("Cannot capture DistributedDataParallel's all-reduces:\n  1. ")
    for needle in ("'gloo' backend", "find_unused_parameters=True", "parameters are on cpu"):
        assert needle in message
    assert torch.equal(model.module.weight, weight)
    assert not optimizer.state  # refused before the optimizer was made capturable

    def iteration(batch):
        return nn.functional.mse_loss(model(batch[0]), batch[1])
    with pytest.raises(graphed.GraphedError, match="'gloo' backend"):
        graphed.TrainStep(iteration, batch, modules=[model], optimizers=[optimizer])


def test_ddp_inside_a_container_is_found(gloo_world):
    inner = ddp()
    outer = nn.Sequential(inner)
    assert distributed.find_ddp([outer, inner]) == [inner]
    assert distributed.find_ddp([nn.Linear(2, 2)]) == []
    assert distributed.collective_capture([nn.Linear(2, 2)]) is None


def test_prepare_ddp_needs_the_model_on_its_gpu(gloo_world):
    with pytest.raises(graphed.GraphedError, match=r"on this rank's GPU, found cpu"):
        distributed.prepare_ddp(nn.Linear(2, 2))


def test_prepare_ddp_needs_a_process_group():
    assert not torch.distributed.is_initialized()
    with pytest.raises(graphed.GraphedError, match="init_process_group"):
        distributed.prepare_ddp(nn.Linear(2, 2))


def test_shutdown_destroys_the_process_group(gloo_world):
    distributed.shutdown(timeout=30)
    assert not torch.distributed.is_initialized()
    distributed.shutdown()  # nothing left to do


def test_split_ddp_graphs_the_wrapped_module_and_rewraps_it(gloo_world):
    model = ddp()
    fn = torch.sin
    inner, rewrap = distributed.split_ddp((model, fn))
    assert inner == (model.module, fn)
    # make_graphed_callables that patches the module in place returns it.
    assert rewrap((model.module, fn)) == (model, fn)
    # One that returns a new module over the same parameters replaces the wrapped one.
    holder = nn.Sequential(model.module)
    assert rewrap((holder, fn))[0] is model and model.module is holder
    with pytest.raises(graphed.GraphedError, match="does not own the parameters"):
        rewrap((nn.Linear(4, 2), fn))

    single, rewrap_single = distributed.split_ddp(model)
    assert single is model.module and rewrap_single(single) is model
    plain, rewrap_plain = distributed.split_ddp(fn)
    assert plain is fn and rewrap_plain(fn) is fn


def _float8_mlp():
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    return graphed.fp8.convert(model, graphed.fp8.Recipe(emulate=True))


def _float8_mlp_without_marks():
    """As if converted after wrapping: DDP would broadcast the FP8 state."""
    model = _float8_mlp()
    del model._ddp_params_and_buffers_to_ignore
    return model


def test_fp8_state_is_left_out_of_ddps_buffer_broadcast(gloo_world):
    # Note [FP8 state is not DDP's to broadcast]: convert() marks the buffers,
    # so a DDP built afterwards neither broadcasts them nor is refused.
    model = ddp(_float8_mlp())
    state = graphed.fp8.state_buffer_names(model.module)
    assert len(state) == 12 and "0.fp8_amax" in state and "2.fp8_scale_inv" in state
    assert set(state) <= model.parameters_to_ignore
    model._assign_modules_buffers()  # DDP's own list of the buffers it broadcasts
    fp8_buffers = {id(b) for n, b in model.module.named_buffers() if n in state}
    assert fp8_buffers and not fp8_buffers & {id(b) for b in model.modules_buffers}
    assert not any("FP8 scaling buffers" in p for p in distributed.check_ddp(model))


def test_a_ddp_that_broadcasts_fp8_state_is_refused_with_the_fix(gloo_world):
    broadcasting = ddp(_float8_mlp_without_marks())
    problems = [p for p in distributed.check_ddp(broadcasting) if "FP8 scaling buffers" in p]
    assert len(problems) == 1 and "keep_state_out_of_ddp" in problems[0], problems
    quiet = ddp(_float8_mlp_without_marks())
    quiet.broadcast_buffers = False  # a property over forward_sync_buffers on newer torch
    assert not any("FP8 scaling buffers" in p for p in distributed.check_ddp(quiet))

