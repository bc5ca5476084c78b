"""transformers' mask-skipping rules during graphed's captures (Note
[transformers' mask rules under capture] in
python/graphed/integrations/transformers_masks.py): without a padding mask they
answer as eagerly, with one they keep transformers' answer. The capture is
simulated by making torch report a capturing stream, so this runs anywhere."""

import pytest
import torch

pytest.importorskip("transformers")

from transformers import masking_utils  # noqa: E402

from graphed.integrations import transformers_masks  # noqa: E402


# (q_length, kv_length, q_offset, local_attention_size): training forwards,
# a decode step, a prefill into a longer static cache, a window that is reached.
SHAPES = [(128, 128, 0, None), (1, 64, 0, None), (9, 64, 0, None), (128, 128, 0, 8),
          (4, 4, 0, 8), (5, 9, 4, None)]


def _eager_answers(rule):
    return [rule(None, q, kv, offset, 0, local) for q, kv, offset, local in SHAPES]


@pytest.fixture
def capturing(monkeypatch):
    def start():
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    return start


def test_without_a_padding_mask_capture_answers_as_eager(capturing):
    transformers_masks.install()
    rule = masking_utils._ignore_causal_mask_sdpa
    eager = _eager_answers(rule)
    original = _eager_answers(rule.__wrapped__)
    assert eager == original == [True, True, True, False, True, False]
    capturing()
    # transformers' own rule materializes every mask while a stream captures.
    assert not any(_eager_answers(rule.__wrapped__))
    assert _eager_answers(rule) == eager


def test_with_a_padding_mask_capture_keeps_transformers_answer(capturing):
    transformers_masks.install()
    rule = masking_utils._ignore_causal_mask_sdpa
    padding = torch.ones(2, 16, dtype=torch.bool)
    assert rule(padding, 16, 16, 0, 0) is not False  # eagerly: no padding, skip the mask
    capturing()
    assert rule(padding, 16, 16, 0, 0) is False  # its values cannot be read in a graph


def test_the_bidirectional_rule_answers_as_eager_without_a_padding_mask(capturing):
    transformers_masks.install()
    rule = masking_utils._ignore_bidirectional_mask_sdpa
    assert rule(None, 32) and not rule(None, 32, 8)
    capturing()
    assert not rule.__wrapped__(None, 32)
    assert rule(None, 32) and not rule(None, 32, 8)
    assert not rule(torch.ones(2, 32, dtype=torch.bool), 32)


def test_install_is_idempotent_and_keeps_the_prefill_rule():
    transformers_masks.install()
    rule = masking_utils._ignore_causal_mask_sdpa
    transformers_masks.install()
    assert masking_utils._ignore_causal_mask_sdpa is rule
    assert not getattr(rule.__wrapped__, "_graphed_rule", False)
    transformers_masks.prefill_padding.padded = True
    try:
        assert rule(None, 8, 8, 0, 0) is False  # graphed.generate's padded prefill
    finally:
        transformers_masks.prefill_padding.padded = None


def test_capturable_experts_installs_the_rules_for_any_transformers_model():
    import transformers

    from graphed._experts import capturable_experts

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2)
    model = transformers.LlamaForCausalLM(config)
    masking_utils._ignore_causal_mask_sdpa = getattr(
        masking_utils._ignore_causal_mask_sdpa, "__wrapped__",
        masking_utils._ignore_causal_mask_sdpa)
    assert capturable_experts(model) == []  # no experts: nothing switched, no notes
    assert getattr(masking_utils._ignore_causal_mask_sdpa, "_graphed_rule", False)


def test_the_eager_attention_mask_under_capture_has_eager_values_without_a_host_copy(capturing,
                                                                                     monkeypatch):
    # Note [An eager-attention mask a graph can hold].
    transformers_masks.install()
    assert masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["eager"] is masking_utils.eager_mask
    arguments = dict(batch_size=2, q_length=6, kv_length=6,
                     mask_function=masking_utils.sliding_window_causal_mask_function(3),
                     attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]] * 2).bool(), dtype=torch.bfloat16,
                     device="cpu")
    want = masking_utils.eager_mask.__wrapped__(**arguments)
    capturing()
    made = []
    tensor = torch.tensor

    def no_host_copy(data, *args, **kwargs):
        made.append(kwargs.get("device"))
        return tensor(data, *args, **kwargs)

    monkeypatch.setattr(torch, "tensor", no_host_copy)
    got = masking_utils.eager_mask(**arguments)
    assert made == []
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_compiled_code_does_not_depend_on_whether_a_stream_captures(monkeypatch):
    """Note [The mask rules under torch.compile]: a model compiled during
    warm-up runs the same compiled code while a stream captures, with no
    recompile (T5 without an attention mask failed so under
    optimize(compile=True))."""
    from transformers import T5Config, T5ForConditionalGeneration

    transformers_masks.install()
    capturing = [False]

    @torch._dynamo.disable
    def stream_is_capturing():
        return capturing[0]

    monkeypatch.setattr(transformers_masks, "_stream_capturing", stream_is_capturing)
    compiles = []

    def counting_backend(graph, example_inputs):
        compiles.append(graph)
        return graph.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = T5Config(num_layers=1, num_decoder_layers=1, d_model=32, d_ff=64, num_heads=2,
                      d_kv=16, vocab_size=64, decoder_start_token_id=0, pad_token_id=0,
                      eos_token_id=1)
    model = T5ForConditionalGeneration(config).train()
    compiled = torch.compile(model, backend=counting_backend)
    ids, labels = torch.randint(2, 64, (2, 12)), torch.randint(2, 64, (2, 5))
    for _ in range(2):
        compiled(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    warm = len(compiles)
    capturing[0] = True
    compiled(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    torch._dynamo.reset()
    assert len(compiles) == warm, "Dynamo compiled again once the stream reported a capture"


def _attention_calls(monkeypatch):
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, *args, **kwargs):
        calls.append((attn_mask is None, kwargs.get("is_causal"), key.shape[1]))
        return sdpa(query, key, value, attn_mask, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def _tiny_llama():
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).train()


def test_a_training_forward_under_capture_skips_the_mask_as_eager_does(capturing, monkeypatch):
    transformers_masks.install()
    model, ids = _tiny_llama(), torch.randint(0, 64, (2, 8))
    calls = _attention_calls(monkeypatch)
    model(input_ids=ids, use_cache=False)
    eager = calls[-1]
    assert eager == (True, True, 2)  # no mask, is_causal, grouped keys (2 heads)
    capturing()
    # Position ids the model makes itself are never packed: eager's answer.
    model(input_ids=ids, use_cache=False)
    assert calls[-1] == eager
    # transformers' own rule (what graphed replaced) materializes the mask.
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices",
                        masking_utils.find_packed_sequence_indices.__wrapped__)
    model(input_ids=ids, use_cache=False)
    assert calls[-1][0] is False


def test_position_ids_the_caller_passes_keep_transformers_answer_under_capture(capturing,
                                                                              monkeypatch):
    transformers_masks.install()
    model, ids = _tiny_llama(), torch.randint(0, 64, (2, 8))
    calls = _attention_calls(monkeypatch)
    positions = torch.arange(8).expand(2, -1)
    model(input_ids=ids, position_ids=positions, use_cache=False)
    assert calls[-1][0] is True  # eagerly: read on the host, nothing packed
    capturing()
    # A replay may get packed ids: the graph holds the mask, right for every batch.
    model(input_ids=ids, position_ids=positions, use_cache=False)
    assert calls[-1][0] is False
