"""graphed.integrations.transformers on the CPU: argument handling, the
conditions that decide the mode and their messages, fallbacks with reasons,
and the Trainer loop around a captured step.

The loop tests replace graphed.TrainStep with a Python reference of the
iteration (the order of Note [One training iteration]) run eagerly, so that
the integration's part (micro-batches collected and merged, loss
normalization, the optimizer step skipped by the loop, the learning rate as a
tensor, the logged loss and gradient norm) is checked against the plain
Trainer without a GPU. test_hf_trainer_gpu.py runs the real capture."""

import logging
import sys
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

import graphed  # noqa: E402
from graphed import GraphedError  # noqa: E402
from graphed.integrations import transformers as hf  # noqa: E402
from graphed.train import split_batch  # noqa: E402
from hf_trainer_models import TokenData, tiny_gpt2  # noqa: E402


# --- a tiny model and data --------------------------------------------------------

def training_args(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4,
                  per_device_eval_batch_size=4, max_steps=6, logging_steps=1, report_to="none",
                  save_strategy="no", learning_rate=1e-3, seed=0, optim="adamw_torch",
                  disable_tqdm=True)
    values.update(overrides)
    return transformers.TrainingArguments(**values)


def losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


# --- arguments and conditions --------------------------------------------------------

def test_training_blockers_say_what_was_expected_found_and_the_fix():
    assert hf.training_blockers(device_type="cuda") == []
    reasons = hf.training_blockers(device_type="cpu", n_gpu=2, world_size=2,
                                   distributed_type="MULTI_CPU", deepspeed=True, fsdp=True,
                                   torch_compile=True, parallelism=True)
    text = " ".join(reasons)
    assert len(reasons) == 7
    assert "CUDA GPU, found device 'cpu'" in text
    assert "DeepSpeed is not supported" in text and "FSDP is not supported" in text
    assert "n_gpu=2" in text and "CUDA_VISIBLE_DEVICES" in text
    assert "Expected one process on one GPU, or DistributedDataParallel" in text
    assert "world_size=2" in text and "MULTI_CPU" in text
    # DDP (accelerate's MULTI_GPU, as torchrun gives) is the step mode's to decide.
    assert hf.training_blockers(device_type="cuda", world_size=2,
                                distributed_type="MULTI_GPU") == []
    assert "torch_compile=False" in text


def test_step_blockers():
    assert hf.step_blockers(optim="adamw_torch_fused") == []
    assert hf.step_blockers(optim="adafactor", custom_optimizer=True) == []
    (reason,) = hf.step_blockers(optim="adafactor")
    assert "found optim='adafactor'" in reason and "adamw_torch_fused" in reason
    (reason,) = hf.step_blockers(optim="sgd", gradient_checkpointing=True)
    assert "gradient_checkpointing=False" in reason
    (reason,) = hf.step_blockers(optim="sgd", fp16=True, half_precision_backend="apex")
    assert "half_precision_backend='auto'" in reason
    (reason,) = hf.step_blockers(optim="sgd", training_step_owner="MyTrainer")
    assert "MyTrainer.training_step overrides" in reason


def test_choose_mode():
    assert hf.choose_mode("step", "eager", [], []) == ("step", [])
    assert hf.choose_mode("modules", "eager", [], ["optim"]) == ("modules", [])
    assert hf.choose_mode("step", "eager", [], ["optim"]) == ("eager", ["optim"])
    assert hf.choose_mode("step", "modules", [], ["optim"]) == ("modules", ["optim"])
    assert hf.choose_mode("step", "modules", ["no gpu"], []) == ("eager", ["no gpu"])
    with pytest.raises(GraphedError, match="cannot run the Trainer in mode='step': optim"):
        hf.choose_mode("step", "raise", [], ["optim"])
    with pytest.raises(GraphedError, match="Expected mode to be one of"):
        hf.choose_mode("graphs", "eager", [], [])
    with pytest.raises(GraphedError, match="Expected fallback to be one of"):
        hf.choose_mode("step", "ignore", [], [])


def test_merge_microbatches_round_trips_through_split_batch():
    a = {"input_ids": torch.arange(8).view(2, 4), "labels": torch.arange(8).view(2, 4), "k": 3}
    b = {"input_ids": torch.arange(8, 16).view(2, 4), "labels": torch.arange(8, 16).view(2, 4),
         "k": 3}
    merged, reason = hf.merge_microbatches([a, b], torch.tensor(14))
    assert reason == ""
    assert merged["input_ids"].shape == (4, 4)
    assert merged[hf._ITEMS_KEY].tolist() == [14, 14]
    parts = split_batch(merged, 2)
    assert torch.equal(parts[0]["input_ids"], a["input_ids"])
    assert torch.equal(parts[1]["labels"], b["labels"])
    assert parts[1]["k"] == 3 and parts[1][hf._ITEMS_KEY].shape == (1,)
    merged, reason = hf.merge_microbatches([a], 7)  # an int count becomes a tensor
    assert merged[hf._ITEMS_KEY].tolist() == [7] and merged["input_ids"] is a["input_ids"]


