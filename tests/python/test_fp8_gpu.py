"""graphed.fp8 on a GPU (FP8 tensor cores, torch._scaled_mm): Float8Linear's
output and gradients against bf16 F.linear within the precision of the FP8
formats; delayed scaling advancing under graph replay exactly as in eager
steps; TrainStep.from_parts with an FP8 model giving the eager FP8 loop's
losses; the weight cast running once per step with microbatches=4 (kernels
counted by the profiler inside a replay), and with make_graphed_callables'
order= across the microbatches' graphs (graph stats, kernel counts,
training equal to the uncached recipe, refreshed after each optimizer step,
stale replays refused); state_dict round trips on the GPU; token counts
that are not multiples of 16. Transformers and timm models converted to FP8:
test_zoo_gpu.py. The lead runs: pytest -q tests/python/test_fp8_gpu.py"""

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


# --- make_graphed_callables(order=...): the weight cast once per step across the
# microbatches' graphs (Note [Weight casts shared by the graphs of a scope]).

MICROBATCHES = 3
LAYERS_PER_BLOCK = 2  # Float8Linear layers in each mlp() block


def graphed_blocks(recipe, microbatches=MICROBATCHES, tokens=64, d=256, seed=0):
    """Two FP8 mlp() blocks graphed with order= as one chunk of `microbatches`
    microbatches (every forward, then every backward), and an AdamW over them.
    Inputs are bf16 and the master weights float32, so the only casts of
    float32 tensors are weight casts."""
    model = fp8.convert(nn.Sequential(mlp(d, seed=seed), mlp(d, seed=seed + 1)), recipe)
    g = torch.Generator(device="cuda").manual_seed(seed + 2)
    samples = []
    for _ in range(microbatches):  # chunk-major, then microbatch, then layer
        samples.append((torch.randn(tokens, d, device="cuda", generator=g).bfloat16(),))
        samples.append((torch.randn(tokens, d, device="cuda", generator=g).bfloat16()
                        .requires_grad_(),))
    order = [1] * microbatches + [-1] * microbatches
    graphed.make_graphed_callables((model[0], model[1]), tuple(samples), order=order)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def pipeline_batches(n, microbatches=MICROBATCHES, tokens=64, d=256, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [[(torch.randn(tokens, d, device="cuda", generator=g).bfloat16(),
              torch.randn(tokens, d, device="cuda", generator=g))
             for _ in range(microbatches)] for _ in range(n)]


def pipeline_step(model, opt, batch):
    """One optimizer step in the captured order: the microbatches' forwards,
    their backwards (oldest first), update_scales, the optimizer. Returns the
    microbatches' outputs (clones) and the loss."""
    opt.zero_grad(set_to_none=True)
    outputs, losses = [], []
    for x, y in batch:
        out = model(x)
        outputs.append(out.detach().clone())
        losses.append(F.mse_loss(out.float(), y) / len(batch))
    for loss in losses:
        loss.backward()
    fp8.update_scales(model)
    opt.step()
    return outputs, torch.stack([loss.detach() for loss in losses]).sum()


def forward_graphs(block):
    graphs = [g for g in graphed.graph_stats(block)["graphs"] if g["pass"] == "forward"]
    return sorted(graphs, key=lambda g: g["microbatch"])


@pytest.mark.parametrize("cache_weights", [True, False])
def test_later_microbatches_forward_graphs_cast_no_weight(cache_weights):
    model, opt = graphed_blocks(fp8.Recipe(cache_weights=cache_weights))
    for block in model:
        first, *later = forward_graphs(block)
        assert len(later) == MICROBATCHES - 1
        assert (first["fp8_weight_casts"], first["fp8_weight_cast_reads"]) == (LAYERS_PER_BLOCK, 0)
        for graph in later:
            if cache_weights:
                # They read the first microbatch's casts, and lack its cast
                # kernels (delayed scaling: one fused kernel per cast).
                assert (graph["fp8_weight_casts"], graph["fp8_weight_cast_reads"]) == (
                    0, LAYERS_PER_BLOCK)
                assert graph["kernels"] == first["kernels"] - LAYERS_PER_BLOCK, graph
            else:
                assert (graph["fp8_weight_casts"], graph["fp8_weight_cast_reads"]) == (
                    LAYERS_PER_BLOCK, 0)
                assert graph["kernels"] == first["kernels"], graph
    # The profiler sees the same in a replayed step: weight casts (the casts
    # of float32 tensors) run once per step, not once per microbatch.
    data = pipeline_batches(2)
    pipeline_step(model, opt, data[0])
    layers = len(fp8.float8_layers(model))
    casts = weight_cast_kernels(lambda batch: pipeline_step(model, opt, batch), data[1])
    assert casts == layers * (1 if cache_weights else MICROBATCHES)


@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_shared_weight_casts_train_exactly_like_uncached_ones(scaling):
    """Losses, gradients, weights and scaling state after a few optimizer steps
    equal those of graphs that each cast their weights: the shared cast is
    the same bits, made by the first microbatch's graph."""
    data = pipeline_batches(4)
    runs = {}
    for cache_weights in (True, False):
        model, opt = graphed_blocks(fp8.Recipe(scaling=scaling, cache_weights=cache_weights))
        losses = torch.stack([pipeline_step(model, opt, batch)[1] for batch in data])
        runs[cache_weights] = (losses, model)
    (cached_losses, cached), (uncached_losses, uncached) = runs[True], runs[False]
    torch.testing.assert_close(cached_losses, uncached_losses, rtol=0, atol=0)
    for (name, got), want in zip(cached.named_parameters(), uncached.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0, msg=f"{name}.grad")
    for (name, got), want in zip(cached.state_dict().items(), uncached.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


def test_shared_weight_cast_is_refreshed_after_the_optimizer_step():
    """Every microbatch gets the same input, so within a step every
    microbatch's graph must compute what the first (the one that casts)
    computes; a later graph reading last step's cast would differ once the
    optimizer changed the weights. Each step equals the uncached graphs'."""
    x, y = pipeline_batches(1)[0][0]
    batch = [(x, y)] * MICROBATCHES
    outputs = {}
    for cache_weights in (True, False):
        model, opt = graphed_blocks(fp8.Recipe(cache_weights=cache_weights))
        outputs[cache_weights] = [pipeline_step(model, opt, batch)[0] for _ in range(3)]
    for step, (cached, uncached) in enumerate(zip(outputs[True], outputs[False])):
        for m in range(MICROBATCHES):
            torch.testing.assert_close(cached[m], cached[0], rtol=0, atol=0,
                                       msg=f"step {step}, microbatch {m} against the first")
            torch.testing.assert_close(cached[m], uncached[m], rtol=0, atol=0,
                                       msg=f"step {step}, microbatch {m} against uncached")
        if step > 0:  # the weights (and so the casts) changed since the last step
            assert not torch.equal(cached[0], outputs[True][step - 1][0]), step


def test_later_microbatch_after_a_weight_change_without_the_first_is_refused():
    """Two microbatches, then the optimizer step, on graphs of three: the next
    call replays the third microbatch's graphs, whose cast (made by the first
    microbatch's graph) is of the weights before the step."""
    model, opt = graphed_blocks(fp8.Recipe())
    data = pipeline_batches(2)
    pipeline_step(model, opt, data[0])
    x, y = data[1][0]
    F.mse_loss(model(x).float(), y).backward()  # microbatch 0 only
    out = model(x)  # microbatch 1, same weights: its cast is this step's
    F.mse_loss(out.float(), y).backward()
    opt.step()
    replays = graphed.graph_stats(model[0])["forward_replays"]
    with pytest.raises(graphed.GraphedError, match=r"Expected a fresh FP8 weight cast for the "
                       r"forward of .*microbatch 2\).*microbatch 0\)"):
        model(x)
    assert graphed.graph_stats(model[0])["forward_replays"] == replays  # nothing ran
    # Graphs that each cast their weights have no such dependency.
    uncached, uncached_opt = graphed_blocks(fp8.Recipe(cache_weights=False))
    F.mse_loss(uncached(x).float(), y).backward()
    uncached_opt.step()
    F.mse_loss(uncached(x).float(), y).backward()


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


def test_token_counts_that_are_not_multiples_of_16_train_on_the_gpu():
    """Note [Token counts that are not multiples of 16]: 4 x 17 tokens (a
    ViT's patches and class token) train like bf16 F.linear."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 512).cuda()
    layer = fp8.Float8Linear.from_linear(copy.deepcopy(linear), fp8.Recipe(scaling="current"))
    x = torch.randn(4, 17, 256, device="cuda")
    g = torch.randn(4, 17, 512, device="cuda") * 1e-2
    xa = x.clone().requires_grad_()
    xb = x.clone().requires_grad_()
    with torch.autocast("cuda", torch.bfloat16):
        y = layer(xa)
        want = F.linear(xb, linear.weight, linear.bias)
    assert y.shape == (4, 17, 512)
    y.backward(g)
    want.backward(g)
    assert relative_error(y, want) < OUTPUT_TOLERANCE
    assert relative_error(xa.grad, xb.grad) < GRAD_TOLERANCE
    assert relative_error(layer.weight.grad, linear.weight.grad) < GRAD_TOLERANCE
    torch.testing.assert_close(layer.bias.grad, linear.bias.grad, rtol=1e-2, atol=1e-3)
    with torch.no_grad():
        assert layer(torch.randn(10, 256, device="cuda")).shape == (10, 512)
