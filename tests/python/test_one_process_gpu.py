"""Every graph API one after another in one process (issue 13): graphed.capture,
make_graphed_callables, TrainStep, auto, then torch.compile(mode=
"reduce-overhead") (whose CUDA graph trees keep their own pool), then graphed
again, each compared with eager, and each model deleted (and the device
drained) before the next. Catches state one API leaves behind that breaks the
next: capture streams, pools, the autocast cache, RNG registration, allocator
state."""

import copy
import gc

import pytest
import torch
from torch import nn

import graphed

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32")]

WIDTH, BATCH = 64, 16


def mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(3)),
        nn.Linear(WIDTH, WIDTH),
    ).cuda()


def inputs(count, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(BATCH, WIDTH, device="cuda", generator=generator) for _ in range(count)]


def settle():
    """Frees what the process no longer uses, PyTorch's cuBLAS workspaces
    included: PyTorch keeps one per (handle, stream) until they are cleared
    (64 MiB on the H200 for the default stream's two handles, the main thread's
    and autograd's), and they are not graphed's. What remains after this is
    graphed's, or leaked."""
    gc.collect()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()


def segments():
    """Reserved memory per (stream, pool), for the failure message."""
    held = {}
    for segment in torch.cuda.memory_snapshot():
        key = f"stream {segment.get('stream')} pool {segment.get('segment_pool_id')}"
        active = sum(b["size"] for b in segment["blocks"] if b["state"] == "active_allocated")
        total, used = held.get(key, (0, 0))
        held[key] = (total + segment["total_size"], used + active)
    return {key: f"{total / 2**20:.1f} MiB ({used / 2**20:.1f} MiB active)"
            for key, (total, used) in held.items()}


def run_capture(seed):
    model = mlp(seed).eval()
    xs = inputs(3, seed)
    with torch.no_grad():
        fast = graphed.capture(model, xs[0])
        for x in xs:
            torch.testing.assert_close(fast(x), model(x), rtol=1e-6, atol=1e-6)


def run_make_graphed_callables(seed):
    model = mlp(seed)
    reference = copy.deepcopy(model)
    samples = tuple((torch.randn(BATCH, WIDTH, device="cuda", requires_grad=True),)
                    for _ in model)
    blocks = graphed.make_graphed_callables(tuple(model), samples)
    assert len(blocks) == len(model)
    for x in inputs(3, seed):
        x_graphed = x.clone().requires_grad_()
        x_eager = x.clone().requires_grad_()
        out, expected = model(x_graphed), reference(x_eager)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        out.square().mean().backward()
        expected.square().mean().backward()
        torch.testing.assert_close(x_graphed.grad, x_eager.grad, rtol=1e-5, atol=1e-7)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def run_train_step(seed):
    model = mlp(seed)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    eager_optimizer = graphed.make_capturable(torch.optim.AdamW(reference.parameters(), lr=1e-3))
    data = list(zip(inputs(4, seed), inputs(4, seed + 100)))
    step = graphed.TrainStep.from_parts(model, optimizer, nn.functional.mse_loss, data[0],
                                        skip_nonfinite=True)
    for batch in data:
        eager_optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(reference(batch[0]), batch[1])
        loss.backward()
        eager_optimizer.step()
        torch.testing.assert_close(step(batch), loss.detach(), rtol=1e-6, atol=1e-7)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    step.release()


def run_auto(seed):
    model = mlp(seed).eval()
    reference = copy.deepcopy(model)
    managed = graphed.auto(model, warmup=1, buckets={0: [8, 16]})
    with torch.no_grad():
        for _ in range(2):
            for rows in (5, 8, 16, 11):
                x = torch.randn(rows, WIDTH, device="cuda")
                size = 8 if rows <= 8 else 16
                padded = torch.cat([x, x.new_zeros(size - rows, WIDTH)])
                torch.testing.assert_close(managed(x), reference(padded)[:rows], rtol=1e-5,
                                           atol=1e-5)
    stats = managed.stats()
    assert stats["replays"] > 0 and stats["fallbacks"] == [], stats


def run_compile(seed):
    model = mlp(seed).eval()
    compiled = torch.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for x in inputs(4, seed):  # warm-up, record, then replays
            torch.testing.assert_close(compiled(x).clone(), model(x), rtol=1e-5, atol=1e-5)


def test_every_graph_api_one_after_another_in_one_process():
    stages = [("capture", run_capture), ("make_graphed_callables", run_make_graphed_callables),
              ("TrainStep", run_train_step), ("auto", run_auto),
              ("torch.compile reduce-overhead", run_compile),
              ("capture after compile", run_capture), ("TrainStep after compile", run_train_step),
              ("make_graphed_callables after compile", run_make_graphed_callables)]
    settle()
    baseline = torch.cuda.memory_reserved()
    try:
        for index, (name, stage) in enumerate(stages):
            try:
                stage(index)
            except Exception as error:
                raise AssertionError(f"stage {index} ({name}) failed after "
                                     f"{[n for n, _ in stages[:index]]}") from error
            settle()
    finally:
        torch._dynamo.reset()
    settle()
    # Each stage's graphs went with its objects (compile's with the reset), and
    # so did graphed's shared cuBLAS workspace with the last graph that wrote
    # into it (Note [cuBLAS workspaces of captured graphs]): nothing piles up
    # beyond allocator rounding.
    assert torch.cuda.memory_reserved() <= baseline + (8 << 20), (
        torch.cuda.memory_reserved(), baseline, segments())
