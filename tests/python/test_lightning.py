"""graphed.integrations.lightning on the CPU: arguments, the step mode's
conditions and their reasons, fallbacks in a real Trainer.fit, and the
callback's Lightning bookkeeping (global_step, LR schedulers, accumulation,
clipping, logging) with an eager stand-in for the graph (lightning_models.py)."""

import logging

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch", reason="needs lightning: pip install lightning")

import graphed  # noqa: E402
from graphed.integrations import lightning as gl  # noqa: E402

from lightning_models import (  # noqa: E402
    CPUGraphs, MLPModule, regression_data, trainer)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# --- arguments ----------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, words", [
    ({"mode": "graph"}, ["'auto', 'step', 'modules'", "'graph'"]),
    ({"fallback": "ignore"}, ["'eager' or 'raise'", "'ignore'"]),
    ({"warmup": 0}, ["warmup", ">= 1", "0"]),
    ({"mode": "step", "buckets": {0: [8]}}, ["mode='modules'", "graphed.auto"]),
])
def test_bad_arguments_say_what_was_expected(kwargs, words):
    with pytest.raises(graphed.GraphedError) as info:
        gl.CUDAGraphs(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_defaults():
    callback = gl.CUDAGraphs()
    assert (callback.mode, callback.fallback, callback.warmup, callback.validation) == (
        "auto", "eager", 3, True)
    assert callback.report["active"] == "eager" and callback.fallbacks == []


# --- the conditions of the step mode -----------------------------------------------

class Probe(pl.Callback):
    """Reads step_conditions at on_fit_start and stops the fit."""

    def __init__(self):
        self.result = None

    def on_fit_start(self, trainer, pl_module):
        self.result = gl.step_conditions(trainer, pl_module, self, require_cuda=False)
        trainer.should_stop = True


def conditions(module, **trainer_kwargs):
    probe = Probe()
    t, _ = trainer([probe], max_steps=1, **trainer_kwargs)
    t.fit(module, regression_data(batches=2))
    return probe.result


def test_conditions_hold_and_map_the_trainer_settings():
    settings, reasons = conditions(MLPModule(), precision="bf16-mixed",
                                   accumulate_grad_batches=4, gradient_clip_val=0.5)
    assert reasons == []
    assert settings == gl.StepSettings(microbatches=4, clip_grad_norm=0.5, amp="bf16")
    settings, _ = conditions(MLPModule())
    assert settings.amp is None and settings.clip_grad_norm is None
    # On the CPU Lightning turns 16-mixed into bf16-mixed; on a GPU it is fp16
    # autocast with loss scaling, which graphed's own scaling replaces.
    assert gl.PRECISIONS["16-mixed"] == "fp16"


class TwoOptimizers(MLPModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.manual_backward(loss)
        first.step()
        second.step()

    def configure_optimizers(self):
        return [torch.optim.AdamW(self.net[0].parameters()),
                torch.optim.AdamW(self.net[2].parameters())]


class ReadsBatchIdx(MLPModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, 0)
        return loss * 2 if batch_idx == 0 else loss


class ReadsGlobalStep(MLPModule):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * (1 + 0 * self.global_step)


class OverridesBackwardHook(MLPModule):
    def on_after_backward(self):
        pass


class ClipsInAHook(pl.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        pass


@pytest.mark.parametrize("make, trainer_kwargs, words", [
    (lambda: MLPModule(optimizer="lbfgs"), {}, ["LBFGS", "capturable", "fused=True"]),
    (TwoOptimizers, {}, ["manual optimization", "2 optimizers"]),
    (MLPModule, {"gradient_clip_val": 1.0, "gradient_clip_algorithm": "value"},
     ["gradient_clip_algorithm='value'", "'norm'"]),
    (MLPModule, {"precision": "64-true"}, ["precision='64-true'", "'bf16-mixed'"]),
    (OverridesBackwardHook, {}, ["overrides on_after_backward", "mode='modules'"]),
    (MLPModule, {"callbacks_extra": ClipsInAHook}, ["ClipsInAHook", "on_before_optimizer_step"]),
    (ReadsBatchIdx, {}, ["reads its argument `batch_idx`", "freeze"]),
    (ReadsGlobalStep, {}, ["self.global_step", "freeze"]),
])
def test_conditions_name_what_stops_the_step_mode(make, trainer_kwargs, words):
    extra = trainer_kwargs.pop("callbacks_extra", None)
    probe = Probe()
    t, _ = trainer([probe] + ([extra()] if extra else []), max_steps=1, **trainer_kwargs)
    t.fit(make(), regression_data(batches=2))
    settings, reasons = probe.result
    assert settings is None
    text = " | ".join(reasons)
    for word in words:
        assert word in text, text


def test_conditions_refuse_torchmetrics_in_the_module():
    torchmetrics = pytest.importorskip("torchmetrics")

    class WithMetric(MLPModule):
        def __init__(self):
            super().__init__()
            self.mse = torchmetrics.MeanSquaredError()

    settings, reasons = conditions(WithMetric())
    assert settings is None and any("torchmetrics" in r for r in reasons)


def test_parameter_reads():
    def reads(batch, batch_idx):
        return batch_idx + 1

    def ignores(batch, batch_idx):
        return batch

    def reads_in_a_closure(batch, batch_idx):
        return (lambda: batch_idx)()

    assert gl._parameter_reads(reads, 1) == "batch_idx"
    assert gl._parameter_reads(ignores, 1) is None
    assert gl._parameter_reads(reads_in_a_closure, 1) == "batch_idx"
    assert gl._parameter_reads(ignores, 5) is None


# --- batches and logging --------------------------------------------------------------

def test_windows_concatenate_and_split_back_exactly():
    batches = [{"x": torch.randn(4, 3), "y": (torch.randn(4), 7)} for _ in range(3)]
    combined = gl.concat_batches(batches)
    assert combined["x"].shape == (12, 3) and combined["y"][1] == 7
    for original, (micro,) in zip(batches, graphed.train.split_batch((combined,), 3)):
        assert torch.equal(original["x"], micro["x"])
        assert torch.equal(original["y"][0], micro["y"][0]) and micro["y"][1] == 7
    with pytest.raises(ValueError, match="differ"):
        gl.concat_batches([torch.randn(4, 3), torch.randn(2, 3)])
    with pytest.raises(ValueError, match="zero-dimensional"):
        gl.concat_batches([torch.tensor(1.0), torch.tensor(2.0)])


def test_signatures_describe_the_difference():
    a = gl.batch_signature((torch.zeros(4, 8), torch.zeros(4, dtype=torch.long)))
    b = gl.batch_signature((torch.zeros(2, 8), torch.zeros(2, dtype=torch.long)))
    assert a != b
    assert gl.describe_signature(a) == "([4, 8] float32, [4] int64)"
    assert gl.describe_signature(gl.batch_signature({"ids": torch.zeros(2)})) == "{'ids': [2] float32}"


def test_recorder_keeps_the_mean_over_microbatches_in_one_buffer():
    recorder = gl.LogRecorder(microbatches=2)
    for index, value in enumerate([1.0, 3.0]):
        recorder.index = index
        recorder.log("loss", torch.tensor(value), prog_bar=True)
    buffer = recorder.logged["loss"].value
    recorder.index = 0
    recorder.log("loss", torch.tensor(5.0), prog_bar=True)
    assert recorder.logged["loss"].value is buffer  # the same buffer, written again
    recorder.index = 1
    recorder.log("loss", torch.tensor(7.0), prog_bar=True)
    assert buffer.item() == 6.0
    recorder.log("lr", 0.5)
    assert recorder.frozen == ["lr"]
    calls = []
    recorder.replay(lambda name, value, *a, **k: calls.append((name, k)))
    assert calls == [("loss", {"prog_bar": True}), ("lr", {})]
    with pytest.raises(graphed.GraphedError, match="tensors and numbers"):
        recorder.log("m", object())
    with pytest.raises(graphed.GraphedError, match="single-element"):
        recorder.log("v", torch.ones(3))


# --- fits on the CPU ----------------------------------------------------------------

def test_fit_on_cpu_falls_back_with_the_reason(caplog):
    callback = gl.CUDAGraphs()
    t, _ = trainer([callback], max_steps=7)
    with caplog.at_level(logging.WARNING, logger="graphed.integrations.lightning"):
        t.fit(MLPModule(), regression_data())
    assert t.global_step == 7
    assert callback.report["active"] == "eager"
    assert "CUDA" in callback.fallbacks[0]["reason"]
    assert "Trainer(accelerator='gpu')" in caplog.text


def test_fallback_raise_raises_graphed_error():
    t, _ = trainer([gl.CUDAGraphs(fallback="raise")], max_steps=2)
    with pytest.raises(graphed.GraphedError, match="CUDA"):
        t.fit(MLPModule(), regression_data())


def test_step_mode_refusal_falls_back_eagerly_in_a_fit():
    callback = CPUGraphs(mode="step")
    t, _ = trainer([callback], max_steps=5, gradient_clip_val=1.0,
                   gradient_clip_algorithm="value")
    t.fit(MLPModule(), regression_data())
    assert t.global_step == 5 and callback.report["active"] == "eager"
    assert "'value'" in callback.fallbacks[0]["reason"]


def run_pair(module_kwargs=None, **trainer_kwargs):
    """The same fit without and with the callback (its step run eagerly)."""
    results = []
    for callback in (None, CPUGraphs()):
        module = MLPModule(**(module_kwargs or {}))
        t, logger = trainer([callback] if callback else [], **trainer_kwargs)
        t.fit(module, regression_data(), regression_data(batches=2, remainder=0))
        results.append((module, t, logger, callback))
    return results


def training_reasons(callback):
    return " | ".join(f["reason"] for f in callback.fallbacks
                      if not f["what"].startswith("validation"))


def assert_same_parameters(a, b):
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("scheduler", [None, "step", "epoch", "lambda"])
def test_step_mode_matches_lightning(scheduler):
    (m1, t1, l1, _), (m2, t2, l2, cb) = run_pair({"scheduler": scheduler}, max_epochs=2)
    assert t1.global_step == t2.global_step == 22
    assert_same_parameters(m1, m2)
    assert l1.series("train_loss") == l2.series("train_loss")
    assert l1.series("val_loss") == l2.series("val_loss")
    report = cb.report
    assert report["active"] == "step" and report["graphed_steps"] == 20
    # the last batch of each epoch has 2 rows, not 4: eager, with the reason
    assert report["eager_steps"] == 2
    assert "drop_last=True" in training_reasons(cb)
    assert t1.optimizers[0].param_groups[0]["lr"] == t2.optimizers[0].param_groups[0]["lr"]


def test_step_mode_accumulates_and_clips_as_lightning():
    (m1, t1, l1, _), (m2, t2, l2, cb) = run_pair(
        max_epochs=2, accumulate_grad_batches=3, gradient_clip_val=0.05)
    # 11 batches per epoch: windows of 3, 3, 3 and a last one of 2
    assert t1.global_step == t2.global_step == 8
    assert_same_parameters(m1, m2)
    assert cb.report["graphed_steps"] == 6 and cb.report["eager_steps"] == 2
    assert "2 of 3 batches" in training_reasons(cb)
    # Lightning logs once per optimizer step: eagerly the window's last
    # batch's value, from the graph the window's mean (Note [Logging from a
    # graph]); the eager windows (the epochs' last) log the same value
    eager = l1.series("train_loss")
    graphed_ = l2.series("train_loss")
    assert [s for s, _ in eager] == [s for s, _ in graphed_]
    assert eager[3] == graphed_[3] and eager[7] == graphed_[7]


def test_max_steps_ends_the_fit():
    (_, t1, _, _), (_, t2, _, cb) = run_pair(max_steps=7, accumulate_grad_batches=2)
    assert t1.global_step == t2.global_step == 7
    # 11 batches in the first epoch: five windows of 2, and 1 batch eagerly
    assert (cb.report["graphed_steps"], cb.report["eager_steps"]) == (6, 1)


def test_teardown_puts_lightning_back():
    callback = CPUGraphs()
    module = MLPModule()
    t, _ = trainer([callback], max_steps=3)
    t.fit(module, regression_data(), regression_data(batches=2, remainder=0))
    assert "run" not in t.fit_loop.epoch_loop.automatic_optimization.__dict__
    assert "validation_step" not in module.__dict__ and "log" not in module.__dict__
    assert callback.report["graphed_steps"] == 3


def test_changed_hyperparameter_stops_the_step_mode():
    class Cycles(MLPModule):
        def on_train_batch_start(self, batch, batch_idx):
            if batch_idx == 4:
                self.optimizers().optimizer.param_groups[0]["weight_decay"] = 0.5

    callback = CPUGraphs(mode="step")
    t, _ = trainer([callback], max_steps=8)
    t.fit(Cycles(), regression_data())
    assert t.global_step == 8 and callback.report["active"] == "eager"
    assert "'weight_decay'" in callback.fallbacks[0]["reason"]


def test_validation_graphs_need_cuda_and_stay_eager_on_cpu():
    callback = CPUGraphs()
    module = MLPModule()
    t, logger = trainer([callback], max_steps=4, val_check_interval=2)
    t.fit(module, regression_data(), regression_data(batches=3, remainder=0))
    # the second validation batch of a signature would be captured: on the
    # CPU capture refuses, and validation goes on eagerly with the reason
    assert logger.series("val_loss")
    assert any(f["what"].startswith("validation batches") for f in callback.fallbacks)
    assert callback.report["eval_graphs"] == 0


def test_modules_mode_installs_and_removes_graphed_auto():
    callback = CPUGraphs(mode="modules", modules=["net"])
    module = MLPModule()
    cls = type(module)
    seen = {}

    class Spy(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen["class"] = type(pl_module)

    t, _ = trainer([callback, Spy()], max_steps=3)
    t.fit(module, regression_data())
    assert t.global_step == 3
    assert seen["class"] is not cls and issubclass(seen["class"], cls)
    assert type(module) is cls and "forward" not in module.net.__dict__
    assert "modules" in callback.report
