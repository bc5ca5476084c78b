"""Which rotary embeddings graphed's decode steps run in one kernel (Note
[Rotary embedding in one kernel] in src/rotary_ops.cpp), on any machine:
transformers' apply_rotary_pos_emb is recognised by what it computes in the
modeling modules that have its form, and not in those with forms of their
own; the swap is undone whatever the step raises; calls the kernel does not
take run transformers' function. The kernel's results: test_rotary_gpu.py;
whole decoders: test_generate_gpu.py."""

import importlib

import pytest
import torch

from graphed._decode_rotary import NAME, DecodeRotary, is_transformers_rotary
from graphed._decode_kernels import FusedDecodeKernels

pytest.importorskip("transformers")


@pytest.mark.parametrize("family, taken", [
    ("llama", True), ("mistral", True), ("qwen2", True), ("qwen3_moe", True), ("gemma3", True),
    ("granite", True), ("gpt_oss", False), ("phi3", False)])
def test_transformers_rotary_functions_are_recognised_by_what_they_compute(family, taken):
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    assert is_transformers_rotary(vars(module)) == taken


def test_a_rotation_that_computes_otherwise_is_not_taken():
    from transformers.models.llama import modeling_llama

    namespace = dict(vars(modeling_llama))

    def rotate_half(x):  # the halves the other way round
        x1 = x[..., : x.shape[-1] // 2]
        x2 = x[..., x.shape[-1] // 2:]
        return torch.cat((x2, -x1), dim=-1)

    namespace["rotate_half"] = rotate_half
    assert not is_transformers_rotary(namespace)
    assert not is_transformers_rotary({})


def _llama(layers=2):
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=layers, num_attention_heads=4,
                                      num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config).eval()


def test_a_model_without_rotary_positions_swaps_nothing():
    import transformers

    config = transformers.GraniteMoeHybridConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, layer_types=["mamba", "attention"],
        mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
        num_local_experts=2, num_experts_per_tok=1)
    model = transformers.GraniteMoeHybridForCausalLM(config).eval()
    assert config.position_embedding_type is None
    assert not DecodeRotary(model, check=None)


def test_the_attention_layers_are_found_and_a_cpu_model_keeps_its_function():
    model = _llama(layers=3)
    rotary = DecodeRotary(model, check=None)
    assert rotary.counts == {"LlamaAttention": 3} and rotary.describe() == "3 LlamaAttention"
    fused = FusedDecodeKernels(model)
    assert not fused.applies and not fused.rotary and fused.notes == []


def test_the_swap_is_undone_and_calls_the_kernel_does_not_take_run_transformers_function():
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    calls = []

    def check(name, fused, reference, state):
        calls.append(name)
        assert fused(state) is None  # on the CPU the kernel takes nothing
        return None

    rotary = DecodeRotary(_llama(), check)
    with pytest.raises(RuntimeError, match="inside"):
        with rotary.active():
            assert modeling_llama.apply_rotary_pos_emb is not original
            raise RuntimeError("inside")
    assert modeling_llama.apply_rotary_pos_emb is original
    q, k = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 1, 8)
    cos, sin = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    with rotary.active():
        got = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
        # Another unsqueeze_dim ([batch, seq, heads, dim] states): no check, transformers' own.
        other = modeling_llama.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos,
                                                    sin, unsqueeze_dim=2)
    want = original(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and calls == [NAME]
    assert all(torch.equal(a, b) for a, b in zip(
        other, original(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)))
