"""graphed.check on models nobody here wrote (transformers, timm, torchvision),
on the CPU: it reports nothing that would not break a capture or change
results. transformers takes other branches while a stream captures, and the
check follows them (Note [Checking the path taken under capture])."""

import pytest
import torch

import graphed

transformers = pytest.importorskip("transformers")


def _training_pass(model, batch):
    def step():
        model.zero_grad()
        model(**batch).loss.backward()
    return step


def _tokens(batch, length, vocab=128):
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, length), generator=generator)


def _gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128,
                                     n_positions=64, bos_token_id=0, eos_token_id=0)
    ids = _tokens(2, 16)
    return transformers.GPT2LMHeadModel(config).train(), {"input_ids": ids, "labels": ids}


def _llama():
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, vocab_size=128, bos_token_id=0,
                                      eos_token_id=0, pad_token_id=0)
    ids = _tokens(2, 16)
    return transformers.LlamaForCausalLM(config).train(), {"input_ids": ids, "labels": ids}


def _bert():
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                     intermediate_size=64, vocab_size=128, num_labels=3)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 9:] = 0  # a padded row
    return transformers.BertForSequenceClassification(config).train(), {
        "input_ids": _tokens(2, 16), "attention_mask": mask, "labels": torch.tensor([0, 2])}


def _t5():
    config = transformers.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64,
                                   num_heads=4, d_kv=8, vocab_size=128, decoder_start_token_id=0,
                                   pad_token_id=0)
    return transformers.T5ForConditionalGeneration(config).train(), {
        "input_ids": _tokens(2, 16), "labels": _tokens(2, 8)}


def _vit():
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=64, num_labels=5)
    return transformers.ViTForImageClassification(config).train(), {
        "pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.tensor([1, 4])}


@pytest.mark.parametrize("make", [_gpt2, _llama, _bert, _t5, _vit],
                         ids=["gpt2", "llama", "bert", "t5", "vit"])
def test_check_reports_nothing_on_an_unmodified_transformers_training_step(make):
    torch.manual_seed(0)
    model, batch = make()
    report = graphed.check(_training_pass(model, batch))
    assert not report, str(report)


@pytest.mark.parametrize("use_cache", [None, False])
def test_check_reports_nothing_on_gpt2_inference(use_cache):
    torch.manual_seed(0)
    model, batch = _gpt2()
    model.eval()
    kwargs = {} if use_cache is None else {"use_cache": use_cache}
    with torch.no_grad():
        report = graphed.check(model, input_ids=batch["input_ids"], **kwargs)
    assert not report, str(report)


def test_auto_hands_training_calls_use_cache_false():
    torch.manual_seed(0)
    model, batch = _gpt2()
    seen = []
    block = model.transformer.h[0]
    block.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs.get("use_cache")),
                                    with_kwargs=True)
    graphed.auto(model)
    model(**batch)
    with torch.no_grad():
        model.eval()
        model(input_ids=batch["input_ids"])
    assert seen[0] is False  # the training call
    assert seen[1] is not False  # inference as the caller asked (the config's default)
    assert any("use_cache=False" in note for note in graphed.auto_stats(model)["notes"])


def test_auto_keeps_the_forward_signatures_frameworks_read():
    # The HF Trainer keeps only the batch keys named in model.forward's
    # signature; a wrapper showing (*args, **kwargs) made it drop input_ids.
    import inspect

    model, _ = _gpt2()
    before = list(inspect.signature(model.forward).parameters)
    block_before = list(inspect.signature(model.transformer.h[0].forward).parameters)
    graphed.auto(model)
    assert list(inspect.signature(model.forward).parameters) == before
    assert "input_ids" in before and "labels" in before
    assert list(inspect.signature(model.transformer.h[0].forward).parameters) == block_before
