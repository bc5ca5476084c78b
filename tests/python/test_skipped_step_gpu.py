"""A skipped training step leaves nothing behind (issue 13): with
``skip_nonfinite=True`` or fp16 loss scaling, a step whose batch holds a NaN
or whose loss is infinite leaves weights, optimizer state and every module
buffer (BatchNorm's running_mean, running_var, num_batches_tracked)
bit-identical, decided on the device inside the graph (Note [Buffers of a
skipped step]); the next good step equals eager's."""

import copy

import pytest
import torch
from torch import nn

import graphed
from graphed import train

pytestmark = pytest.mark.gpu

BATCH = 8


@pytest.fixture(autouse=True)
def deterministic_kernels():
    """Eager and graphed steps are compared closely: no TF32, and cuDNN kernels
    without atomics, so that both run the same arithmetic."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    yield
    (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
     torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) = saved


def small_cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1, stride=2), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    ).cuda()


def resnet18():
    models = pytest.importorskip("torchvision.models", reason="needs torchvision")
    torch.manual_seed(0)
    return models.resnet18(num_classes=10).cuda()


def loss_fn(output, targets):
    """Cross-entropy plus ``bias.sum()``: a batch whose bias holds inf has an
    infinite loss while every gradient stays finite (the bias has none)."""
    labels, bias = targets
    return nn.functional.cross_entropy(output.float(), labels) + bias.sum()


def batches(count, size=16, seed=1):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(BATCH, 3, size, size, device="cuda", generator=generator),
             (torch.randint(0, 10, (BATCH,), device="cuda", generator=generator),
              torch.zeros(BATCH, device="cuda"))) for _ in range(count)]


def nan_pixel(batch):
    x, (labels, bias) = batch
    x = x.clone()
    x[1, 0, 3, 3] = float("nan")
    return x, (labels, bias)


def infinite_loss(batch):
    x, (labels, bias) = batch
    bias = bias.clone()
    bias[2] = float("inf")
    return x, (labels, bias)


def everything(model, optimizer):
    """Every tensor a step may change, by name: parameters, all buffers
    (BatchNorm statistics and counters) and the optimizer's state."""
    tensors = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, state in enumerate(optimizer.state.values()):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{i}.{key}"] = value.clone()
    return tensors


def assert_bit_identical(now, before):
    assert now.keys() == before.keys()
    changed = [k for k in before if not torch.equal(now[k], before[k])]
    assert not changed, f"changed by a skipped step: {changed[:8]}"


def assert_close_states(graphed_state, eager_state, rtol, atol):
    assert graphed_state.keys() == eager_state.keys()
    for key in graphed_state:
        torch.testing.assert_close(graphed_state[key], eager_state[key], rtol=rtol, atol=atol,
                                   msg=lambda m, key=key: f"{key}: {m}")


def build(make_model, amp, size):
    """A TrainStep.from_parts on one copy of the model and, on another, the
    same iteration run eagerly (graphed.train.training_iteration: the very
    function TrainStep captures, with its own guard)."""
    model = make_model()
    reference = copy.deepcopy(model)
    options = dict(skip_nonfinite=True)
    if amp == "fp16":
        # A small initial scale: the good steps must not overflow and be skipped.
        options = dict(amp="fp16", loss_scaling=graphed.LossScaling(init_scale=256.0))
    data = batches(4, size=size)
    step = graphed.TrainStep.from_parts(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn, data[0], **options)
    eager_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    eager, eager_guard = train.training_iteration(reference, eager_optimizer, loss_fn, data[0],
                                                  **options)
    return step, model, eager, reference, eager_optimizer, eager_guard, data


