"""graphed.train.training_iteration, the iteration TrainStep.from_parts captures,
run eagerly: the C++ core's order of operations (Note [One training iteration]
in include/graphed/training_iteration.h) with torch.optim pieces equals the
same iteration written by hand in PyTorch."""

import copy

import pytest
import torch
from torch import nn

import graphed
from graphed import _C, train

pytestmark = pytest.mark.gpu


def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.GELU(), nn.Linear(32, 1))
    generator = torch.Generator(device="cuda").manual_seed(seed + 1)
    data = [(torch.randn(8, 16, device="cuda", generator=generator),
             torch.randn(8, 1, device="cuda", generator=generator)) for _ in range(4)]
    return model.cuda(), data


def by_hand(model, optimizer, batch, microbatches, clip, dtype):
    """The iteration as train.py wrote it before it moved to the core."""
    optimizer.zero_grad(set_to_none=True)
    total = None
    for x, y in zip(*(t.chunk(microbatches) for t in batch)):
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None,
                            cache_enabled=False):
            loss = nn.functional.mse_loss(model(x), y)
        loss = loss.float() / microbatches
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return total


@pytest.mark.parametrize("amp", [None, "bf16"])
def test_core_iteration_equals_the_hand_written_one(amp):
    model, data = model_and_data()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = graphed.make_capturable(torch.optim.AdamW(reference.parameters(),
                                                                    lr=1e-2))
    iteration, guard = train.training_iteration(
        model, optimizer, nn.functional.mse_loss, data[0], microbatches=2, clip_grad_norm=0.5,
        amp=amp)
    assert isinstance(guard, _C.GradientGuard)
    dtype = {"bf16": torch.bfloat16}.get(amp)
    for batch in data:
        got = iteration(batch)
        want = by_hand(reference, reference_optimizer, batch, 2, 0.5, dtype)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert not torch.is_autocast_enabled("cuda")
    for a, b in zip(list(model.state_dict().values()), list(reference.state_dict().values())):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_python_errors_of_a_piece_propagate_unchanged():
    model, data = model_and_data()
    optimizer = torch.optim.AdamW(model.parameters())
    iteration, _ = train.training_iteration(model, optimizer, lambda out, y: 1 / 0, data[0])
    with pytest.raises(ZeroDivisionError):
        iteration(data[0])


class Scale(torch.autograd.Function):
    """A Python autograd node: backward needs the GIL on autograd's thread."""

    @staticmethod
    def forward(ctx, x, fail):
        ctx.fail = fail
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        if ctx.fail:
            raise KeyError("raised in a Python backward")
        return grad * 2, None


@pytest.mark.parametrize("fail", [False, True])
def test_python_autograd_nodes_run_in_backward_and_their_errors_propagate(fail):
    model, data = model_and_data()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = lambda out, y: nn.functional.mse_loss(Scale.apply(out, fail), y)  # noqa: E731
    iteration, _ = train.training_iteration(model, optimizer, loss_fn, data[0])
    if fail:
        with pytest.raises(KeyError, match="raised in a Python backward"):
            iteration(data[0])
        return
    iteration(data[0])
    reference_optimizer = graphed.make_capturable(torch.optim.SGD(reference.parameters(), lr=0.1))
    reference_optimizer.zero_grad(set_to_none=True)
    x, y = data[0]
    nn.functional.mse_loss(reference(x) * 2, y).backward()
    reference_optimizer.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
