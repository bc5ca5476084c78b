"""graphed.TrainStep on a GPU: whole iterations replayed equal eager training,
state is untouched by capture, non-finite steps are skipped in the graph."""

import copy

import pytest
import torch
from torch import nn

import graphed
from graphed import workloads

pytestmark = pytest.mark.gpu


def make_mlp(seed=0, dropout=0.0, batchnorm=False):
    torch.manual_seed(seed)
    layers = [nn.Linear(32, 64)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(64))
    layers += [nn.GELU(), nn.Dropout(dropout), nn.Linear(64, 1)]
    return nn.Sequential(*layers).cuda()


def batches(count, size=16, seed=1):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(size, 32, device="cuda", generator=generator),
             torch.randn(size, 1, device="cuda", generator=generator)) for _ in range(count)]


def twin(model, optimizer_kind=torch.optim.AdamW, **optimizer_args):
    """The model and an identical copy, each with its optimizer made capturable, so
    eager and graphed training run the same kernels."""
    other = copy.deepcopy(model)
    first = graphed.make_capturable(optimizer_kind(model.parameters(), **optimizer_args))
    second = graphed.make_capturable(optimizer_kind(other.parameters(), **optimizer_args))
    return (model, first), (other, second)


def iteration_of(model, optimizer):
    def iteration(batch):
        x, y = batch
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()
    return iteration


def state_copy(model, optimizer):
    return ([t.detach().clone() for t in model.state_dict().values()],
            [v.clone() for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor)])


def assert_same_state(a, b):
    for x, y in zip(a[0] + a[1], b[0] + b[1]):
        assert torch.equal(x, y)


def test_fifty_steps_equal_eager():
    (model, opt), (eager_model, eager_opt) = twin(make_mlp(), lr=1e-2)
    data = batches(50)
    step = graphed.TrainStep(iteration_of(model, opt), data[0])
    eager = iteration_of(eager_model, eager_opt)
    graphed_losses = torch.stack([step(b) for b in data])
    eager_losses = torch.stack([eager(b) for b in data])
    torch.testing.assert_close(graphed_losses, eager_losses, rtol=1e-6, atol=0)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert step.stats()["steps"] == 50


def test_construction_changes_nothing_and_first_step_is_eagers():
    model = make_mlp(batchnorm=True)
    opt = graphed.make_capturable(torch.optim.AdamW(model.parameters(), lr=1e-2))
    before = state_copy(model, opt)
    rng = torch.cuda.get_rng_state()
    step = graphed.TrainStep(iteration_of(model, opt), batches(1)[0])
    assert_same_state(state_copy(model, opt), before)
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    eager_model = copy.deepcopy(model)
    eager_opt = graphed.make_capturable(torch.optim.AdamW(eager_model.parameters(), lr=1e-2))
    batch = batches(1, seed=5)[0]
    torch.testing.assert_close(step(batch), iteration_of(eager_model, eager_opt)(batch),
                               rtol=0, atol=0)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert torch.equal(p, q)


def test_batchnorm_statistics_update_as_in_eager():
    (model, opt), (eager_model, eager_opt) = twin(make_mlp(batchnorm=True), lr=1e-2)
    data = batches(5)
    step = graphed.TrainStep(iteration_of(model, opt), data[0])
    eager = iteration_of(eager_model, eager_opt)
    for b in data:
        step(b)
        eager(b)
    torch.testing.assert_close(model[1].running_mean, eager_model[1].running_mean, rtol=1e-6,
                               atol=1e-7)
    assert int(model[1].num_batches_tracked) == 5


def test_dropout_loss_curve_follows_eager():
    (model, opt), (eager_model, eager_opt) = twin(make_mlp(dropout=0.2), lr=5e-3)
    data = batches(200)
    step = graphed.TrainStep(iteration_of(model, opt), data[0])
    eager = iteration_of(eager_model, eager_opt)
    graphed_losses = torch.stack([step(b) for b in data])
    eager_losses = torch.stack([eager(b) for b in data])
    # Different dropout masks: the curves differ step by step but not on average.
    assert abs(graphed_losses[-50:].mean() - eager_losses[-50:].mean()) < 0.1 * eager_losses[
        -50:].mean()
    assert graphed_losses[-50:].mean() < graphed_losses[:10].mean()
    first = step(data[0]).clone()
    assert not torch.equal(first, step(data[0])), "dropout masks must change between steps"


