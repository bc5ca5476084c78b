"""graphed.capture on a GPU: replay on current inputs, signatures, module state,
capture failures that name their cause and leave everything usable."""

import gc
import weakref

import pytest
import torch
from torch import nn

import graphed
from graphed import workloads
from source_lines import line_of

pytestmark = pytest.mark.gpu


@pytest.fixture
def mlp():
    workloads.configure_numerics()
    return workloads.mlp_inference()


def test_module_capture_matches_eager_on_new_inputs(mlp):
    model, x = mlp
    with torch.no_grad():
        fast = graphed.capture(model, x)
        for seed in range(3):
            torch.manual_seed(seed)
            new_x = torch.randn_like(x)
            expected = model(new_x)
            torch.testing.assert_close(fast(new_x), expected, rtol=1e-5, atol=1e-5)
    stats = fast.stats()
    assert stats["replays"] == 3
    assert stats["input_copies"] == 3
    assert stats["kernels"] >= 16 * 3
    assert stats["pool_reserved_bytes"] > 0


def test_a_call_keeps_no_reference_to_its_input(mlp):
    """PyTorch keeps a tensor's Python object alive while C++ holds the
    tensor, so the weak reference dies only if graphed let go of the input."""
    model, x = mlp
    with torch.no_grad():
        fast = graphed.capture(model, x)
        new_x = torch.randn_like(x)
        alive = weakref.ref(new_x)
        fast(new_x)
        del new_x
    assert alive() is None


def test_passing_the_static_input_skips_the_copy(mlp):
    model, x = mlp
    fast = graphed.capture(model, x)
    static_x = fast.static_inputs[0]
    static_x.copy_(x * 0.5)
    with torch.no_grad():
        out = fast(static_x)
        torch.testing.assert_close(out, model(x * 0.5), rtol=1e-5, atol=1e-5)
    assert fast.stats()["input_copies"] == 0


def test_nested_inputs_kwargs_and_constants():
    def fn(pair, scale, *, extra, mode="add"):
        a, b = pair
        out = a * scale + b
        if mode == "add":
            out = out + extra["bias"]
        return {"out": out, "parts": [a.sum(), b]}

    a, b = torch.randn(8, device="cuda"), torch.randn(8, device="cuda")
    bias = torch.randn(8, device="cuda")
    fast = graphed.capture(fn, (a, b), 3.0, sample_kwargs={"extra": {"bias": bias}, "mode": "add"})
    a2, b2, bias2 = (torch.randn(8, device="cuda") for _ in range(3))
    got = fast((a2, b2), 3.0, extra={"bias": bias2}, mode="add")
    assert set(got) == {"out", "parts"}
    torch.testing.assert_close(got["out"], a2 * 3.0 + b2 + bias2)
    torch.testing.assert_close(got["parts"][0], a2.sum())
    torch.testing.assert_close(got["parts"][1], b2)
    assert "kwargs['extra']['bias']: (8,) float32 cuda:0" in fast.signature


def test_mismatched_inputs_are_spelled_out(mlp):
    model, x = mlp
    fast = graphed.capture(model, x)
    with pytest.raises(graphed.InputMismatchError) as raised:
        fast(torch.randn(16, 512, device="cuda"))
    message = str(raised.value)
    assert "args[0]: expected (32, 512) float32 cuda:0, got (16, 512) float32 cuda:0" in message
    with pytest.raises(ValueError, match=r"args\[0\]: expected \(32, 512\) float32 cuda:0, got "
                                         r"\(32, 512\) float16 cuda:0"):
        fast(x.half())
    with pytest.raises(graphed.InputMismatchError, match=r"expected 1 inputs|args: expected a "
                                                         r"tuple of 1, got a tuple of 2"):
        fast(x, x)


def test_constant_arguments_are_part_of_the_signature():
    fast = graphed.capture(lambda x, k: x * k, torch.ones(4, device="cuda"), 2)
    torch.testing.assert_close(fast(torch.ones(4, device="cuda"), 2),
                               torch.full((4,), 2.0, device="cuda"))
    with pytest.raises(graphed.InputMismatchError, match=r"args\[1\]: expected 2, got 3\n"):
        fast(torch.ones(4, device="cuda"), 3)


def test_module_training_flag_is_guarded(mlp):
    model, x = mlp
    fast = graphed.capture(model, x)
    model.train()
    try:
        with pytest.raises(graphed.InputMismatchError,
                           match="module.training: expected False, got True"):
            fast(x)
    finally:
        model.eval()
    fast(x)


def test_outputs_are_overwritten_unless_cloned():
    fn = lambda x: x * 2  # noqa: E731
    x = torch.ones(4, device="cuda")
    shared = graphed.capture(fn, x)
    first = shared(x)
    shared(x * 3)
    assert first is shared.static_outputs
    torch.testing.assert_close(first, torch.full((4,), 6.0, device="cuda"))
    cloned = graphed.capture(fn, x, clone_outputs=True)
    kept = cloned(x)
    cloned(x * 3)
    torch.testing.assert_close(kept, torch.full((4,), 2.0, device="cuda"))


def test_in_place_updates_of_inputs_reach_the_caller():
    def accumulate(total, x):
        total.add_(x)
        return total.sum()

    total = torch.zeros(4, device="cuda")
    fast = graphed.capture(accumulate, total.clone(), torch.ones(4, device="cuda"))
    assert fast.mutated_inputs == ["args[0]"]
    fast(total, torch.ones(4, device="cuda"))
    fast(total, torch.ones(4, device="cuda"))
    torch.testing.assert_close(total, torch.full((4,), 2.0, device="cuda"))


