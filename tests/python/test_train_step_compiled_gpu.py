"""TrainStep.from_parts over torch.compile(model) (issue 26: the compiled
candidate of graphed.optimize): the guarantees of TrainStep hold on the
compiled path. Construction leaves the model and optimizer as they were, LR
schedules take effect without a recapture, microbatches accumulate as eager
does, a non-finite step is skipped bit for bit, and nothing compiles once the
step is captured (Note [A compiled candidate] in python/graphed/_compiled.py).

The reference is the same compiled model run without graphs (a deep copy,
compiled alike): what graphed adds, the capture, is what is checked; the fused
kernels' numerics are torch.compile's."""

import copy

import pytest
import torch
from torch import nn

import graphed

pytestmark = pytest.mark.gpu


class CountingInductor:
    """Inductor, counting the graphs Dynamo hands it."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        return compile_fx(graph, example_inputs)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 32),
                         nn.SiLU(), nn.Linear(32, 1)).cuda()


def batches(count, size=32, seed=1):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(size, 32, device="cuda", generator=generator),
             torch.randn(size, 1, device="cuda", generator=generator)) for _ in range(count)]


def compiled_twins(lr=1e-2):
    """A model and its copy, each compiled, with capturable AdamW optimizers."""
    model = make_model()
    other = copy.deepcopy(model)
    backend = CountingInductor()
    mine = torch.compile(model, backend=backend)
    theirs = torch.compile(other, backend=CountingInductor())
    opt = graphed.make_capturable(torch.optim.AdamW(model.parameters(), lr=lr))
    other_opt = graphed.make_capturable(torch.optim.AdamW(other.parameters(), lr=lr))
    return (model, mine, opt, backend), (other, theirs, other_opt)


def eager_step(compiled, optimizer, microbatches=1, clip=None):
    def step(batch):
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device="cuda")
        for x, y in zip(batch[0].chunk(microbatches), batch[1].chunk(microbatches)):
            loss = nn.functional.mse_loss(compiled(x), y) / microbatches
            loss.backward()
            total = total + loss.detach()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(compiled.parameters(), clip)
        optimizer.step()
        return total
    return step


def state_of(model, optimizer):
    return ([t.detach().clone() for t in model.state_dict().values()],
            [v.clone() for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor)])


def assert_same(a, b):
    for x, y in zip(a[0] + a[1], b[0] + b[1]):
        assert torch.equal(x, y)


def test_construction_changes_nothing_and_steps_follow_the_compiled_iteration():
    (model, mine, opt, backend), (other, theirs, other_opt) = compiled_twins()
    data = batches(10)
    eager_step(mine, opt)(data[0])  # optimizer state exists, as in a run under way
    eager_step(theirs, other_opt)(data[0])
    before = state_of(model, opt)
    rng = torch.cuda.get_rng_state()
    step = graphed.TrainStep.from_parts(mine, opt, nn.functional.mse_loss, data[0])
    assert_same(state_of(model, opt), before)
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    reference = eager_step(theirs, other_opt)
    losses = torch.stack([step(b).clone() for b in data])
    expected = torch.stack([reference(b) for b in data])
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), other.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    compiled = backend.graphs
    assert compiled > 0
    for b in data:
        step(b)
    assert backend.graphs == compiled, "Dynamo compiled again after the capture"


def test_lr_schedule_takes_effect_without_recapture():
    (model, mine, opt, _), (other, theirs, other_opt) = compiled_twins()
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.1)
    other_schedule = torch.optim.lr_scheduler.StepLR(other_opt, step_size=3, gamma=0.1)
    data = batches(9)
    step = graphed.TrainStep.from_parts(mine, opt, nn.functional.mse_loss, data[0])
    reference = eager_step(theirs, other_opt)
    captures = step.stats().get("captures")
    for b in data:
        step(b)
        reference(b)
        schedule.step()
        other_schedule.step()
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(1e-5)
    assert step.stats().get("captures") == captures
    for p, q in zip(model.parameters(), other.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_microbatches_and_clipping_accumulate_as_the_compiled_iteration():
    (model, mine, opt, _), (other, theirs, other_opt) = compiled_twins()
    data = batches(6, size=64)
    step = graphed.TrainStep.from_parts(mine, opt, nn.functional.mse_loss, data[0],
                                        microbatches=4, clip_grad_norm=0.5)
    reference = eager_step(theirs, other_opt, microbatches=4, clip=0.5)
    for b in data:
        torch.testing.assert_close(step(b), reference(b), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), other.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_nonfinite_step_is_skipped_bit_for_bit():
    (model, mine, opt, _), _ = compiled_twins()
    data = batches(3)
    step = graphed.TrainStep.from_parts(mine, opt, nn.functional.mse_loss, data[0],
                                        skip_nonfinite=True, clip_grad_norm=1.0)
    step(data[0])
    before = state_of(model, opt)
    bad = (data[1][0].clone(), data[1][1].clone())
    bad[0][3, 5] = float("nan")
    assert torch.isnan(step(bad)).item()
    assert_same(state_of(model, opt), before)
    assert step.skipped_steps == 1
    step(data[2])
    assert step.skipped_steps == 1
    assert not torch.equal(state_of(model, opt)[0][0], before[0][0])


def test_bf16_autocast_compiles_once_for_warmup_and_capture():
    (model, mine, opt, backend), _ = compiled_twins()
    data = batches(4)
    step = graphed.TrainStep.from_parts(mine, opt, nn.functional.mse_loss, data[0], amp="bf16")
    compiled = backend.graphs
    losses = [step(b).clone() for b in data]
    assert all(torch.isfinite(loss).item() for loss in losses)
    assert backend.graphs == compiled, "Dynamo compiled again after the capture"
