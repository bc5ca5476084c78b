"""graphed.make_graphed_callables on the GPU: numerics against eager, gradient
accumulation, dropout, pipeline orders, keyword arguments, mode switching and
what bad calls do.

Tolerances: fp32 with TF32 off. Replays run the same kernels as eager, but the
graphed and eager models are separate objects and cuBLAS or attention kernels
may pick different algorithms (split-K, atomics in attention backward), so
outputs and gradients are compared with rtol=1e-5, atol=1e-6 (MLP, conv) and
rtol=1e-4, atol=1e-5 (attention).
"""

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import graphed
from graphed import workloads

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32")]


class MLP(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class ConvBlock(nn.Module):
    def __init__(self, channels=16):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x):
        return x + torch.relu(self.norm(self.conv(x)))


def assert_grads_close(graphed_module, eager_module, rtol, atol):
    for (name, p), q in zip(graphed_module.named_parameters(), eager_module.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=name)


def test_a_call_keeps_neither_its_input_nor_the_autograd_graph_behind_it():
    """The input's autograd history reaches the first layer's parameters; a
    graphed layer that kept the input would keep that layer's AccumulateGrad
    nodes alive, and a later capture of the first layer would refuse them."""
    torch.manual_seed(0)
    first, second = MLP().cuda(), MLP().cuda()
    (graphed_second,) = graphed.make_graphed_callables(
        (second,), (torch.randn(8, 64, device="cuda", requires_grad=True),))
    hidden = first(torch.randn(8, 64, device="cuda"))
    alive = weakref.ref(hidden)
    graphed_second(hidden).sum().backward()
    del hidden
    assert alive() is None
    # With nothing alive from that step, the first layer can be graphed too.
    graphed.make_graphed_callables((first,), (torch.randn(8, 64, device="cuda"),))


@pytest.mark.parametrize(
    "make_layer, shape, rtol, atol",
    [
        (lambda: MLP(), (32, 64), 1e-5, 1e-6),
        (lambda: ConvBlock(), (4, 16, 12, 12), 1e-5, 1e-6),
        (lambda: workloads.GPTBlock(64, 4), (2, 16, 64), 1e-4, 1e-5),
    ],
    ids=["mlp", "conv", "transformer"],
)
def test_per_layer_graphs_match_eager(make_layer, shape, rtol, atol):
    torch.manual_seed(0)
    eager = nn.Sequential(*(make_layer() for _ in range(3))).cuda()
    model = copy.deepcopy(eager)
    samples = tuple((torch.randn(shape, device="cuda", requires_grad=True),) for _ in model)
    graphed.make_graphed_callables(tuple(model), samples)
    for step in range(3):
        x = torch.randn(shape, device="cuda")
        x_eager, x_graphed = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_eager, out_graphed = eager(x_eager), model(x_graphed)
        torch.testing.assert_close(out_graphed, out_eager, rtol=rtol, atol=atol)
        out_eager.square().mean().backward()
        out_graphed.square().mean().backward()
        torch.testing.assert_close(x_graphed.grad, x_eager.grad, rtol=rtol, atol=atol)
    assert_grads_close(model, eager, rtol, atol)
    # BatchNorm statistics follow eager too: the forward graph updates them.
    for b_graphed, b_eager in zip(model.buffers(), eager.buffers()):
        torch.testing.assert_close(b_graphed, b_eager, rtol=rtol, atol=atol)
    stats = graphed.graph_stats(model[1])
    assert stats["forward_replays"] == 3 and stats["backward_replays"] == 3
    assert stats["eager_calls"] == 0
    assert {g["pass"] for g in stats["graphs"]} == {"forward", "backward"}


def test_gradient_accumulation_over_four_microbatches_equals_eager():
    torch.manual_seed(0)
    eager = MLP().cuda()
    model = copy.deepcopy(eager)
    graphed.make_graphed_callables(model, (torch.randn(16, 64, device="cuda"),))
    batches = [torch.randn(16, 64, device="cuda") for _ in range(4)]
    for module in (eager, model):
        module.zero_grad(set_to_none=True)  # the first microbatch finds .grad None
        for x in batches:
            module(x).square().mean().backward()
    # pytorch#181723: with aliased gradients the sum would be 4x the last one.
    assert_grads_close(model, eager, 1e-5, 1e-6)


def test_autograd_grad_returns_gradients_that_later_replays_leave_alone():
    torch.manual_seed(0)
    layer = graphed.make_graphed_callables(nn.Linear(32, 32).cuda(),
                                           (torch.randn(8, 32, device="cuda"),))
    first = torch.autograd.grad(layer(torch.ones(8, 32, device="cuda")).sum(), layer.weight)[0]
    kept = first.clone()
    second = torch.autograd.grad(layer(torch.full((8, 32), 3.0, device="cuda")).sum(),
                                 layer.weight)[0]
    torch.testing.assert_close(first, kept, rtol=0, atol=0)
    assert not torch.equal(first, second)


