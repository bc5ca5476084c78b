"""graphed.fp8 on the CPU: Recipe validation, convert() and its report of the
layers it left alone, the flat scaling buffers, update_scales (one
all_reduce, the delayed-scaling rule), state_dict round trips, the weight
cache, and the errors. The FP8 products are emulated (Recipe(emulate=True));
tests/python/test_fp8_gpu.py runs torch._scaled_mm on a GPU."""

import copy

import pytest
import torch
from torch import nn

import graphed
from graphed import fp8

EMULATED = fp8.Recipe(emulate=True)


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(),
                         nn.Linear(32, 10))


def train_steps(model, steps, microbatches=1, seed=1):
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    torch.manual_seed(seed)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(microbatches):
            x = torch.randn(16, 32)
            loss = model(x).square().mean() / microbatches
            loss.backward()
            total += float(loss.detach())
        fp8.update_scales(model)
        opt.step()
        losses.append(total)
    return losses


def test_recipe_is_validated_by_the_core():
    with pytest.raises(graphed.GraphedError, match=r'Expected scaling "delayed".*got "dynamic"'):
        fp8.Recipe(scaling="dynamic")
    with pytest.raises(graphed.GraphedError, match="Expected history_len >= 1"):
        fp8.Recipe(history_len=0)
    with pytest.raises(graphed.GraphedError, match=r'Expected an FP8 format "e5m2".*got "e3m4"'):
        fp8.Recipe(grad_format="e3m4")
    with pytest.raises(graphed.GraphedError, match=r'Expected amax_compute "max"'):
        fp8.Recipe(amax_compute="mean")
    with pytest.raises(graphed.GraphedError, match="Expected margin in 0..64"):
        fp8.Recipe(margin=-1)
    assert fp8.Recipe().scaling == "delayed" and fp8.Recipe().cache_weights


def test_convert_swaps_linears_and_reports_the_ones_it_left():
    model = mlp()
    params = list(model.parameters())
    fp8.convert(model, EMULATED, filter=lambda name, module: name != "2")
    assert isinstance(model[0], fp8.Float8Linear)
    assert type(model[2]) is nn.Linear and type(model[4]) is nn.Linear
    assert fp8.skipped_layers(model) == [
        fp8.SkippedLayer("2", "excluded by filter"),
        fp8.SkippedLayer("4", "in_features=32, out_features=10 (FP8 matrix products need "
                              "multiples of 16)"),
    ]
    # The same parameter objects: an optimizer built before keeps training them.
    assert all(a is b for a, b in zip(params, model.parameters()))
    assert model[0].weight_cache.casts == 0
    assert "scaling=delayed" in repr(model[0])


def test_forced_conversion_of_odd_dims_is_refused():
    with pytest.raises(graphed.GraphedError,
                       match=r"multiples of 16.*in_features=30, out_features=32"):
        fp8.Float8Linear.from_linear(nn.Linear(30, 32))
    with pytest.raises(graphed.GraphedError, match="multiples of 16 for a Float8Linear"):
        fp8.Float8Linear(32, 20)
    with pytest.raises(graphed.GraphedError, match="Float8Linear.from_linear"):
        fp8.convert(nn.Linear(32, 32))


def test_cpu_tensors_need_cuda_or_emulation():
    layer = fp8.Float8Linear(32, 32)
    with pytest.raises(graphed.GraphedError,
                       match=r"Expected CUDA tensors for a float8 linear layer.*emulate=True"):
        layer(torch.randn(16, 32))


def test_unsupported_input_dtype_is_refused():
    layer = fp8.Float8Linear(32, 32, recipe=EMULATED)
    with pytest.raises(graphed.GraphedError, match="float32, bfloat16 or float16, got Double"):
        layer(torch.randn(16, 32, dtype=torch.float64))


def test_layers_share_one_flat_table_that_update_scales_advances():
    model = fp8.convert(mlp(), EMULATED)
    layers = fp8.float8_layers(model)
    assert len(layers) == 2
    # Views of one flat buffer per model, three rows per layer.
    assert layers[0].fp8_scale.data_ptr() + 3 * 4 == layers[1].fp8_scale.data_ptr()
    assert layers[0].fp8_history_slot is layers[1].fp8_history_slot
    x = torch.randn(16, 32)
    model(x).square().mean().backward()
    amax = torch.cat([l.fp8_amax for l in layers]).clone()
    assert amax[0] == x.abs().max() and (amax > 0).all()
    fp8.update_scales(model)
    for i, layer in enumerate(layers):
        want = torch.tensor([448.0, 448.0, 57344.0]) / amax[3 * i:3 * i + 3]
        torch.testing.assert_close(layer.fp8_scale, want, rtol=1e-6, atol=0)
        torch.testing.assert_close(layer.fp8_scale_inv, 1 / want, rtol=1e-6, atol=0)
        torch.testing.assert_close(layer.fp8_amax_history[:, 0], amax[3 * i:3 * i + 3])
        assert (layer.fp8_amax == 0).all()
    assert int(layers[0].fp8_history_slot) == 1


