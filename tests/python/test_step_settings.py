"""graphed.train.StepSettings and the eager reference step that graphed.optimize
and graphed.advise_training verify and time against (CPU tier: plain PyTorch)."""

import copy

import pytest
import torch
from torch import nn

import graphed
from graphed.advise import eager_training_step
from graphed.train import StepSettings


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _batch(rows=8):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(rows, 8, generator=generator), torch.randn(rows, 4, generator=generator)


def _mse(output, target):
    return nn.functional.mse_loss(output, target)


@pytest.mark.parametrize("bad, message", [
    ({"amp": "fp16"}, 'Expected amp to be None or "bf16", got \'fp16\''),
    ({"microbatches": 0}, "Expected microbatches to be an int >= 1, got 0"),
    ({"microbatches": 2.0}, "Expected microbatches to be an int >= 1, got 2.0"),
    ({"clip_grad_norm": 0.0}, "Expected clip_grad_norm to be None or a positive number, got 0.0"),
    ({"skip_nonfinite": 1}, "Expected skip_nonfinite to be a bool, got 1"),
])
def test_step_settings_refuse_what_the_step_cannot_do(bad, message):
    with pytest.raises(graphed.GraphedError, match=message.replace("(", r"\(").replace(")", r"\)")):
        StepSettings(**bad)


def test_step_settings_describe_what_differs_from_the_plain_step():
    assert StepSettings().describe() == "the plain step"
    assert StepSettings(amp="bf16", clip_grad_norm=1.0).describe() == \
        "amp='bf16', clip_grad_norm=1.0"
    assert StepSettings(microbatches=4).from_parts_kwargs() == {
        "amp": None, "microbatches": 4, "clip_grad_norm": None, "skip_nonfinite": False}


def _by_hand(model, optimizer, batch, parts, clip):
    """The step written out in plain PyTorch, as a user writes it."""
    inputs, targets = batch
    optimizer.zero_grad()
    total = 0.0
    for x, y in zip(inputs.chunk(parts), targets.chunk(parts)):
        loss = _mse(model(x), y) / parts
        loss.backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return total


def test_the_eager_step_accumulates_microbatches_and_clips_as_written_by_hand():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mine, my_optimizer = copy.deepcopy((model, optimizer))
    step = eager_training_step(mine, my_optimizer, _mse,
                               StepSettings(microbatches=2, clip_grad_norm=0.05))
    for _ in range(3):
        want = _by_hand(model, optimizer, _batch(), 2, 0.05)
        got = step(_batch())
        assert float(got) == pytest.approx(want, rel=1e-6)
    for a, b in zip(model.parameters(), mine.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(model.buffers(), mine.buffers()):  # BatchNorm statistics per microbatch
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_eager_step_skips_a_nonfinite_step_and_puts_the_buffers_back():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = eager_training_step(model, optimizer, _mse, StepSettings(skip_nonfinite=True))
    step(_batch())
    params = [p.detach().clone() for p in model.parameters()]
    buffers = [b.detach().clone() for b in model.buffers()]
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    inputs, targets = _batch()
    targets[0, 0] = float("inf")
    loss = step((inputs, targets))
    assert not torch.isfinite(loss)
    for before, p in zip(params, model.parameters()):
        assert torch.equal(before, p)
    for before, b in zip(buffers, model.buffers()):
        assert torch.equal(before, b)
    for before, p in zip(momentum, model.parameters()):
        assert torch.equal(before, optimizer.state[p]["momentum_buffer"])
    step(_batch())  # a finite step afterwards trains again
    assert not all(torch.equal(a, p) for a, p in zip(params, model.parameters()))


def test_the_eager_step_takes_an_amp_string_as_before():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference, reference_optimizer = copy.deepcopy((model, optimizer))
    eager_training_step(model, optimizer, _mse, None)(_batch())
    eager_training_step(reference, reference_optimizer, _mse, StepSettings())(_batch())
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(graphed.GraphedError, match="Expected StepSettings, an amp string or None"):
        eager_training_step(model, optimizer, _mse, 3)


def test_optimize_refuses_step_settings_for_inference_before_any_work():
    model = _model().eval()
    with pytest.raises(graphed.GraphedError,
                       match="clip_grad_norm=1.0 applies to the training form of optimize"):
        graphed.optimize(model, sample_batch=torch.randn(4, 8), clip_grad_norm=1.0,
                         progress=False)
    with pytest.raises(graphed.GraphedError, match="Expected microbatches to be an int >= 1"):
        graphed.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), _mse,
                         sample_batch=_batch(), microbatches=0, progress=False)


def test_a_scheduler_belongs_to_the_training_form_and_its_optimizer():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(other, 1)
    with pytest.raises(graphed.GraphedError, match="Expected a learning-rate scheduler of the "
                       "optimizer passed to optimize"):
        graphed.optimize(model, optimizer, _mse, sample_batch=_batch(), scheduler=scheduler)
    with pytest.raises(graphed.GraphedError, match="Expected no scheduler in optimize's "
                       "inference form"):
        graphed.optimize(model, sample_batch=_batch()[0], scheduler=scheduler)


def test_the_schedule_runs_on_a_copy_and_is_put_back():
    from graphed._schedule import ScheduleRun

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, 0.1, 1.0, total_iters=3)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 10)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], [3])
    twin_model, twin_optimizer = copy.deepcopy((model, optimizer))
    run = ScheduleRun(scheduler, optimizer)
    twin = run.for_copy(twin_optimizer)
    start = optimizer.param_groups[0]["lr"]
    for _ in range(5):
        twin_optimizer.step()
        twin.step()
    assert optimizer.param_groups[0]["lr"] == start  # the copy's schedule moved the copy only
    assert twin_optimizer.param_groups[0]["lr"] > start and twin.max_lr == pytest.approx(0.1)
    for _ in range(5):
        optimizer.step()
        run.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(twin_optimizer.param_groups[0]["lr"])
    run.restore()
    assert optimizer.param_groups[0]["lr"] == start and scheduler.last_epoch == 0
    optimizer.step()
    scheduler.step()  # and it schedules on from the start: warmup's 0.1 -> 0.4 of 0.1
    assert optimizer.param_groups[0]["lr"] == pytest.approx(start * 4)