def test_merge_microbatches_refuses_with_reasons():
    a = {"input_ids": torch.zeros(2, 4)}
    assert "differ in 'input_ids'" in hf.merge_microbatches([a, {"input_ids": torch.zeros(2, 5)}],
                                                            None)[1]
    assert "different keys" in hf.merge_microbatches([a, {"x": torch.zeros(2, 4)}], None)[1]
    assert "dicts of model arguments" in hf.merge_microbatches([torch.zeros(2)], None)[1]
    assert "0-dimensional" in hf.merge_microbatches([{"x": torch.tensor(1.0)}], None)[1]
    assert "single number" in hf.merge_microbatches([a], torch.zeros(2))[1]


def test_batch_signature():
    a = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "flag": True}
    assert hf.batch_signature(a) == hf.batch_signature(dict(a))
    assert hf.batch_signature(a) != hf.batch_signature({**a, "input_ids": torch.zeros(1, 4)})
    assert hf.describe_signature(hf.batch_signature(a)) == "input_ids: [2, 4]"


def test_constructor_arguments(tmp_path):
    args = training_args(tmp_path)
    with pytest.raises(GraphedError, match="Expected graphed_mode to be one of"):
        hf.GraphedTrainer(model=tiny_gpt2(), args=args, graphed_mode="whole")
    with pytest.raises(GraphedError, match="Expected graphed_fallback to be one of"):
        hf.GraphedTrainer(model=tiny_gpt2(), args=args, graphed_fallback="skip")
    with pytest.raises(GraphedError, match="Expected warmup to be an int >= 1"):
        hf.GraphedTrainer(model=tiny_gpt2(), args=args, graphed_warmup=0)
    with pytest.raises(GraphedError, match="Expected a transformers.Trainer"):
        hf.optimize_trainer(object())
    with pytest.raises(GraphedError, match="Expected mode to be one of"):
        hf.optimize_trainer(transformers.Trainer(model=tiny_gpt2(), args=args), mode="x")


def test_fallback_raise_refuses_at_construction_on_cpu(tmp_path):
    with pytest.raises(GraphedError, match="needs the Trainer to run on a CUDA GPU"):
        hf.GraphedTrainer(model=tiny_gpt2(), args=training_args(tmp_path),
                          graphed_fallback="raise")


def test_blockers_of_a_trainer(tmp_path):
    trainer = hf.GraphedTrainer(model=tiny_gpt2(), args=training_args(tmp_path, optim="adafactor"))
    blockers = trainer.graphed_blockers()
    assert any("CUDA GPU" in r for r in blockers["training"])
    assert any("optim='adafactor'" in r for r in blockers["step"])

    class MyTrainer(transformers.Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            return super().training_step(model, inputs, num_items_in_batch)

    mine = hf.optimize_trainer(MyTrainer(model=tiny_gpt2(), args=training_args(tmp_path)))
    assert isinstance(mine, MyTrainer) and type(mine).__name__ == "GraphedMyTrainer"
    assert any("MyTrainer.training_step overrides" in r for r in mine.graphed_blockers()["step"])


# --- a plain Trainer run on the CPU: clean fallback --------------------------------------

def test_cpu_run_falls_back_cleanly_and_matches_the_plain_trainer(tmp_path, caplog):
    data = TokenData()
    plain = transformers.Trainer(model=tiny_gpt2(), args=training_args(tmp_path / "p"),
                                 train_dataset=data, eval_dataset=data)
    plain.train()
    caplog.set_level(logging.WARNING, logger="graphed.integrations.transformers")
    trainer = hf.GraphedTrainer(model=tiny_gpt2(), args=training_args(tmp_path / "g"),
                                train_dataset=data, eval_dataset=data)
    result = trainer.train()
    assert trainer.state.global_step == 6 and result.global_step == 6
    assert losses(trainer) == losses(plain)
    report = trainer.graphed_report
    assert report.mode == "eager" and report.graphed_steps == 0
    assert report.fallbacks[0]["scope"] == "trainer"
    assert "CUDA GPU" in report.fallbacks[0]["reason"]
    assert any("CUDA GPU" in record.getMessage() for record in caplog.records)
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == pytest.approx(plain.evaluate()["eval_loss"])
    assert report.eval_replays == 0
    assert "mode eager" in repr(report)
    assert report.as_dict()["fallbacks"] == report.fallbacks


def test_optimize_trainer_patches_an_instance(tmp_path):
    trainer = transformers.Trainer(model=tiny_gpt2(), args=training_args(tmp_path, max_steps=2),
                                   train_dataset=TokenData())
    assert hf.optimize_trainer(trainer, mode="modules") is trainer
    assert isinstance(trainer, transformers.Trainer)
    trainer.train()
    assert trainer.state.global_step == 2
    assert trainer.graphed_report.requested_mode == "modules"
    assert trainer.graphed_report.mode == "eager"


# --- the loop around a captured step, with a reference iteration ------------------------

class ReferenceStep:
    """graphed.TrainStep.from_parts as an eager Python iteration: the order of
    Note [One training iteration], no capture."""

    instances = []

    def __init__(self, model, optimizer, batch, microbatches, clip, amp):
        self.model, self.optimizer = model, optimizer
        self.microbatches, self.clip, self.amp = microbatches, clip, amp
        self.sample = batch
        self.guard = types.SimpleNamespace(grad_norm=None)
        self.steps = 0
        ReferenceStep.instances.append(self)

    @classmethod
    def from_parts(cls, model, optimizer, loss_fn, sample_batch, *, microbatches=1,
                   clip_grad_norm=None, amp=None, warmup=None, **unused):
        assert loss_fn is None and warmup is not None
        return cls(model, optimizer, sample_batch, microbatches, clip_grad_norm, amp)

    def step(self, batch):
        self.steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        total = None
        for part in split_batch(batch, self.microbatches):
            loss = self.model(**part).float() / self.microbatches
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.clip is not None:
            self.guard.grad_norm = torch.nn.utils.clip_grad_norm_(params, self.clip)
        self.optimizer.step()
        return total

    def stats(self):
        return {"steps": self.steps}

    def release(self):
        self.released = True


def fake_make_capturable(optimizer):
    """make_capturable's visible effect on the Trainer: a tensor learning rate."""
    for group in optimizer.param_groups:
        group["foreach"] = False
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32)
    return optimizer


