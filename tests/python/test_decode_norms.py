"""Which RMSNorm modules graphed's decode steps run in three kernels (Note
[RMSNorm in every decode step] in python/graphed/_decode_norms.py), on any
machine: transformers' forms are recognised by what they compute, whatever
the class is called, and those that compute otherwise are not; a model off
the GPU or not in float32 keeps its forwards; the forwards are put back after
a step whatever it raises; the first call's check. The kernels' results:
test_rms_norm_gpu.py; whole decoders: test_generate_gpu.py."""

import importlib

import pytest
import torch

from graphed._decode_norms import DecodeNorms, rms_norm_kind
from graphed._decode_kernels import FusedDecodeKernels

pytest.importorskip("transformers")

NORMS = [("mamba2", "Mamba2RMSNorm", "rms_norm"), ("mamba2", "MambaRMSNormGated", "rms_norm_gated"),
         ("llama", "LlamaRMSNorm", "rms_norm"), ("bamba", "BambaRMSNorm", "rms_norm"),
         ("mistral", "MistralRMSNorm", "rms_norm"), ("qwen3_moe", "Qwen3MoeRMSNorm", "rms_norm"),
         ("gpt_oss", "GptOssRMSNorm", "rms_norm_cast_last"),
         ("olmo2", "Olmo2RMSNorm", "rms_norm_cast_last"),
         ("gemma", "GemmaRMSNorm", "rms_norm_plus_one"),
         ("gemma2", "Gemma2RMSNorm", "rms_norm_plus_one"),
         ("gemma3", "Gemma3RMSNorm", "rms_norm_plus_one")]


@pytest.mark.parametrize("family, name, kind", NORMS)
def test_transformers_rms_norms_are_recognised_by_what_they_compute(family, name, kind):
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    norm = getattr(module, name)(16)
    assert rms_norm_kind(norm) == kind


class _Scaled(torch.nn.Module):  # Llama's body with one more product
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return 2 * self.weight * hidden_states.to(input_dtype)


def test_rms_norms_that_compute_otherwise_are_not_taken():
    from transformers.models.gemma3 import modeling_gemma3

    class GemmaOtherNorm(modeling_gemma3.Gemma3RMSNorm):  # Gemma's forward, another _norm
        def _norm(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 2 * self.eps)

    class GemmaIntEps(modeling_gemma3.Gemma3RMSNorm):
        pass

    odd = GemmaIntEps(16)
    odd.eps = 1  # an int epsilon: not the float the kernel takes
    assert rms_norm_kind(_Scaled()) is None
    assert rms_norm_kind(GemmaOtherNorm(16)) is None
    assert rms_norm_kind(odd) is None
    assert rms_norm_kind(GemmaIntEps(16)) == "rms_norm_plus_one"  # a subclass computing the same
    assert rms_norm_kind(torch.nn.LayerNorm(4)) is None


def _gemma3():
    import transformers

    config = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=2,
                                           num_key_value_heads=1, head_dim=16)
    return transformers.Gemma3ForCausalLM(config).eval()


def test_every_norm_of_a_gemma3_is_found_and_a_cpu_model_keeps_its_forwards():
    model = _gemma3()
    norms = DecodeNorms(model, check=None)
    # Per layer: input, post-attention, pre- and post-feedforward, q and k; the last.
    assert norms.counts == {"Gemma3RMSNorm": 13}, norms.counts
    fused = FusedDecodeKernels(model)
    assert not fused.applies and fused.notes == []  # on the CPU: nothing, silently


def test_the_forwards_are_put_back_after_the_step_and_the_first_call_is_checked():
    model = _gemma3()
    calls = []

    def check(name, fused, reference, hidden):
        calls.append(name)
        return None  # as when the kernel does not take the arguments: the module's own runs

    norms = DecodeNorms(model, check)
    modules = [m for m in model.modules() if rms_norm_kind(m)]
    with pytest.raises(RuntimeError, match="inside"):
        with norms.active():
            assert all("forward" in m.__dict__ for m in modules)
            raise RuntimeError("inside")
    assert not any("forward" in m.__dict__ for m in modules)
    norm = model.model.norm
    x = torch.randn(2, 1, 32)
    with norms.active():
        got = norm(x)
    assert torch.equal(got, type(norm).forward(norm, x)) and calls == ["rms_norm_plus_one"]


def test_a_gated_norm_without_its_gate_is_checked_as_the_plain_form():
    from transformers.models.mamba2 import modeling_mamba2

    holder = torch.nn.Sequential(modeling_mamba2.MambaRMSNormGated(8))
    calls = []
    norms = DecodeNorms(holder, lambda name, *rest: calls.append(name))
    with norms.active():
        holder[0](torch.randn(1, 8))
        holder[0](torch.randn(1, 8), torch.randn(1, 8))
    assert calls == ["rms_norm", "rms_norm_gated"]


def test_a_mamba2_keeps_its_norms_off_the_gpu_and_says_why_for_its_kernels():
    import transformers

    config = transformers.Mamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                       state_size=8, expand=2, head_dim=8, num_heads=8,
                                       n_groups=1, chunk_size=8)
    fused = FusedDecodeKernels(transformers.Mamba2ForCausalLM(config).eval())
    assert not fused.applies and not fused.norms
    assert len(fused.notes) == 1 and "keep transformers' torch reference" in fused.notes[0]
