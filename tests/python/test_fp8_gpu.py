"""graphed.fp8 on a GPU (FP8 tensor cores, torch._scaled_mm): Float8Linear's
output and gradients against bf16 F.linear within the precision of the FP8
formats; delayed scaling advancing under graph replay exactly as in eager
steps; TrainStep.from_parts with an FP8 model giving the eager FP8 loop's
losses; the weight cast running once per step with microbatches=4 (kernels
counted by the profiler inside a replay); state_dict round trips on the
GPU. The lead runs: pytest -q tests/python/test_fp8_gpu.py"""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import graphed
from graphed import fp8

pytestmark = pytest.mark.gpu


def fp8_capable():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.fixture(autouse=True)
def _needs_fp8_tensor_cores():
    if not fp8_capable():
        pytest.skip("needs a GPU with FP8 tensor cores (compute capability 8.9 or newer)")


def relative_error(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm())


def mlp(d=256, hidden=1024, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)).cuda()


def batches(n, tokens=512, d=256, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(tokens, d, device="cuda", generator=g),
             torch.randn(tokens, d, device="cuda", generator=g)) for _ in range(n)]


# FP8 rounds each operand to 3 (E4M3) or 2 (E5M2) mantissa bits: a relative
# error of about 2-4% per element, which random-sign sums keep (not average
# away) relative to the result. The bounds below are about twice that.
OUTPUT_TOLERANCE = 0.08
GRAD_TOLERANCE = 0.15


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_output_and_gradients_are_close_to_bf16(scaling):
    torch.manual_seed(0)
    linear = nn.Linear(1024, 2048).cuda()
    layer = fp8.Float8Linear.from_linear(copy.deepcopy(linear), fp8.Recipe(scaling=scaling))
    x = torch.randn(4, 256, 1024, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(4, 256, 2048, device="cuda", dtype=torch.bfloat16) * 1e-2
    if scaling == "delayed":
        for _ in range(2):  # calibrate the scales from the amaxes of earlier steps
            layer(x.requires_grad_()).backward(g)
            fp8.update_scales(layer)
        layer.zero_grad(set_to_none=True)
    xa = x.detach().clone().requires_grad_()
    xb = x.detach().clone().requires_grad_()
    with torch.autocast("cuda", torch.bfloat16):
        y = layer(xa)
        want = F.linear(xb, linear.weight, linear.bias)
    assert y.dtype == want.dtype == torch.bfloat16
    y.backward(g)
    want.backward(g)
    assert relative_error(y, want) < OUTPUT_TOLERANCE
    assert relative_error(xa.grad, xb.grad) < GRAD_TOLERANCE
    assert layer.weight.grad.dtype == torch.float32
    assert relative_error(layer.weight.grad, linear.weight.grad) < GRAD_TOLERANCE
    torch.testing.assert_close(layer.bias.grad, linear.bias.grad, rtol=1e-2, atol=1e-3)


def eager_fp8_step(model, opt, batch, microbatches=1, amp=None):
    """The iteration TrainStep.from_parts captures, written out eagerly."""
    opt.zero_grad(set_to_none=True)
    total = 0
    for x, y in zip(batch[0].chunk(microbatches), batch[1].chunk(microbatches)):
        with torch.autocast("cuda", torch.bfloat16, enabled=amp == "bf16", cache_enabled=False):
            loss = F.mse_loss(model(x), y)
        loss = loss.float() / microbatches
        loss.backward()
        total = total + loss.detach()
    fp8.update_scales(model)
    opt.step()
    return total


@pytest.mark.parametrize("amp", [None, "bf16"])
@pytest.mark.parametrize("microbatches", [1, 4])
def test_train_step_equals_the_eager_fp8_loop(amp, microbatches):
    model = fp8.convert(mlp())
    eager_model = copy.deepcopy(model)
    fp8.prepare(eager_model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    eager_opt = graphed.make_capturable(torch.optim.AdamW(eager_model.parameters(), lr=1e-3))
    data = batches(8)
    step = graphed.TrainStep.from_parts(model, opt, F.mse_loss, data[0], amp=amp,
                                        microbatches=microbatches)
    for i, b in enumerate(data):
        loss = step(b)
        want = eager_fp8_step(eager_model, eager_opt, b, microbatches, amp)
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=0, msg=f"step {i}")
    # The scaling state advanced identically under replay.
    for (name, got), want in zip(model.state_dict().items(), eager_model.state_dict().values()):
        if "fp8" in name:
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
    assert int(model[0].fp8_history_slot) == len(data) % 16


def test_delayed_scaling_replays_advance_like_eager_steps():
    """A hand-captured step (forward, backward, update_scales) replayed n times
    leaves the same histories, scales and slot as n eager steps."""
    model = fp8.convert(mlp())
    eager_model = copy.deepcopy(model)
    fp8.prepare(eager_model)
    data = batches(5)
    static_x, static_y = (t.clone() for t in data[0])

    def step_of(m, x, y):
        F.mse_loss(m(x), y).backward()
        fp8.update_scales(m)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.cuda.stream(stream):
        step_of(model, static_x, static_y)  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(saved[k])
    graph = torch.cuda.CUDAGraph()
    model.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        step_of(model, static_x, static_y)
    for x, y in data:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        eager_model.zero_grad(set_to_none=True)
        step_of(eager_model, x, y)
        for (name, got), want in zip(model.state_dict().items(),
                                     eager_model.state_dict().values()):
            if "fp8" in name:
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
    assert int(model[0].fp8_history_slot) == len(data)


def weight_cast_kernels(step, batch):
    """Launches of graphed's cast kernels on float32 input (the fp32 master
    weights; activations and gradients are bf16 under autocast) during one
    replay, counted by the profiler."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(batch)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    casts = [n for n in names if "cast_kernel" in n]
    assert casts, f"the profiler saw no cast kernels in the replay: {sorted(set(names))[:20]}"
    return sum("cast_kernel<float" in n for n in names)


@pytest.mark.parametrize("cache_weights", [True, False])
def test_weight_is_cast_once_per_step_with_four_microbatches(cache_weights):
    model = fp8.convert(mlp(), fp8.Recipe(cache_weights=cache_weights))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = [(x.bfloat16(), y.bfloat16()) for x, y in batches(3)]
    step = graphed.TrainStep.from_parts(model, opt, F.mse_loss, data[0], amp="bf16",
                                        microbatches=4)
    step(data[1])
    layers = len(fp8.float8_layers(model))
    assert weight_cast_kernels(step, data[2]) == layers * (1 if cache_weights else 4)
    # Eagerly the same: a copy starts without a kept cast.
    eager = copy.deepcopy(model)
    assert eager[0].weight_cache.casts == 0
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    eager_fp8_step(eager, eager_opt, data[0], microbatches=4, amp="bf16")
    assert eager[0].weight_cache.casts == (1 if cache_weights else 4)


def test_cached_weights_train_like_uncached_ones():
    losses = {}
    for cache_weights in (True, False):
        model = fp8.convert(mlp(), fp8.Recipe(cache_weights=cache_weights))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = batches(6)
        step = graphed.TrainStep.from_parts(model, opt, F.mse_loss, data[0], amp="bf16",
                                            microbatches=4)
        losses[cache_weights] = torch.stack([step(b) for b in data])
    torch.testing.assert_close(losses[True], losses[False], rtol=0, atol=0)


def test_eager_forward_after_replays_casts_the_new_weights():
    model = fp8.convert(mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(4)
    x = data[0][0].clone().requires_grad_()
    step = graphed.TrainStep.from_parts(model, opt, F.mse_loss, data[0])
    model(x).sum().backward()  # an eager training forward caches casts
    for b in data:
        step(b)
    # The replays changed the weights without a version bump; the cache must not serve.
    got = model(x)
    reference = copy.deepcopy(model)
    for layer in fp8.float8_layers(reference):
        layer.weight_cache.clear()
    torch.testing.assert_close(got, reference(x), rtol=0, atol=0)


def test_state_dict_round_trip_on_the_gpu(tmp_path):
    model = fp8.convert(mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = batches(4)
    step = graphed.TrainStep.from_parts(model, opt, F.mse_loss, data[0])
    for b in data[:3]:
        step(b)
    path = tmp_path / "fp8.pt"
    torch.save(model.state_dict(), path)
    restored = fp8.convert(mlp(seed=7))
    restored.load_state_dict(torch.load(path))
    for (name, got), want in zip(restored.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
    assert int(restored[0].fp8_history_slot) == 3
    # Loading wrote into the flat buffers that update_scales advances.
    x, y = data[3]
    for m in (model, restored):
        m.zero_grad(set_to_none=True)
        F.mse_loss(m(x), y).backward()
        fp8.update_scales(m)
    torch.testing.assert_close(restored[0].fp8_scale, model[0].fp8_scale, rtol=0, atol=0)


def test_token_count_is_checked_on_the_gpu():
    layer = fp8.Float8Linear(64, 64).cuda()
    with pytest.raises(graphed.GraphedError, match=r"number of tokens .* = 10"):
        layer(torch.randn(10, 64, device="cuda"))
    with torch.no_grad():
        assert layer(torch.randn(10, 64, device="cuda")).shape == (10, 64)