def test_lr_scheduler_changes_take_effect():
    (model, opt), (eager_model, eager_opt) = twin(make_mlp(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.1)
    eager_schedule = torch.optim.lr_scheduler.StepLR(eager_opt, step_size=3, gamma=0.1)
    data = batches(9)
    step = graphed.TrainStep(iteration_of(model, opt), data[0])
    eager = iteration_of(eager_model, eager_opt)
    for b in data:
        step(b)
        eager(b)
        schedule.step()
        eager_schedule.step()
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(1e-5)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_gradient_accumulation_over_four_microbatches():
    model = make_mlp()
    eager_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eager_opt = graphed.make_capturable(torch.optim.AdamW(eager_model.parameters(), lr=1e-2))
    data = batches(6, size=32)
    step = graphed.TrainStep.from_parts(model, opt, nn.functional.mse_loss, data[0],
                                        microbatches=4)
    for b in data:
        loss = step(b)
        eager_opt.zero_grad(set_to_none=True)
        total = 0
        for x, y in zip(b[0].chunk(4), b[1].chunk(4)):
            micro = nn.functional.mse_loss(eager_model(x), y) / 4
            micro.backward()
            total = total + micro.detach()
        eager_opt.step()
        torch.testing.assert_close(loss, total, rtol=1e-6, atol=0)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_nonfinite_batch_is_skipped_bit_identically():
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(3)
    step = graphed.TrainStep.from_parts(model, opt, nn.functional.mse_loss, data[0],
                                        skip_nonfinite=True, clip_grad_norm=1.0)
    step(data[0])
    before = state_copy(model, opt)
    bad = (data[1][0].clone(), data[1][1].clone())
    bad[0][3, 5] = float("nan")
    loss = step(bad)
    assert torch.isnan(loss).item()
    assert_same_state(state_copy(model, opt), before)
    assert step.skipped_steps == 1
    step(data[2])
    assert step.skipped_steps == 1
    assert not torch.equal(state_copy(model, opt)[0][0], before[0][0])


def test_failed_capture_leaves_state_bit_identical():
    model = make_mlp(batchnorm=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    graphed.make_capturable(opt)
    before = state_copy(model, opt)

    def syncing(batch):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if loss.item() > 1e9:  # a host sync: breaks capture
            return loss
        opt.step()
        return loss.detach()

    with pytest.raises(graphed.CaptureError, match=r"aten::_local_scalar_dense.*host read"):
        graphed.TrainStep(syncing, batches(1)[0])
    assert_same_state(state_copy(model, opt), before)


def test_mismatched_batch_and_bad_optimizer_are_explained():
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = graphed.TrainStep.from_parts(model, opt, nn.functional.mse_loss, batches(1)[0])
    with pytest.raises(graphed.InputMismatchError,
                       match=r"batch\[0\]: expected \(16, 32\) float32 cuda:0, got \(8, 32\)"):
        step(batches(1, size=8)[0])
    lbfgs = torch.optim.LBFGS(make_mlp().parameters())
    with pytest.raises(graphed.GraphedError, match="LBFGS cannot be captured"):
        graphed.make_capturable(lbfgs)


def test_memory_does_not_grow_over_ten_thousand_steps():
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = batches(1)[0]
    step = graphed.TrainStep.from_parts(model, opt, nn.functional.mse_loss, batch,
                                        skip_nonfinite=True)
    for _ in range(100):
        step(batch)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    reserved = torch.cuda.memory_reserved()
    for _ in range(10_000):
        step(batch)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    assert torch.cuda.memory_reserved() == reserved


def test_fp16_loss_scaling_and_bf16_autocast_train():
    for amp in ("fp16", "bf16"):
        model = make_mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = batches(30)
        step = graphed.TrainStep.from_parts(model, opt, nn.functional.mse_loss, data[0], amp=amp)
        losses = torch.stack([step(b) for b in data])
        finite = losses[torch.isfinite(losses)]
        # fp16 may overflow in its first steps at the initial scale; those are skipped.
        assert finite.numel() >= 25, (amp, losses)
        assert finite[-5:].mean() < finite[:5].mean(), (amp, losses)
        if amp == "fp16":
            assert 0 < step.loss_scale <= 65536.0
            assert step.skipped_steps < 10, step.skipped_steps
        else:
            assert step.loss_scale is None


def test_eval_graph_shares_the_pool():
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(2)
    step = graphed.TrainStep.from_parts(model, opt, nn.functional.mse_loss, data[0])
    step.capture_eval(lambda x: model(x), data[0][0])
    step(data[0])
    with torch.no_grad():
        expected = model(data[1][0])
    torch.testing.assert_close(step.evaluate(data[1][0]), expected)


def test_gpt_trainstep_matches_eager_for_ten_steps():
    workloads.configure_numerics()
    model, tokens, targets = workloads.gpt_train()
    eager_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    eager_opt = graphed.make_capturable(torch.optim.AdamW(eager_model.parameters(), lr=1e-4))
    step = graphed.TrainStep.from_parts(model, opt, workloads.gpt_loss, (tokens, targets))
    for _ in range(10):
        loss = step((tokens, targets))
        eager_opt.zero_grad(set_to_none=True)
        eager_loss = workloads.gpt_loss(eager_model(tokens), targets)
        eager_loss.backward()
        eager_opt.step()
        torch.testing.assert_close(loss, eager_loss.detach(), rtol=1e-5, atol=1e-6)