@pytest.fixture
def reference_step(monkeypatch):
    """mode="step" on the CPU: no blockers, the reference iteration instead of a capture."""
    ReferenceStep.instances = []
    train_module = sys.modules["graphed.train"]
    monkeypatch.setattr(train_module, "TrainStep", ReferenceStep)
    monkeypatch.setattr(train_module, "make_capturable", fake_make_capturable)
    monkeypatch.setattr(hf, "trainer_blockers", lambda trainer: {"training": [], "step": []})
    return ReferenceStep


@pytest.mark.parametrize("accumulation,ignore_some", [(1, False), (2, False), (2, True),
                                                      (3, True)])
def test_step_mode_loop_matches_the_plain_trainer(tmp_path, reference_step, accumulation,
                                                  ignore_some):
    data = TokenData(count=24 * accumulation, ignore_some=ignore_some)
    settings = dict(gradient_accumulation_steps=accumulation, max_grad_norm=0.5,
                    warmup_steps=2, lr_scheduler_type="linear", dataloader_drop_last=True)

    class SingleTensorAdamW(transformers.Trainer):
        def create_optimizer(self, model=None):
            super().create_optimizer(model)
            for group in self.optimizer.param_groups:
                group["foreach"] = False
            return self.optimizer

    plain = SingleTensorAdamW(model=tiny_gpt2(), args=training_args(tmp_path / "p", **settings),
                              train_dataset=data)
    plain.train()
    trainer = hf.GraphedTrainer(model=tiny_gpt2(), args=training_args(tmp_path / "g", **settings),
                                train_dataset=data)
    trainer.train()
    report = trainer.graphed_report
    assert report.mode == "step" and report.graphed_steps == 6 and report.eager_steps == 0
    (step,) = reference_step.instances
    assert step.steps == 6 and step.microbatches == accumulation and step.clip == 0.5
    assert step.amp is None
    assert trainer.state.global_step == 6
    assert losses(trainer) == pytest.approx(losses(plain), rel=1e-5)
    logged = [e for e in trainer.state.log_history if "loss" in e]
    expected = [e for e in plain.state.log_history if "loss" in e]
    assert [e["learning_rate"] for e in logged] == pytest.approx(
        [e["learning_rate"] for e in expected], rel=1e-6)
    assert [e["grad_norm"] for e in logged] == pytest.approx(
        [e["grad_norm"] for e in expected], rel=1e-4)
    for a, b in zip(trainer.model.parameters(), plain.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # The loop's optimizer is the same object again, its step no longer patched.
    assert not getattr(trainer.optimizer.step, "_graphed", False)
    assert trainer.args.logging_nan_inf_filter is True
    assert any("use_cache=False" in note for note in report.notes)


def test_step_mode_runs_partial_steps_eagerly_with_a_reason(tmp_path, reference_step, caplog):
    caplog.set_level(logging.WARNING, logger="graphed.integrations.transformers")
    # 5 batches of 4 and one of 2 per epoch; accumulation 2: steps of 2, 2, and the last
    # has the partial batch -> eager; 2 epochs.
    data = TokenData(count=22)
    args = training_args(tmp_path, gradient_accumulation_steps=2, max_steps=-1,
                         num_train_epochs=2, max_grad_norm=1.0)
    trainer = hf.GraphedTrainer(model=tiny_gpt2(), args=args, train_dataset=data)
    trainer.train()
    report = trainer.graphed_report
    assert trainer.state.global_step == 6
    assert report.graphed_steps == 4 and report.eager_steps == 2
    (fallback,) = [f for f in report.fallbacks if f["scope"] == "step"]
    assert fallback["count"] == 2 and "dataloader_drop_last=True" in fallback["reason"]
    assert "differ in 'input_ids'" in fallback["reason"]
    assert any("dataloader_drop_last" in r.getMessage() for r in caplog.records)
    assert all(e["loss"] == e["loss"] for e in trainer.state.log_history if "loss" in e)


def test_step_mode_with_fallback_raise_refuses_a_partial_step(tmp_path, reference_step):
    args = training_args(tmp_path, max_steps=-1, num_train_epochs=1)
    trainer = hf.GraphedTrainer(model=tiny_gpt2(), args=args, train_dataset=TokenData(count=22),
                                graphed_fallback="raise")
    with pytest.raises(GraphedError, match="cannot replay this optimizer step"):
        trainer.train()
    assert not getattr(trainer.optimizer.step, "_graphed", False)  # restored on the way out


def test_step_mode_capture_failure_falls_back_to_the_plain_trainer(tmp_path, reference_step,
                                                                  monkeypatch):
    def refuse(*args, **kwargs):
        raise GraphedError("Expected something capturable, found a test double.")

    monkeypatch.setattr(ReferenceStep, "from_parts", classmethod(refuse))
    trainer = hf.GraphedTrainer(model=tiny_gpt2(), args=training_args(tmp_path),
                                train_dataset=TokenData())
    trainer.train()
    report = trainer.graphed_report
    assert trainer.state.global_step == 6
    assert report.mode == "eager" and report.graphed_steps == 0
    assert any("capturing the Trainer's optimizer step failed: Expected something capturable"
               in f["reason"] for f in report.fallbacks)


def test_eval_graphs_per_signature(tmp_path, reference_step, monkeypatch):
    captured = []

    def fake_capture(fn, *sample, warmup=1, clone_outputs=False, **unused):
        captured.append(hf.batch_signature(sample[0]))

        def replay(inputs):
            return fn(inputs)
        return replay

    monkeypatch.setattr(sys.modules["graphed.capture"], "capture", fake_capture)
    data = TokenData(count=10)  # eval batches of 4, 4 and 2
    plain = transformers.Trainer(model=tiny_gpt2(), args=training_args(tmp_path / "p"),
                                 eval_dataset=data)
    trainer = hf.GraphedTrainer(model=tiny_gpt2(), args=training_args(tmp_path / "g"),
                                eval_dataset=data, graphed_max_eval_graphs=1)
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == pytest.approx(plain.evaluate()["eval_loss"], rel=1e-6)
    report = trainer.graphed_report
    assert len(captured) == 1 and report.eval_graphs == 1
    assert report.eval_replays == 2 and report.eval_eager_batches == 1
    (fallback,) = [f for f in report.fallbacks if f["scope"] == "eval"]
    assert "max_eval_graphs=1" in fallback["reason"]
    predictions = trainer.predict(data)
    assert predictions.predictions.shape[:2] == (10, 16)


def test_bench_module_imports_without_a_gpu():
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location(
        "integrations_hf", os.path.join(root, "bench", "integrations_hf.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.loss_rel_diff([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert bench.loss_rel_diff([1.0], [1.0, 2.0]) is None
    item = bench.TokenDataset(2)[0]
    assert item["input_ids"].shape == (bench.LENGTH,)
    assert torch.equal(item["labels"], item["input_ids"])
    assert callable(bench.hf_trainer_step_ms) and callable(bench.hf_trainer_rows)


def test_step_mode_captures_again_after_load_state_dict(tmp_path, reference_step):
    args = training_args(tmp_path, max_steps=2)
    trainer = hf.GraphedTrainer(model=tiny_gpt2(), args=args, train_dataset=TokenData())
    trainer.train()
    trainer.optimizer.load_state_dict(trainer.optimizer.state_dict())  # as resuming does
    trainer.train()
    first, second = reference_step.instances
    assert first.released and second.steps == 2
    assert any("captured again" in note for note in trainer.graphed_report.notes)
    assert trainer.graphed_report.graphed_steps == 4