@pytest.mark.parametrize("amp", [None, "fp16"])
@pytest.mark.parametrize("poison", [nan_pixel, infinite_loss], ids=["nan_pixel", "inf_loss"])
def test_skipped_step_leaves_weights_optimizer_and_buffers_bit_identical(poison, amp):
    step, model, eager, reference, eager_optimizer, eager_guard, data = build(small_cnn, amp, 16)
    for batch in data[:2]:
        step(batch)
        eager(batch)
    optimizer = step.optimizers[0]
    before = everything(model, optimizer)
    assert int(model[1].num_batches_tracked) == 2
    skipped = step.skipped_steps

    loss = step(poison(data[2]))
    assert not torch.isfinite(loss).item()
    assert step.skipped_steps == skipped + 1
    assert_bit_identical(everything(model, optimizer), before)
    assert int(model[1].num_batches_tracked) == 2, "the skipped batch was counted"
    assert torch.isfinite(model[1].running_mean).all()

    # Eagerly, the same iteration skips the same way; then one good step each.
    eager_before = everything(reference, eager_optimizer)
    eager(poison(data[2]))
    assert_bit_identical(everything(reference, eager_optimizer), eager_before)
    torch.testing.assert_close(step(data[3]), eager(data[3]), rtol=1e-5, atol=1e-6)
    rtol, atol = (1e-5, 1e-6) if amp is None else (1e-4, 1e-5)
    assert_close_states(everything(model, optimizer), everything(reference, eager_optimizer),
                        rtol, atol)
    assert int(model[1].num_batches_tracked) == 3
    assert step.skipped_steps == skipped + 1


def test_next_good_step_equals_plain_eager_training_that_never_saw_the_bad_batch():
    """fp32 with skip_nonfinite: the reference is a plain PyTorch loop (fused
    AdamW, no graphed code) that only trains on the good batches."""
    model = small_cnn()
    reference = copy.deepcopy(model)
    data = batches(4)
    step = graphed.TrainStep.from_parts(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn, data[0],
        skip_nonfinite=True)
    eager_optimizer = graphed.make_capturable(torch.optim.AdamW(reference.parameters(), lr=1e-2))

    def eager(batch):
        x, targets = batch
        eager_optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(reference(x), targets)
        loss.backward()
        eager_optimizer.step()
        return loss.detach()

    for batch in data[:2]:
        step(batch)
        eager(batch)
    step(nan_pixel(data[2]))
    step(infinite_loss(data[2]))
    assert step.skipped_steps == 2
    torch.testing.assert_close(step(data[3]), eager(data[3]), rtol=1e-5, atol=1e-6)
    assert_close_states(everything(model, step.optimizers[0]),
                        everything(reference, eager_optimizer), 1e-5, 1e-6)


@pytest.mark.parametrize("amp", [None, "fp16"])
def test_resnet18_nan_pixel_leaves_batchnorm_statistics_alone(amp):
    step, model, eager, reference, eager_optimizer, _, data = build(resnet18, amp, 32)
    step(data[0])
    eager(data[0])
    optimizer = step.optimizers[0]
    before = everything(model, optimizer)
    skipped = step.skipped_steps
    step(nan_pixel(data[1]))
    assert step.skipped_steps == skipped + 1
    assert_bit_identical(everything(model, optimizer), before)
    eager(nan_pixel(data[1]))
    torch.testing.assert_close(step(data[2]), eager(data[2]), rtol=1e-4, atol=1e-5)
    buffers = {k: v for k, v in everything(model, optimizer).items() if "running" in k}
    eager_buffers = {k: v for k, v in everything(reference, eager_optimizer).items()
                     if "running" in k}
    assert buffers and all(torch.isfinite(v).all() for v in buffers.values())
    assert_close_states(buffers, eager_buffers, 1e-4, 1e-5)


def test_guard_protects_the_buffers_of_the_model_only_when_it_can_skip():
    model = small_cnn()
    data = batches(1)
    skipping = graphed.TrainStep.from_parts(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn, data[0],
        skip_nonfinite=True)
    protected = {id(t) for t in skipping.guard.protected_buffers}
    assert protected == {id(b) for b in model.buffers()}
    other = small_cnn()
    plain = graphed.TrainStep.from_parts(
        other, torch.optim.AdamW(other.parameters(), lr=1e-2), loss_fn, data[0])
    assert plain.guard.protected_buffers == []