def test_dropout_masks_differ_across_replays_with_the_right_keep_rate():
    dropout = nn.Dropout(p=0.3).cuda()
    graphed.make_graphed_callables(dropout, (torch.ones(1024, 1024, device="cuda",
                                                        requires_grad=True),))
    masks = []
    for _ in range(3):
        x = torch.ones(1024, 1024, device="cuda", requires_grad=True)
        out = dropout(x)
        out.sum().backward()
        keep = out != 0
        masks.append(keep.clone())
        # The backward uses the forward's mask, scaled as eager dropout does.
        torch.testing.assert_close(x.grad, keep.float() / 0.7)
        assert abs(keep.float().mean().item() - 0.7) < 0.005
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])


def test_pipeline_order_of_two_chunks_and_three_microbatches():
    torch.manual_seed(0)
    eager = [MLP(32).cuda() for _ in range(4)]  # chunk 1: layers 0, 1; chunk 2: layers 2, 3
    layers = [copy.deepcopy(layer) for layer in eager]
    order = [1, 1, 2, -2, 1, 2, -2, -1, 2, -2, -1, -1]
    # Samples chunk-major, then microbatch, then layer.
    samples = tuple((torch.randn(8, 32, device="cuda", requires_grad=True),)
                    for _ in range(4 * 3))
    graphed.make_graphed_callables(tuple(layers), samples, order=order)
    inputs = [torch.randn(8, 32, device="cuda") for _ in range(3)]
    seeds = [torch.randn(8, 32, device="cuda") for _ in range(3)]

    def run_schedule(chunk_layers):
        """Runs the order like a pipeline stage: activations cross chunk
        boundaries detached, backward of a chunk gets the next chunk's input grad."""
        fwd = {1: 0, 2: 0}
        bwd = {1: 0, 2: 0}
        boundary, outputs, results = {}, {}, {}
        for entry in order:
            chunk = abs(entry)
            if entry > 0:
                m = fwd[chunk]
                fwd[chunk] += 1
                if chunk == 1:
                    h = inputs[m].clone().requires_grad_()
                else:
                    h = outputs[(1, m)].detach().requires_grad_()
                    boundary[m] = h
                x = h
                for layer in chunk_layers[chunk]:
                    x = layer(x)
                outputs[(chunk, m)] = x
                if chunk == 2:
                    results[m] = x.detach().clone()
            else:
                m = bwd[chunk]
                bwd[chunk] += 1
                grad = seeds[m] if chunk == 2 else boundary[m].grad
                outputs.pop((chunk, m)).backward(grad)
        return results

    eager_results = run_schedule({1: eager[:2], 2: eager[2:]})
    graphed_results = run_schedule({1: layers[:2], 2: layers[2:]})
    for m in range(3):
        torch.testing.assert_close(graphed_results[m], eager_results[m], rtol=1e-5, atol=1e-6)
    for graphed_layer, eager_layer in zip(layers, eager):
        assert_grads_close(graphed_layer, eager_layer, 1e-5, 1e-6)
    stats = graphed.graph_stats(layers[0])
    assert stats["forward_replays"] == 3 and stats["backward_replays"] == 3
    assert len(stats["graphs"]) == 6  # a forward and a backward graph per microbatch


def test_keyword_arguments_tensors_and_constants():
    torch.manual_seed(0)
    weight = torch.randn(16, 16, device="cuda", requires_grad=True)

    def fn(x, *, bias, scale):
        return torch.tanh(x @ weight + bias) * scale

    sample_x = torch.randn(4, 16, device="cuda", requires_grad=True)
    sample_bias = torch.randn(16, device="cuda", requires_grad=True)
    graphed_fn = graphed.make_graphed_callables(
        fn, (sample_x,), sample_kwargs={"bias": sample_bias, "scale": 2.0})
    x = torch.randn(4, 16, device="cuda", requires_grad=True)
    bias = torch.randn(16, device="cuda", requires_grad=True)
    out = graphed_fn(x, bias=bias, scale=2.0)
    expected = fn(x, bias=bias, scale=2.0)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    gx, gb = x.grad.clone(), bias.grad.clone()
    x.grad = bias.grad = None
    expected.sum().backward()
    torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gb, bias.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(graphed.InputMismatchError, match="scale"):
        graphed_fn(x, bias=bias, scale=3.0)


def test_training_and_eval_switching():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.5)).cuda()
    graphed.make_graphed_callables(model, (torch.randn(8, 32, device="cuda"),))
    x = torch.randn(8, 32, device="cuda")
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), model[0](x))  # eager, dropout off
    model.train()
    model(x).sum().backward()
    stats = graphed.graph_stats(model)
    assert stats["forward_replays"] == 1
    assert stats["eager_calls"] == 1
    (reason,) = stats["eager_reasons"]
    assert "training is False" in reason


def test_inputs_that_differ_from_the_sample_are_refused():
    layer = graphed.make_graphed_callables(nn.Linear(8, 8).cuda(),
                                           (torch.randn(4, 8, device="cuda"),))
    with pytest.raises(graphed.InputMismatchError, match=r"args\[0\]"):
        layer(torch.randn(5, 8, device="cuda"))


