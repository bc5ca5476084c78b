"""graphed.integrations.lightning.CUDAGraphs on a GPU: Trainer.fit with the
callback equals Trainer.fit without it, step for step (fused AdamW on both
sides; the eager side's optimizer is made capturable too, so both run the same
kernels on a device learning rate), with LR schedules, clipping, gradient
accumulation, bf16 and fp16 mixed precision, validation graphs, the last
partial batch, and the modules mode."""

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="needs lightning: pip install lightning")

from graphed.integrations.lightning import CUDAGraphs  # noqa: E402

from lightning_models import (  # noqa: E402
    GPTModule, MLPModule, StepOutputs, regression_data, token_data, trainer)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

STEPS = 20


def fit_pair(make_module, train_data, val_data=None, callback_kwargs=None, **trainer_kwargs):
    """Fits a fresh module without and with CUDAGraphs; returns per side
    (module, trainer, logger, batch outputs, callback)."""
    sides = []
    for graphed in (False, True):
        module = make_module(capturable_eager=not graphed)
        callback = CUDAGraphs(**(callback_kwargs or {})) if graphed else None
        outputs = StepOutputs()
        callbacks = [outputs] + ([callback] if callback else [])
        t, logger = trainer(callbacks, accelerator="gpu", max_steps=STEPS, **trainer_kwargs)
        t.fit(module, train_data(), val_data() if val_data else None)
        torch.cuda.synchronize()
        sides.append((module, t, logger, outputs, callback))
    return sides


def losses(logger, key="train_loss"):
    return torch.tensor([v for _, v in logger.series(key)], dtype=torch.float64)


def assert_equal_fits(eager, graphed, rtol=0.0):
    (m1, t1, l1, _, _), (m2, t2, l2, _, cb) = eager, graphed
    assert t1.global_step == t2.global_step == STEPS
    report = cb.report
    assert report["active"] == "step", report["fallbacks"]
    a, b = losses(l1), losses(l2)
    assert len(a) == len(b) == STEPS
    if rtol == 0:
        assert torch.equal(a, b), (a - b).abs().max()
        for p, q in zip(m1.parameters(), m2.parameters()):
            assert torch.equal(p, q)
    else:
        torch.testing.assert_close(b, a, rtol=rtol, atol=0)
    return report


@pytest.mark.parametrize("scheduler", [None, "step", "epoch", "lambda"])
def test_mlp_fit_equals_lightning_bit_for_bit(scheduler):
    make = lambda **kw: MLPModule(scheduler=scheduler, fused=True, **kw)  # noqa: E731
    eager, graphed = fit_pair(make, lambda: regression_data(batches=8, remainder=0),
                              lambda: regression_data(batches=3, remainder=0, seed=2),
                              val_check_interval=4)
    report = assert_equal_fits(eager, graphed)
    assert report["graphed_steps"] == STEPS and report["eager_steps"] == 0
    lr1 = eager[1].optimizers[0].param_groups[0]["lr"]
    lr2 = graphed[1].optimizers[0].param_groups[0]["lr"]
    assert float(lr1) == float(lr2)
    # validation: the first batch of a signature eagerly, then its graph
    assert report["eval_graphs"] == 1 and report["eval_replays"] > 0
    torch.testing.assert_close(losses(graphed[2], "val_loss"), losses(eager[2], "val_loss"),
                               rtol=1e-6, atol=0)


def test_gpt2_fit_equals_lightning_bit_for_bit():
    eager, graphed = fit_pair(GPTModule, lambda: token_data(STEPS),
                              lambda: token_data(2, seed=3))
    report = assert_equal_fits(eager, graphed)
    assert report["step_graph"]["steps"] == STEPS


def test_clipping_by_norm():
    make = lambda **kw: MLPModule(fused=True, **kw)  # noqa: E731
    eager, graphed = fit_pair(make, lambda: regression_data(batches=STEPS, remainder=0),
                              gradient_clip_val=0.05)
    # The norm is summed in another order than torch.nn.utils.clip_grad_norm_'s
    # (graphed's guard computes it on the device in its own kernels), so the
    # clip coefficient can differ in the last bit.
    report = assert_equal_fits(eager, graphed, rtol=1e-6)
    assert report["settings"]["clip_grad_norm"] == 0.05


def test_accumulation_replays_one_graph_per_window():
    make = lambda **kw: MLPModule(fused=True, scheduler="step", **kw)  # noqa: E731
    eager, graphed = fit_pair(make, lambda: regression_data(batches=4 * STEPS, remainder=0),
                              accumulate_grad_batches=4, gradient_clip_val=0.5)
    (m1, t1, _, out1, _), (m2, t2, _, out2, cb) = eager, graphed
    assert t1.global_step == t2.global_step == STEPS
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    # Lightning returns loss / 4 for each batch; the graph the window's sum
    eager_windows = [sum(out1.losses[i:i + 4], torch.zeros((), device="cuda"))
                     for i in range(0, len(out1.losses), 4)]
    torch.testing.assert_close(torch.stack(out2.losses), torch.stack(eager_windows),
                               rtol=1e-6, atol=0)
    assert cb.report["graphed_steps"] == STEPS and cb.report["settings"]["microbatches"] == 4


def test_last_partial_batch_runs_eagerly_with_lightnings_semantics():
    make = lambda **kw: MLPModule(fused=True, **kw)  # noqa: E731
    eager, graphed = fit_pair(make, lambda: regression_data(batches=9, remainder=2))
    report = assert_equal_fits(eager, graphed)
    assert report["eager_steps"] == 2
    assert any("drop_last=True" in f["reason"] for f in report["fallbacks"])


def test_bf16_mixed():
    eager, graphed = fit_pair(GPTModule, lambda: token_data(STEPS), precision="bf16-mixed")
    report = assert_equal_fits(eager, graphed, rtol=1e-4)
    assert report["settings"]["amp"] == "bf16"


def test_fp16_mixed_uses_graphed_loss_scaling():
    eager, graphed = fit_pair(GPTModule, lambda: token_data(STEPS), precision="16-mixed")
    report = assert_equal_fits(eager, graphed, rtol=1e-3)
    assert report["settings"]["amp"] == "fp16"


def test_modules_mode_trains_under_lightnings_loop():
    eager, graphed = fit_pair(GPTModule, lambda: token_data(STEPS),
                              callback_kwargs={"mode": "modules"})
    (_, t1, l1, _, _), (m2, t2, l2, _, cb) = eager, graphed
    assert t1.global_step == t2.global_step == STEPS
    assert cb.report["active"] == "modules"
    torch.testing.assert_close(losses(l2), losses(l1), rtol=1e-4, atol=0)
    assert type(m2) is GPTModule  # put back after the fit
    assert cb.report["modules"]["captures"] > 0


def test_non_capturable_optimizer_falls_back_with_the_reason():
    class Adagrad(MLPModule):
        def configure_optimizers(self):
            return torch.optim.Adagrad(self.parameters(), lr=1e-2)

    for mode, active in (("step", "eager"), ("auto", "modules")):
        callback = CUDAGraphs(mode=mode)
        t, _ = trainer([callback], accelerator="gpu", max_steps=5)
        t.fit(Adagrad(), regression_data())
        assert t.global_step == 5
        assert callback.report["active"] == active
        assert "Adagrad" in callback.fallbacks[0]["reason"]
