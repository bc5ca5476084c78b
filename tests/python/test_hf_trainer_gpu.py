"""graphed.integrations.transformers on a GPU: a tiny GPT-2 trained 20 steps
by the plain Trainer and by GraphedTrainer (mode="step", one captured graph
per optimizer step) logs the same losses, learning rates and gradient norms;
gradient accumulation, clipping, the LR schedule and bf16 each checked;
evaluation replays graphs; mode="modules" trains through graphed.auto."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from graphed.integrations import transformers as hf  # noqa: E402
import hf_trainer_models as models  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32")]

STEPS = 20


def tiny_gpt2(seed=0):
    return models.tiny_gpt2(seed, vocab=128, length=64, width=64, heads=4)


class TokenData(models.TokenData):
    def __init__(self, count, length=32, seed=1, ignore_some=True):
        super().__init__(count, length, seed, ignore_some, vocab=128)


def arguments(path, **overrides):
    values = dict(output_dir=str(path), per_device_train_batch_size=4,
                  per_device_eval_batch_size=4, max_steps=STEPS, logging_steps=1,
                  report_to="none", save_strategy="no", learning_rate=1e-3, seed=0,
                  optim="adamw_torch_fused", max_grad_norm=0.0, dataloader_drop_last=True,
                  disable_tqdm=True)
    values.update(overrides)
    return transformers.TrainingArguments(**values)


def logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if "loss" in entry and key in entry]


def run_both(tmp_path, rel=1e-4, count=None, **settings):
    accumulation = settings.get("gradient_accumulation_steps", 1)
    data = TokenData(count or 4 * accumulation * STEPS)
    plain = transformers.Trainer(model=tiny_gpt2().cuda(),
                                 args=arguments(tmp_path / "p", **settings), train_dataset=data)
    plain.train()
    trainer = hf.GraphedTrainer(model=tiny_gpt2().cuda(),
                                args=arguments(tmp_path / "g", **settings), train_dataset=data,
                                graphed_fallback="raise")
    trainer.train()
    report = trainer.graphed_report
    assert report.mode == "step", repr(report)
    assert report.graphed_steps == STEPS and report.eager_steps == 0, repr(report)
    assert trainer.state.global_step == plain.state.global_step == STEPS
    assert logged(trainer, "loss") == pytest.approx(logged(plain, "loss"), rel=rel)
    assert logged(trainer, "learning_rate") == pytest.approx(logged(plain, "learning_rate"),
                                                             rel=1e-6)
    return plain, trainer


def test_losses_equal_the_plain_trainer(tmp_path):
    plain, trainer = run_both(tmp_path)
    assert len(logged(trainer, "loss")) == STEPS
    stats = trainer.graphed_report.as_dict()["train_step"]
    assert stats["steps"] == STEPS


def test_linear_warmup_schedule(tmp_path):
    plain, trainer = run_both(tmp_path, lr_scheduler_type="linear", warmup_steps=5)
    rates = logged(trainer, "learning_rate")
    assert rates[0] == 0.0 and max(rates) == pytest.approx(1e-3)


def test_max_grad_norm(tmp_path):
    plain, trainer = run_both(tmp_path, max_grad_norm=0.25)
    assert logged(trainer, "grad_norm") == pytest.approx(logged(plain, "grad_norm"), rel=1e-4)
    assert max(logged(trainer, "grad_norm")) > 0.25  # clipping did something


def test_gradient_accumulation(tmp_path):
    plain, trainer = run_both(tmp_path, gradient_accumulation_steps=2, max_grad_norm=1.0)
    assert trainer.graphed_report.train_step.stats()["steps"] == STEPS


def test_bf16(tmp_path):
    run_both(tmp_path, rel=2e-3, bf16=True)


def test_plain_adamw_is_made_fused(tmp_path):
    plain, trainer = run_both(tmp_path, rel=1e-3, optim="adamw_torch")
    assert any("fused implementation" in note for note in trainer.graphed_report.notes)


def test_fp16_with_graphed_loss_scaling(tmp_path):
    # A constant schedule: the plain Trainer does not step its scheduler after a step its
    # GradScaler skipped, graphed does (documented), so a decaying schedule could drift.
    plain, trainer = run_both(tmp_path, rel=5e-3, fp16=True, max_grad_norm=1.0,
                              lr_scheduler_type="constant")
    assert any("fp16 loss scaling" in note for note in trainer.graphed_report.notes)


def test_partial_last_batch_runs_eagerly_with_a_reason(tmp_path):
    data = TokenData(4 * 5 + 2)
    trainer = hf.GraphedTrainer(model=tiny_gpt2().cuda(),
                                args=arguments(tmp_path, max_steps=-1, num_train_epochs=2,
                                               dataloader_drop_last=False),
                                train_dataset=data)
    trainer.train()
    report = trainer.graphed_report
    assert trainer.state.global_step == 12
    assert report.graphed_steps == 10 and report.eager_steps == 2
    assert any("dataloader_drop_last=True" in f["reason"] for f in report.fallbacks)
    assert all(loss == loss for loss in logged(trainer, "loss"))


def test_evaluation_replays_graphs(tmp_path):
    data = TokenData(4 * 3 + 2)  # batches of 4, 4, 4 and 2: two graphs
    settings = dict(dataloader_drop_last=False)
    plain = transformers.Trainer(model=tiny_gpt2().cuda(),
                                 args=arguments(tmp_path / "p", **settings), eval_dataset=data)
    trainer = hf.GraphedTrainer(model=tiny_gpt2().cuda(),
                                args=arguments(tmp_path / "g", **settings), eval_dataset=data)
    expected = plain.evaluate()["eval_loss"]
    for _ in range(2):
        assert trainer.evaluate()["eval_loss"] == pytest.approx(expected, rel=1e-5)
    report = trainer.graphed_report
    assert report.eval_graphs == 2 and report.eval_replays == 8, repr(report)
    predictions = trainer.predict(data)
    reference = plain.predict(data)
    torch.testing.assert_close(torch.as_tensor(predictions.predictions),
                               torch.as_tensor(reference.predictions), rtol=1e-4, atol=1e-4)


def test_train_then_evaluate(tmp_path):
    data = TokenData(4 * STEPS)
    trainer = hf.GraphedTrainer(model=tiny_gpt2().cuda(), args=arguments(tmp_path, max_steps=8),
                                train_dataset=data, eval_dataset=TokenData(8, seed=2))
    trainer.train()
    graphed_loss = trainer.evaluate()["eval_loss"]
    assert trainer.graphed_report.train_step is not None
    eager = transformers.Trainer(model=trainer.model, args=arguments(tmp_path / "e"),
                                 eval_dataset=TokenData(8, seed=2))
    assert graphed_loss == pytest.approx(eager.evaluate()["eval_loss"], rel=1e-5)


def test_modules_mode(tmp_path):
    data = TokenData(4 * STEPS)
    plain = transformers.Trainer(model=tiny_gpt2().cuda(), args=arguments(tmp_path / "p"),
                                 train_dataset=data)
    plain.train()
    trainer = hf.optimize_trainer(
        transformers.Trainer(model=tiny_gpt2().cuda(), args=arguments(tmp_path / "g"),
                             train_dataset=data), mode="modules")
    trainer.train()
    assert trainer.graphed_report.mode == "modules"
    assert trainer.state.global_step == STEPS
    assert logged(trainer, "loss") == pytest.approx(logged(plain, "loss"), rel=1e-3)
    assert trainer.model.graphed_stats()["replays"] > 0