def test_parameters_added_after_graphing_are_refused():
    layer = graphed.make_graphed_callables(nn.Linear(8, 8).cuda(),
                                           (torch.randn(4, 8, device="cuda"),))
    layer.extra = nn.Parameter(torch.zeros(1, device="cuda"))
    with pytest.raises(graphed.GraphedError, match="changed to 3 tensors"):
        layer(torch.randn(4, 8, device="cuda"))


def test_a_second_forward_before_backward_is_refused_not_corrupted():
    layer = graphed.make_graphed_callables(nn.Linear(8, 8).cuda(),
                                           (torch.randn(4, 8, device="cuda"),))
    first = layer(torch.randn(4, 8, device="cuda"))
    with pytest.raises(graphed.GraphedError, match="out of the order"):
        layer(torch.randn(4, 8, device="cuda"))
    first.sum().backward()
    # Under no_grad a call in the middle runs eagerly instead, and is counted.
    pending = layer(torch.randn(4, 8, device="cuda"))
    with torch.no_grad():
        layer(torch.randn(4, 8, device="cuda"))
    pending.sum().backward()
    assert graphed.graph_stats(layer)["eager_calls"] == 1


def test_failed_capture_leaves_modules_gradients_and_memory_as_they_were():
    class Blocked(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = ConvBlock(4)

        def forward(self, x):
            y = self.conv(x)
            if y.sum().item() > 1e9:  # a host sync: cannot be captured
                y = y * 2
            return y

    # Warm graphed's capture stream first, so that its cuBLAS workspace (kept
    # for the process, see Note [One capture stream per device]) is not
    # mistaken for memory the failed capture kept.
    warm = graphed.make_graphed_callables(nn.Linear(8, 8).cuda(), (torch.randn(2, 8, device="cuda"),))
    del warm
    torch.manual_seed(0)
    module = Blocked().cuda()
    module(torch.randn(2, 4, 8, 8, device="cuda")).sum().backward()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    grads = [p.grad.clone() for p in module.parameters()]
    sample = torch.randn(2, 4, 8, 8, device="cuda")  # before the RNG snapshot: it draws
    rng = torch.cuda.get_rng_state()
    gc.collect()
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    with pytest.raises(graphed.CaptureError, match="item"):
        graphed.make_graphed_callables(module, (sample,))
    gc.collect()
    torch.cuda.synchronize()
    for key, value in module.state_dict().items():
        assert torch.equal(value, before[key]), key
    for p, g in zip(module.parameters(), grads):
        assert torch.equal(p.grad, g)
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    assert torch.cuda.memory_allocated() <= allocated, "the graphs' memory leaked"
    # The module still works eagerly, with its own forward.
    assert "graphed" not in getattr(module.forward, "__dict__", {})
    module(torch.randn(2, 4, 8, 8, device="cuda")).sum().backward()


def test_graphed_layers_hold_less_memory_than_pytorchs():
    torch.manual_seed(0)
    base = nn.Sequential(*(MLP(256) for _ in range(6))).cuda()

    def held_mb(make):
        model = copy.deepcopy(base)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        samples = tuple((torch.randn(64, 256, device="cuda", requires_grad=True),)
                        for _ in model)
        make(tuple(model), samples)
        del samples
        gc.collect()
        torch.cuda.synchronize()
        held = (torch.cuda.memory_allocated() - before) / 2**20
        del model
        gc.collect()
        return held

    ours = held_mb(graphed.make_graphed_callables)
    theirs = held_mb(torch.cuda.make_graphed_callables)
    assert ours <= theirs, f"graphed holds {ours:.1f} MB, PyTorch {theirs:.1f} MB"


def test_fresh_gradients_share_one_allocation_and_never_alias_the_graph():
    """Note [Fresh gradients in one allocation]: after zero_grad(set_to_none=True)
    every parameter's .grad is a view of one fresh buffer, the values are
    eager's, the next replay leaves them alone, and an existing .grad is
    accumulated into in place."""
    torch.manual_seed(0)
    eager = MLP().cuda()
    module = copy.deepcopy(eager)
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    graphed.make_graphed_callables(module, (x.detach().clone().requires_grad_(True),))
    module(x).sum().backward()
    eager(x).sum().backward()
    storages = {p.grad.untyped_storage().data_ptr() for p in module.parameters()}
    assert len(storages) == 1
    assert_grads_close(module, eager, rtol=1e-5, atol=1e-6)
    kept = [p.grad.clone() for p in module.parameters()]
    module(2 * x).sum().backward(inputs=[x])  # a replay whose parameter grads go nowhere
    for p, k in zip(module.parameters(), kept):
        assert torch.equal(p.grad, k)
    # Accumulation into existing gradients, as over microbatches.
    module(x).sum().backward()
    eager(x).sum().backward()
    assert_grads_close(module, eager, rtol=1e-5, atol=1e-6)
