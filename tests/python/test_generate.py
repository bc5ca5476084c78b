"""graphed.generate and graphed.Decoder on the CPU: the adapter decodes eagerly
there (no graphs), so the tokens must equal transformers' StaticCache generate
exactly; bad input is refused before any work."""

import pytest
import torch

import graphed
from generate_models import (ARCHITECTURES, assert_eos_and_min_new_tokens_follow_hf,
                             hf_static_generate, left_padded_prompts, tiny_model)

pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_tokens_equal_hf_static_cache(arch, batch):
    model = tiny_model(arch)
    ids, mask = left_padded_prompts(batch, 7, model.config.vocab_size, "cpu")
    want = hf_static_generate(model, ids, mask, 10, max_cache_len=24)
    got = graphed.generate(model, ids, attention_mask=mask, max_new_tokens=10, max_cache_len=24)
    assert torch.equal(got, want)


def test_eos_and_min_new_tokens_follow_hf():
    model = tiny_model("llama")
    ids, mask = left_padded_prompts(2, 5, model.config.vocab_size, "cpu")
    assert_eos_and_min_new_tokens_follow_hf(model, ids, mask, 12, 16, eos_after=2,
                                            min_new_tokens=(0, 6))

def test_callback_sees_every_new_token_and_decoder_is_reused():
    model = tiny_model("gpt2")
    ids, _ = left_padded_prompts(2, 4, model.config.vocab_size, "cpu")
    seen = []
    out = graphed.generate(model, ids, max_new_tokens=6, callback=seen.append)
    assert [tuple(t.tolist()) for t in seen] == [tuple(c.tolist()) for c in out[:, 4:].T]
    first = model.__dict__["_graphed_decoder"]
    graphed.generate(model, ids[:1], max_new_tokens=6)
    assert model.__dict__["_graphed_decoder"] is first


def test_top_k_one_sampling_is_greedy():
    model = tiny_model("qwen2")
    ids, mask = left_padded_prompts(2, 5, model.config.vocab_size, "cpu")
    greedy = graphed.generate(model, ids, attention_mask=mask, max_new_tokens=8)
    sampled = graphed.generate(model, ids, attention_mask=mask, max_new_tokens=8,
                               do_sample=True, top_k=1, temperature=0.7)
    assert torch.equal(greedy, sampled)


@pytest.mark.parametrize("arguments, needle", [
    ({"num_beams": 2}, "num_beams=2"),
    ({"repetition_penalty": 1.3}, "repetition_penalty"),
    ({"output_attentions": True}, "does not take output_attentions"),
    ({"use_cache": False}, "use_cache=False"),
    ({"do_sample": True, "temperature": 0.0}, "temperature > 0"),
])
def test_unsupported_arguments_are_refused_with_the_reason(arguments, needle):
    model = tiny_model("llama")
    with pytest.raises(graphed.GraphedError, match=needle):
        graphed.generate(model, torch.ones(1, 3, dtype=torch.long), max_new_tokens=2, **arguments)
    assert "_graphed_decoder" not in model.__dict__ or needle == "temperature > 0"


def test_request_over_the_decoders_limits_is_refused_before_any_work():
    model = tiny_model("llama")
    decoder = graphed.Decoder(model, max_batch=2, max_len=8)
    cache = decoder.cache
    cache.layers[0].keys.fill_(1.0)
    with pytest.raises(graphed.GraphedError, match="max_batch >= 3"):
        decoder.generate(torch.ones(3, 2, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(graphed.GraphedError, match="needs 9 cache positions"):
        decoder.generate(torch.ones(1, 6, dtype=torch.long), max_new_tokens=4)
    assert bool((cache.layers[0].keys == 1.0).all()), "a refused request touched the cache"


def test_not_a_transformers_model_is_refused():
    with pytest.raises(graphed.GraphedError, match="Hugging Face causal language model"):
        graphed.generate(torch.nn.Linear(2, 2), torch.ones(1, 2, dtype=torch.long))


def test_bad_decoder_options_name_the_limit():
    model = tiny_model("llama")
    with pytest.raises(graphed.GraphedError, match="below max_batch"):
        graphed.Decoder(model, max_batch=8, max_len=16, buckets=[1, 2])
    with pytest.raises(graphed.GraphedError, match="at least one byte"):
        graphed.Decoder(model, max_batch=2, max_len=16, memory_budget="0GiB")