def test_moved_buffers_are_packed_again():
    model = fp8.convert(mlp(), EMULATED)
    train_steps(model, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model._apply(lambda t: t.clone())  # what .to(other_device) does to every buffer
    layers = fp8.float8_layers(model)
    assert layers[0].fp8_history_slot is not layers[1].fp8_history_slot
    fp8.prepare(model)
    assert layers[0].fp8_history_slot is layers[1].fp8_history_slot
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    train_steps(model, 1)


def test_float8_buffers_stay_float32_when_the_model_is_cast():
    model = fp8.convert(mlp(), EMULATED)
    model.to(torch.bfloat16)
    layer = fp8.float8_layers(model)[0]
    assert layer.weight.dtype == torch.bfloat16
    assert layer.fp8_scale.dtype == torch.float32
    assert layer.fp8_history_slot.dtype == torch.int64


def test_state_dict_round_trips_the_scaling_state():
    model = fp8.convert(mlp(), fp8.Recipe(emulate=True, history_len=4))
    train_steps(model, 3)
    saved = copy.deepcopy(model.state_dict())
    assert {"0.fp8_amax_history", "0.fp8_scale", "0.fp8_scale_inv", "0.fp8_amax",
            "0.fp8_history_slot"} <= set(saved)
    assert "0.fp8_format_max" not in saved  # derived from the recipe
    assert int(saved["0.fp8_history_slot"]) == 3
    restored = fp8.convert(mlp(seed=5), fp8.Recipe(emulate=True, history_len=4))
    restored.load_state_dict(saved)
    for key, value in restored.state_dict().items():
        torch.testing.assert_close(value, saved[key], rtol=0, atol=0)
    # Loading wrote into the flat buffers: both models continue identically.
    assert train_steps(model, 2, seed=9) == train_steps(restored, 2, seed=9)
    for key, value in restored.state_dict().items():
        torch.testing.assert_close(value, model.state_dict()[key], rtol=0, atol=0)


def test_a_high_precision_checkpoint_loads_into_a_converted_model():
    plain = mlp(seed=3)
    model = fp8.convert(mlp(), EMULATED)
    model.load_state_dict(plain.state_dict())
    torch.testing.assert_close(model[0].weight, plain[0].weight)
    assert (model[0].fp8_scale == 1).all()


def test_weight_is_cast_once_per_step_over_microbatches():
    model = fp8.convert(mlp(), EMULATED)
    train_steps(model, 3, microbatches=4)
    assert model[0].weight_cache.casts == 3
    uncached = fp8.convert(mlp(), fp8.Recipe(emulate=True, cache_weights=False))
    train_steps(uncached, 3, microbatches=4)
    assert uncached[0].weight_cache.casts == 12


def test_cached_and_uncached_training_agree():
    cached = fp8.convert(mlp(), EMULATED)
    uncached = fp8.convert(mlp(), fp8.Recipe(emulate=True, cache_weights=False))
    assert train_steps(cached, 4, microbatches=2) == train_steps(uncached, 4, microbatches=2)


def test_current_scaling_needs_no_update():
    model = fp8.convert(mlp(), fp8.Recipe(scaling="current", emulate=True))
    assert not fp8.has_delayed_scaling(model)
    losses = train_steps(model, 20)
    assert losses[-1] < losses[0]


def test_update_scales_reduces_all_amaxes_with_one_all_reduce(monkeypatch):
    model = fp8.convert(mlp(), EMULATED)
    model(torch.randn(16, 32)).sum().backward()
    calls = []

    def all_reduce(tensor, op=None, group=None):
        calls.append((tensor, op, group))
        tensor.mul_(2)  # as if another rank saw twice the amaxes

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    amax = torch.cat([l.fp8_amax for l in fp8.float8_layers(model)]).clone()
    group = object()
    fp8.update_scales(model, process_group=group)
    assert len(calls) == 1
    tensor, op, used_group = calls[0]
    assert tensor.shape == (6,) and op == torch.distributed.ReduceOp.MAX and used_group is group
    torch.testing.assert_close(model[0].fp8_amax_history[:, 0], 2 * amax[:3])


def test_update_scales_without_float8_layers_does_nothing():
    fp8.update_scales(mlp())


def test_converted_models_copy_and_pickle():
    import io
    model = fp8.convert(mlp(), EMULATED)
    train_steps(model, 2)
    clone = copy.deepcopy(model)
    assert clone[0].weight_cache is not model[0].weight_cache
    assert clone[0].weight_cache.casts == 0
    assert clone[0].recipe == model[0].recipe
    assert train_steps(clone, 1, seed=4) == train_steps(model, 1, seed=4)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, model.state_dict()[key], rtol=0, atol=0)
    assert train_steps(loaded, 1, seed=5) == train_steps(model, 1, seed=5)
