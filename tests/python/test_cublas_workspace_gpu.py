"""Graphs keep working when PyTorch frees its cuBLAS workspaces (Note [cuBLAS
workspaces of captured graphs]): torch._C._cuda_clearCublasWorkspaces() (what
torch.compile's cudagraph trees call around every recording), a
torch.compile(mode="reduce-overhead") model recorded after the capture, and
another graphed graph destroyed (torch 2.14 clears its capture stream's
workspaces then). Afterwards freed memory is handed to new tensors on the
capture stream and on the caller's stream; a replay must leave them untouched
and still match eager."""

import copy
import gc

import pytest
import torch

import graphed
from graphed import workloads

pytestmark = pytest.mark.gpu

SENTINEL = 7.0


@pytest.fixture
def tf32():
    """TF32 matmuls, as the benchmarks run: the cuBLASLt kernels chosen then
    use the workspace (measured on the H200)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    workloads.configure_numerics()
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def free_the_workspaces(how):
    if how == "clear":
        torch._C._cuda_clearCublasWorkspaces()
    elif how == "compile":
        torch.manual_seed(1)
        other = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU()).cuda()
        compiled = torch.compile(other, mode="reduce-overhead")
        with torch.no_grad():
            for _ in range(3):
                compiled(torch.randn(32, 512, device="cuda"))
        torch.cuda.synchronize()
    elif how == "destroy":
        torch.manual_seed(2)
        other = torch.nn.Linear(512, 512).cuda()
        with torch.no_grad():
            short_lived = graphed.capture(other, torch.randn(32, 512, device="cuda"))
        del short_lived
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def sentinels():
    """32 MiB tensors (a workspace's size) on the capture stream, where a freed
    workspace block is cached, and on the caller's stream."""
    tensors = []
    for stream in (graphed.capture_stream(), torch.cuda.current_stream()):
        with torch.cuda.stream(stream):
            tensors += [torch.full((8 << 20,), SENTINEL, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()
    return tensors


def overwritten(tensors):
    torch.cuda.synchronize()
    return sum(int((t != SENTINEL).sum().item()) for t in tensors)


@pytest.mark.usefixtures("tf32")
@pytest.mark.parametrize("how", ["clear", "compile", "destroy"])
def test_capture_survives_freed_cublas_workspaces(how):
    model, x = workloads.mlp_inference()
    inputs = [torch.randn_like(x) for _ in range(3)]
    with torch.no_grad():
        fast = graphed.capture(model, x)
        free_the_workspaces(how)
        guards = sentinels()
        for sample in inputs:
            got = fast(sample).clone()
            torch.testing.assert_close(got, model(sample), rtol=2e-3, atol=2e-3)
    assert overwritten(guards) == 0


@pytest.mark.usefixtures("tf32")
@pytest.mark.parametrize("how", ["clear", "compile"])
def test_train_step_survives_freed_cublas_workspaces(how):
    """The backward runs on autograd's device thread, whose cuBLAS handle has
    workspaces of its own."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                torch.nn.Linear(2048, 512)).cuda()
    reference = copy.deepcopy(model)
    batches = [(torch.randn(32, 512, device="cuda"), torch.randn(32, 512, device="cuda"))
               for _ in range(4)]
    loss_fn = torch.nn.functional.mse_loss

    def optimizer_of(module):
        return torch.optim.AdamW(module.parameters(), lr=1e-3, capturable=True)

    optimizer, reference_optimizer = optimizer_of(model), optimizer_of(reference)
    step = graphed.TrainStep.from_parts(model, optimizer, loss_fn, batches[0])
    free_the_workspaces(how)
    guards = sentinels()
    for batch in batches:
        loss = step(batch).item()
        reference_optimizer.zero_grad()
        expected = loss_fn(reference(batch[0]), batch[1])
        expected.backward()
        reference_optimizer.step()
        assert loss == pytest.approx(expected.item(), rel=1e-2)
    assert overwritten(guards) == 0
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-2, atol=1e-3)


def settle():
    gc.collect()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()  # PyTorch's own, not graphed's
    torch.cuda.empty_cache()


@pytest.mark.usefixtures("tf32")
def test_the_last_graph_gone_gives_the_shared_workspace_back():
    """graphed's shared workspace lives while a graph that writes into it does:
    a graph left alone still replays into it untouched, and once the last one
    is gone every byte graphed took is back (issue 29)."""
    model, x = workloads.mlp_inference()
    with torch.no_grad():
        model(x)
    settle()
    baseline = torch.cuda.memory_reserved()
    with torch.no_grad():
        first = graphed.capture(model, x)
        second = graphed.capture(model, x)
    del first
    settle()
    guards = sentinels()
    with torch.no_grad():
        for _ in range(3):
            sample = torch.randn_like(x)
            torch.testing.assert_close(second(sample).clone(), model(sample), rtol=2e-3,
                                       atol=2e-3)
    assert overwritten(guards) == 0
    del guards, second
    settle()
    assert torch.cuda.memory_reserved() <= baseline + (2 << 20), (
        torch.cuda.memory_reserved(), baseline)
