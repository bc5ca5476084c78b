"""graphed.integrations.trl on the GPU: GRPOTrainer's policy update replayed
from graphs against TRL's eager step on the same completions (the same
generation batches served to both trainers, from the same initial weights),
and a short GRPO run with graphed rollouts and the graphed update. The
policy, tokenizer, prompts and reward are bench/rl_grpo.py's, smaller."""

import importlib.util
import math
import os

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is optional; the integration tests need it")
pytest.importorskip("datasets", reason="TRL's trainers take a datasets.Dataset")

from graphed.integrations.trl import GraphedGRPOTrainer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("rl_grpo", os.path.join(ROOT, "bench", "rl_grpo.py"))
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

pytestmark = pytest.mark.gpu
SMALL = dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256)
SETTINGS = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=24)


def _batches(tmp_path, count, **overrides):
    """TRL's own first ``count`` generation batches (rollouts of TRL's model.generate)."""
    args = bench.config(str(tmp_path / "record"), steps=count, **{**SETTINGS, **overrides})
    t = bench.trainer(trl.GRPOTrainer, args, model_kwargs=SMALL)
    batches = []
    original = t._generate_and_score_completions

    def recording(inputs):
        batch = original(inputs)
        batches.append({k: v.clone() if isinstance(v, torch.Tensor) else v
                        for k, v in batch.items()})
        return batch

    t._generate_and_score_completions = recording
    t.train()
    return batches


def _compare(tmp_path, batches, perturb, **overrides):
    saved = bench.trainer
    bench.trainer = lambda cls, args, model_kwargs=None, **kw: saved(
        cls, args, model_kwargs=SMALL, **kw)
    try:
        return bench.same_completions(batches, perturb=perturb, **{**SETTINGS, **overrides})
    finally:
        bench.trainer = saved


def _assert_graphed(result, steps):
    assert len(result["update_path"]) == steps, result
    assert all(p.startswith("graph:") for p in result["update_path"]), result["update_path"]


def test_first_step_loss_equals_trls_on_trls_own_batch(tmp_path):
    """TRL's defaults (bf16 autocast, dapo, no old log-probabilities)."""
    result = _compare(tmp_path, _batches(tmp_path, 1), perturb=False)
    _assert_graphed(result, 1)
    assert result["loss_rel_diffs"][0] < 1e-5, result
    assert result["grad_norm_rel_diffs"][0] < 2e-2, result  # bf16 autocast


@pytest.mark.usefixtures("exact_fp32")
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
def test_off_policy_loss_equals_trls_in_fp32(tmp_path, loss_type):
    batches = _batches(tmp_path, 2, bf16=False, loss_type=loss_type)
    result = _compare(tmp_path, batches, perturb=True, bf16=False, loss_type=loss_type)
    _assert_graphed(result, 2)
    assert result["loss_rel_diffs"][0] < 1e-5, result
    assert result["grad_norm_rel_diffs"][0] < 1e-4, result
    assert result["loss_rel_diffs"][1] < 1e-4, result


@pytest.mark.usefixtures("exact_fp32")
def test_gradient_accumulation_and_kl_equal_trls(tmp_path):
    """Two micro-batches per optimizer step, beta > 0 (a reference model, so
    the policy comes from a saved checkpoint)."""
    path = str(tmp_path / "policy")
    bench.policy(len(bench.tokenizer()), **SMALL).save_pretrained(path)
    overrides = dict(bf16=False, beta=0.1, gradient_accumulation_steps=2, loss_type="grpo")
    args = bench.config(str(tmp_path / "record"), steps=1, **{**SETTINGS, **overrides})
    recorder = trl.GRPOTrainer(model=path, reward_funcs=bench.reward_fig,
                               processing_class=bench.tokenizer(), args=args,
                               train_dataset=bench.prompts())
    batches = []
    original = recorder._generate_and_score_completions
    recorder._generate_and_score_completions = lambda inputs: batches.append(
        {k: v.clone() if isinstance(v, torch.Tensor) else v
         for k, v in original(inputs).items()}) or batches[-1]
    recorder.train()
    result = bench.same_completions(batches, perturb=True, model_path=path,
                                    **{**SETTINGS, **overrides})
    _assert_graphed(result, 1)
    assert result["loss_rel_diffs"][0] < 1e-5, result
    assert result["grad_norm_rel_diffs"][0] < 1e-4, result


def test_a_grpo_run_replays_the_update_graphs(tmp_path):
    args = bench.config(str(tmp_path), steps=6, **SETTINGS)
    t = bench.trainer(GraphedGRPOTrainer, args, model_kwargs=SMALL)
    t.train()
    update = t.graphed_update
    assert update.path == "graphs" and update.graphed == 6 and update.eager == 0, str(update)
    assert not update.fallbacks and sum(update.buckets.values()) == 6
    assert update.captures == len(update.buckets) >= 1
    assert all(length % 32 == 0 for length in update.buckets)
    assert t.graphed_rollouts.graphed == 6 and not t.graphed_rollouts.fallbacks
    logs = [e for e in t.state.log_history if "loss" in e]
    assert len(logs) == 6 and all(math.isfinite(e["loss"]) for e in logs)
    assert all("entropy" in e and math.isfinite(e["entropy"]) for e in logs)
    assert all(math.isfinite(e["grad_norm"]) for e in logs)
    steps = sum(s.stats()["steps"] for s in t._graphed_update.steps.values())
    assert steps == 6


@pytest.mark.usefixtures("exact_fp32")
def test_completion_lengths_beyond_the_bucket_pad_or_capture_again(tmp_path):
    """Shorter completions reuse a bucket; longer ones get their own graph."""
    batches = _batches(tmp_path, 3, bf16=False)
    short = dict(batches[1])
    keep = 3
    short["completion_ids"] = short["completion_ids"][:, :keep].contiguous()
    short["completion_mask"] = short["completion_mask"][:, :keep].contiguous()
    short["num_items_in_batch"] = short["completion_mask"].sum()
    # perturb: on TRL's own completions the first update's ratio is 1 and its
    # loss a sum of advantages, zero up to rounding, where relative errors
    # mean nothing; perturbed old log-probabilities give losses of size.
    result = _compare(tmp_path, [batches[0], short, batches[2]], perturb=True, bf16=False,
                      max_completion_length=24)
    _assert_graphed(result, 3)
    assert result["loss_rel_diffs"][0] < 1e-5, result
    assert all(d < 1e-4 for d in result["loss_rel_diffs"][1:]), result
