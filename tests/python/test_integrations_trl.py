"""graphed.integrations.trl on the CPU: the rollout path's arithmetic and
arguments, and a tiny GRPO run end to end (a random-init Llama, a word-level
tokenizer built here, a programmatic reward) whose rollouts run through
graphed.generate (its eager decoder on the CPU; the GPU tier replays graphs),
with TRL's fallback for settings graphed does not implement."""

import logging

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is optional; the integration tests need it")
datasets = pytest.importorskip("datasets", reason="TRL's trainers take a datasets.Dataset")
transformers = pytest.importorskip("transformers")

import graphed  # noqa: E402
from graphed.integrations.trl import (CACHE_LENGTH_STEP, GraphedGRPOTrainer,  # noqa: E402
                                      cache_length, generation_path, optimize_grpo_trainer)

WORDS = ["apple", "banana", "cherry", "date", "elder", "fig", "grape", "honey"]


def test_cache_length_grows_in_steps_and_never_shrinks():
    assert cache_length(0, 10, 8) == CACHE_LENGTH_STEP
    assert cache_length(0, CACHE_LENGTH_STEP, 1) == 2 * CACHE_LENGTH_STEP
    assert cache_length(128, 3, 4) == 128
    with pytest.raises(graphed.GraphedError, match="Expected a prompt and at least one token"):
        cache_length(0, 0, 4)


def test_generation_path_names_what_trl_does():
    assert generation_path(use_vllm=False, use_transformers_continuous_batching=False) == \
        "transformers"
    assert generation_path(use_vllm=True, use_transformers_continuous_batching=False) == "vllm"
    assert generation_path(use_vllm=False, use_transformers_continuous_batching=True) == \
        "continuous_batching"


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    vocab.update({w: i + 4 for i, w in enumerate(WORDS)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>")


def _policy(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, pad_token_id=0, eos_token_id=1,
                         bos_token_id=2, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def _prompts():
    rows = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(1 + i % 3)) for i in range(8)]
    return datasets.Dataset.from_dict({"prompt": rows})


def reward_fig(completions, **kwargs):
    """1 for a completion that says fig."""
    return [1.0 if "fig" in completion else 0.0 for completion in completions]


def _config(tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4,
                    num_generations=4, max_completion_length=6, max_steps=2, learning_rate=1e-3,
                    logging_steps=1, report_to=[], save_strategy="no", bf16=False, seed=0,
                    temperature=1.0, top_k=0, top_p=1.0)
    settings.update(overrides)
    return trl.GRPOConfig(**settings)


def _trainer(tmp_path, cls=trl.GRPOTrainer, **config_overrides):
    tokenizer = _tokenizer()
    return cls(model=_policy(tokenizer), reward_funcs=reward_fig, processing_class=tokenizer,
               args=_config(tmp_path, **config_overrides), train_dataset=_prompts())


def test_grpo_rollouts_run_through_graphed_generate(tmp_path, monkeypatch):
    calls = []
    real = graphed.generate

    def counting(model, input_ids, **kwargs):
        calls.append((tuple(input_ids.shape), kwargs.get("max_cache_len")))
        return real(model, input_ids, **kwargs)

    monkeypatch.setattr(graphed, "generate", counting)
    trainer = _trainer(tmp_path, GraphedGRPOTrainer)
    assert "generate" not in vars(trainer.model)
    trainer.train()
    report = trainer.graphed_rollouts
    assert report.path == "transformers"
    assert report.graphed == len(calls) >= 2 and not report.fallbacks, str(report)
    assert all(length % CACHE_LENGTH_STEP == 0 for _, length in calls)
    assert "generate" not in vars(trainer.model)  # removed after each rollout
    assert trainer.state.global_step == 2
    assert all(torch.isfinite(torch.tensor(entry["loss"])) for entry in trainer.state.log_history
               if "loss" in entry)


def test_settings_graphed_does_not_implement_run_trls_generate_and_are_counted(tmp_path, caplog):
    trainer = optimize_grpo_trainer(_trainer(tmp_path, repetition_penalty=1.2))
    with caplog.at_level(logging.WARNING, logger="graphed.integrations.trl"):
        trainer.train()
    report = trainer.graphed_rollouts
    assert report.graphed == 0
    (reason, count), = report.fallbacks.items()
    assert "repetition_penalty=1.2" in reason and count >= 2
    assert "this rollout runs TRL's model.generate" in caplog.text
    assert trainer.state.global_step == 2


def test_fallback_raise_raises_at_the_first_rollout(tmp_path):
    trainer = optimize_grpo_trainer(_trainer(tmp_path, repetition_penalty=1.2), fallback="raise",
                                    update=False)  # the update raises on the CPU already
    with pytest.raises(graphed.GraphedError, match="does not implement repetition_penalty"):
        trainer.train()


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(graphed.GraphedError, match="Expected fallback to be one of trl, raise"):
        optimize_grpo_trainer(_trainer(tmp_path), fallback="eager")
    with pytest.raises(graphed.GraphedError, match="Expected a trl.GRPOTrainer, got Module"):
        optimize_grpo_trainer(torch.nn.Module())
