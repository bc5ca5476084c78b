"""graphed.integrations.trl's policy update on graphs, on the CPU: the
arguments and the settings it refuses, the bucket arithmetic, and TRL's loss
unchanged by the padding of the update's layout (graphed's loss module
evaluated eagerly against TRL's own _compute_loss, with and without padding,
for every loss type graphed reproduces); a GRPO run on the CPU falls back to
TRL's training step with the reason counted. The GPU tests replay the graphs
against TRL's eager step on the same completions."""

import importlib.util
import logging
import os

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is optional; the integration tests need it")
datasets = pytest.importorskip("datasets", reason="TRL's trainers take a datasets.Dataset")
transformers = pytest.importorskip("transformers")

import graphed  # noqa: E402
from graphed.integrations.trl import GraphedGRPOTrainer, optimize_grpo_trainer  # noqa: E402
from graphed.integrations.trl_update import (BUCKET_STEP, SUPPORTED_LOSS_TYPES,  # noqa: E402
                                             GRPOUpdateLoss, LossSettings, batch_problem,
                                             bucket_length, layout, update_blockers)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location("rl_grpo",
                                                  os.path.join(ROOT, "bench", "rl_grpo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _bench()
SMALL = dict(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64)


def _trainer(tmp_path, cls=trl.GRPOTrainer, **overrides):
    return bench.trainer(cls, bench.config(str(tmp_path), steps=2, cpu=True, **overrides),
                         model_kwargs=SMALL)


# --- arguments, settings, buckets --------------------------------------------------
def test_update_blockers_name_what_graphed_does_not_reproduce():
    assert update_blockers(loss_type="dapo") == []
    reasons = update_blockers(loss_type="vespo", top_entropy_quantile=0.2, entropy_bonus=True,
                              aux_loss=True, vllm_importance_sampling=True, off_policy_mask=True,
                              liger_kernel=True, fp16=True, gradient_checkpointing=True,
                              training_step_owner="Mine")
    assert len(reasons) == 10
    text = " ".join(reasons)
    assert "found loss_type='vespo'" in text and "top_entropy_quantile=0.2" in text
    assert "fp16=True" in text and "Mine.training_step overrides" in text
    assert "Expected gradient_checkpointing=False for the graphed update" in text
    for loss_type in SUPPORTED_LOSS_TYPES:
        assert update_blockers(loss_type=loss_type) == []


def test_bucket_length_rounds_up_caps_and_reuses():
    assert bucket_length(40) == (2 * BUCKET_STEP, "")
    assert bucket_length(64) == (64, "")
    assert bucket_length(250, 32, max_length=256) == (256, "")
    assert bucket_length(250, 64, max_length=251) == (251, "")
    assert bucket_length(40, 32, existing=[64, 128], max_graphs=2) == (64, "")
    assert bucket_length(100, 32, existing=[64, 128], max_graphs=2) == (128, "")
    length, reason = bucket_length(200, 32, existing=[64, 128], max_graphs=2)
    assert length is None and "max_update_graphs=2 graphs exist already" in reason
    with pytest.raises(graphed.GraphedError, match="Expected a sequence of at least 2 tokens"):
        bucket_length(1)


def test_batch_problem_sends_multimodal_batches_to_trl():
    batch = {k: torch.zeros(2, 3) for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                             "completion_mask")}
    batch["advantages"] = torch.zeros(2)
    assert batch_problem(batch) == ""
    assert "pixel_values" in batch_problem({**batch, "pixel_values": torch.zeros(2, 3)})
    assert batch_problem({**batch, "image_sizes": None}) == ""
    assert "no advantages" in batch_problem({k: v for k, v in batch.items() if k != "advantages"})


def test_bad_update_arguments_are_refused(tmp_path):
    with pytest.raises(graphed.GraphedError, match="Expected bucket_step to be an int >= 1"):
        optimize_grpo_trainer(_trainer(tmp_path), bucket_step=0)
    with pytest.raises(graphed.GraphedError, match="Expected max_update_graphs to be an int >= 1"):
        optimize_grpo_trainer(_trainer(tmp_path), max_update_graphs=True)
    with pytest.raises(graphed.GraphedError, match="graphed cannot run the GRPO update on graphs"):
        optimize_grpo_trainer(_trainer(tmp_path), fallback="raise")  # no GPU here
    assert optimize_grpo_trainer(_trainer(tmp_path), update=False).graphed_update is None


def test_a_training_step_override_is_refused(tmp_path):
    class Mine(trl.GRPOTrainer):
        def training_step(self, *args, **kwargs):
            return super().training_step(*args, **kwargs)

    trainer = optimize_grpo_trainer(_trainer(tmp_path, Mine))
    reasons = trainer.graphed_blockers()["update"]
    assert any("Mine.training_step overrides GRPOTrainer.training_step" in r for r in reasons)


# --- TRL's loss, padded ---------------------------------------------------------------
def _batch(vocab: int, rows: int = 4, prompt: int = 5, completion: int = 7, seed: int = 0,
           old: bool = True, beta: bool = False, tool: bool = False, advantages_2d: bool = False):
    generator = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(rows, prompt, dtype=torch.long)
    for r in range(rows):
        prompt_mask[r, :r % 3] = 0  # TRL left-pads the prompts
    completion_mask = torch.ones(rows, completion, dtype=torch.long)
    for r in range(rows):
        completion_mask[r, completion - (r * 2) % completion:] = 0  # after the eos
    completion_mask[:, 0] = 1
    batch = {
        "prompt_ids": torch.randint(4, vocab, (rows, prompt), generator=generator) * prompt_mask,
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(4, vocab, (rows, completion), generator=generator)
        * completion_mask,
        "completion_mask": completion_mask,
        "advantages": torch.randn(rows, completion if advantages_2d else 1,
                                  generator=generator).squeeze(-1) if not advantages_2d
        else torch.randn(rows, completion, generator=generator),
        "num_items_in_batch": completion_mask.sum(),
    }
    if old:
        batch["old_per_token_logps"] = -3 + 0.4 * torch.randn(rows, completion,
                                                              generator=generator)
    if beta:
        batch["ref_per_token_logps"] = -3 + 0.4 * torch.randn(rows, completion,
                                                              generator=generator)
    if tool:
        batch["tool_mask"] = (torch.rand(rows, completion, generator=generator) > 0.3).long()
    return batch


CASES = [dict(loss_type=t) for t in SUPPORTED_LOSS_TYPES] + [
    dict(loss_type="grpo", beta=0.1),
    dict(loss_type="dapo", beta=0.1, use_bias_correction_kl=True),
    dict(loss_type="grpo", importance_sampling_level="sequence"),
    dict(loss_type="luspo", importance_sampling_level="sequence"),
    dict(loss_type="bnpo", delta=1.5, epsilon_high=0.28),
    dict(loss_type="dapo", old=False),
    dict(loss_type="dr_grpo", tool=True),
    dict(loss_type="grpo", advantages_2d=True),
]


def _case_id(case):
    return "-".join(f"{k}={v}" for k, v in case.items())


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_padding_leaves_trls_loss_and_gradients_unchanged(tmp_path, case):
    case = dict(case)
    beta = case.pop("beta", 0.0)
    batch_kwargs = {k: case.pop(k) for k in ("old", "tool", "advantages_2d") if k in case}
    trainer = _trainer(tmp_path, **case)
    trainer.beta = beta  # a reference model needs a checkpoint; the loss reads only beta
    trainer.current_gradient_accumulation_steps = 1
    model = trainer.model
    model.train()
    batch = _batch(model.config.vocab_size, beta=beta != 0.0, **batch_kwargs)

    def grads(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    expected = trainer._compute_loss(model, batch)
    expected_grads = grads(expected)
    entropy = trainer._metrics["train"]["entropy"][-1]
    loss_module = GRPOUpdateLoss(trainer, model, LossSettings.of(trainer))
    needed = batch["prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
    for length in (needed, needed + 13):
        loss = loss_module(**layout(batch, length, beta))
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
        for got, want in zip(grads(loss), expected_grads):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        names = loss_module.settings.metric_names()
        metrics = dict(zip(names, loss_module.records[-1].tolist()))
        assert metrics["entropy"] == pytest.approx(entropy, rel=1e-5)
        for name in names:
            if name in trainer._metrics["train"]:
                assert metrics[name] == pytest.approx(trainer._metrics["train"][name][-1],
                                                      rel=1e-5, abs=1e-7, nan_ok=True), name


def test_layout_puts_completions_after_the_prompt_and_masks_the_padding():
    batch = _batch(16, rows=2, prompt=3, completion=4)
    out = layout(batch, 10)
    assert out["input_ids"].shape == (2, 10) and out["mask"].shape == (2, 9)
    torch.testing.assert_close(out["input_ids"][:, 3:7], batch["completion_ids"])
    assert (out["attention_mask"][:, 7:] == 0).all() and (out["labels"][:, :3] == -100).all()
    torch.testing.assert_close(out["mask"][:, 2:6], batch["completion_mask"])
    assert out["mask"][:, 6:].sum() == 0 and out["num_items_in_batch"].shape == (2,)
    with pytest.raises(graphed.GraphedError, match="Expected at most 6 prompt and completion"):
        layout(batch, 6)


# --- a run on the CPU -------------------------------------------------------------------
def test_grpo_update_on_the_cpu_runs_trls_step_with_the_reason_counted(tmp_path, caplog):
    trainer = _trainer(tmp_path, GraphedGRPOTrainer)
    with caplog.at_level(logging.WARNING, logger="graphed.integrations.trl"):
        trainer.train()
    report = trainer.graphed_update
    assert report.path == "trl" and report.graphed == 0 and report.eager == 2
    assert report.steps == ["trl", "trl"]
    assert report.fallbacks == {reason: 2 for reason in trainer.graphed_blockers()["update"]}
    assert any("CUDA GPU" in reason for reason in report.fallbacks)
    assert "this policy update runs TRL's training step" in caplog.text
    assert "graphed policy update (trl): 0 optimizer step(s) on graphs" in str(report)
    assert report.to_dict()["eager"] == 2
    assert trainer.state.global_step == 2 and trainer.graphed_rollouts.graphed >= 2


def test_update_off_leaves_trls_training_step(tmp_path):
    trainer = _trainer(tmp_path, GraphedGRPOTrainer, max_steps=1)
    trainer2 = GraphedGRPOTrainer(model=trainer.model, reward_funcs=bench.reward_fig,
                                  processing_class=trainer.processing_class, args=trainer.args,
                                  train_dataset=trainer.train_dataset, graphed_update=False)
    assert trainer2.graphed_update is None
    trainer2.train()
    assert trainer2.state.global_step == 1


def test_bench_parses_arguments_and_builds_its_pieces():
    assert bench.rel_diff(1.0, 1.0) == 0.0 and bench.rel_diff(None, 1.0) is None
    tok = bench.tokenizer()
    assert len(tok) == len(bench.WORDS) + 4
    assert bench.reward_fig(["fig fig apple", ""]) == [2 / 3, 0.0]
    assert len(bench.prompts(8)) == 8
    with pytest.raises(SystemExit):
        bench.main(["--bogus"])
    lines = bench.markdown({"n_steps": 2, "methods": {"trl_default": {"ms_per_step": 10.0},
                                                      "graphed": {"error": "boom"}}})
    assert any("failed: boom" in line for line in lines)


def test_bench_methods_and_comparison_run_on_the_cpu():
    """bench/rl_grpo.py's CPU-runnable pieces: a method's timed run (graphed
    rollouts, TRL's update here), and the same-completions comparison."""
    result = bench.run_method("graphed", steps=1, cpu=True, record_batches=1)
    assert "error" not in result, result.get("traceback")
    assert result["n_steps"] == 1 and result["ms_per_step"] > 0
    assert result["generation_ms_per_step"] > 0 and result["update_ms_per_step"] > 0
    assert result["graphed_update"]["steps"] == ["trl"]
    batch, = result["_batches"]
    compared = bench.same_completions([batch], perturb=True, cpu=True)
    assert compared["update_path"] == ["trl"]  # no GPU: TRL's step on both sides
    assert compared["loss_rel_diffs"] == [0.0] and compared["steps"]["graphed"][0]["loss"] != 0