def test_requires_grad_inputs_are_refused_under_grad_mode(mlp):
    model, x = mlp
    fast = graphed.capture(model, x)
    tracked = x.clone().requires_grad_()
    with pytest.raises(graphed.GraphedError, match="captured for inference"):
        fast(tracked)
    with torch.no_grad():
        fast(tracked)


def test_buffers_and_rng_are_restored_after_capture():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.5)).cuda()
    model.train()
    x = torch.randn(8, 16, device="cuda")
    mean = model[1].running_mean.clone()
    batches = model[1].num_batches_tracked.clone()
    rng = torch.cuda.get_rng_state()
    graphed.capture(model, x, warmup=3)
    torch.testing.assert_close(model[1].running_mean, mean, rtol=0, atol=0)
    assert torch.equal(model[1].num_batches_tracked, batches)
    assert torch.equal(torch.cuda.get_rng_state(), rng)


def test_dropout_masks_differ_across_replays():
    dropout = nn.Dropout(0.3).train()
    x = torch.ones(1 << 20, device="cuda")
    fast = graphed.capture(dropout, x)
    first = fast(x).clone()
    second = fast(x)
    assert not torch.equal(first, second)
    assert abs((second != 0).float().mean().item() - 0.7) < 0.005


def test_shared_pool_and_introspection():
    pool = graphed.graph_pool_handle()
    x = torch.randn(64, 64, device="cuda")
    first = graphed.capture(lambda t: t @ t, x, pool=pool)
    second = graphed.capture(lambda t: t.relu() + 1, x, pool=first.pool)
    assert first.pool == second.pool == pool
    assert "digraph" in second.dot()
    stats = second.stats()
    assert stats["kernels"] == 2
    assert stats["nodes"] >= 2


def sync_inside(x):
    y = x * 2
    torch.cuda.synchronize()
    return y


def item_inside(x):
    if x.sum().item() > 0:
        return x * 2
    return x


def host_tensor_inside(x):
    return x + torch.tensor([1.0, 2.0, 3.0, 4.0]).cuda()


def nonzero_inside(x):
    return x[torch.nonzero(x > 0).squeeze(1)]


@pytest.mark.parametrize(
    "fn, marker, op, kind",
    [
        (item_inside, ".item()", "aten::_local_scalar_dense", "host read"),
        (sync_inside, "torch.cuda.synchronize()", "outside any ATen operator, in synchronize",
         "explicit synchronization"),
        (host_tensor_inside, "torch.tensor", "aten::copy_", "host-device copy"),
        (nonzero_inside, "torch.nonzero", "aten::nonzero", "data-dependent shape"),
    ],
)
def test_capture_failure_names_the_operation_line_and_fix(fn, marker, op, kind):
    x = torch.ones(4, device="cuda")
    gc.collect()  # garbage of earlier tests must not be freed during this one
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    rng = torch.cuda.get_rng_state()
    with pytest.raises(graphed.CaptureError) as raised:
        graphed.capture(fn, x)
    message = str(raised.value)
    assert f"function `{fn.__name__}`" in message
    assert op in message, message
    assert f"test_capture_gpu.py:{line_of(fn, marker)} in {fn.__name__}" in message, message
    assert f": {kind}." in message, message
    assert "\nFix: " in message
    assert "memory pool was released" in message
    assert "Capture changed nothing" in message
    # Nothing leaked: the pool is gone, the generator untouched, and the stream
    # captures a good function next.
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() <= reserved, "the failed capture's pool leaked"
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    good = graphed.capture(lambda t: t * 4, x)
    torch.testing.assert_close(good(x), torch.full((4,), 4.0, device="cuda"))


def test_capture_composes_with_torch_compile():
    fn = torch.compile(lambda x: torch.nn.functional.gelu(x * 2) + 1, mode="default")
    x = torch.randn(1024, device="cuda")
    fast = graphed.capture(fn, x)
    y = torch.randn(1024, device="cuda")
    torch.testing.assert_close(fast(y), torch.nn.functional.gelu(y * 2) + 1)


@pytest.mark.parametrize("mode", ["repoint", "auto"])
def test_repointed_inputs_compute_on_the_new_tensor(mlp, mode):
    model, x = mlp
    with torch.no_grad():
        fast = graphed.capture(model, x, input_update=mode)
        tensors = [torch.randn_like(x) for _ in range(3)]
        for _ in range(2):
            for tensor in tensors:
                torch.testing.assert_close(fast(tensor), model(tensor), rtol=1e-5, atol=1e-5)
        # The same tensor twice in a row: "auto" re-points, "repoint" already has.
        torch.testing.assert_close(fast(tensors[0]), model(tensors[0]), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fast(tensors[0]), model(tensors[0]), rtol=1e-5, atol=1e-5)
        # The static buffer itself still works after re-pointing elsewhere.
        fast.static_inputs[0].copy_(tensors[1])
        torch.testing.assert_close(fast(fast.static_inputs[0]), model(tensors[1]),
                                   rtol=1e-5, atol=1e-5)
    stats = fast.stats()
    if stats["repointable_inputs"] == 0:
        pytest.skip("the driver cannot re-point this graph (Note [Re-pointing a graph])")
    assert stats["input_repoints"] >= 1
