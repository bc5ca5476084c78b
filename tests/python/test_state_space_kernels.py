"""graphed's fused decode-step kernels for Mamba2-family layers (Note [Fused
state-space decode steps] in src/state_space_ops.cpp), on any machine: that
transformers' reference functions are recognised in every Mamba2-family
model that has them, that a model the kernels cannot take keeps them (and
says so), that the swap is undone whatever happens inside it, the first
call's check against transformers' function (a kernel that differs is
dropped, one that agrees is trusted), and the refusals, which run nothing. The kernels' results: test_state_space_kernels_gpu.py."""

import importlib

import pytest
import torch

from graphed import _C
from graphed._decode_kernels import FusedDecodeKernels
from graphed._state_space_kernels import torch_reference

FAMILIES = ["mamba2", "bamba", "granitemoehybrid", "zamba2", "nemotron_h", "falcon_h1"]


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_reference_functions_are_recognised(family):
    pytest.importorskip("transformers")
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    for name in ("mamba2_selective_state_update", "causal_conv1d_update"):
        reference = torch_reference(getattr(module, name))
        # None would mean a package kernel (mamba-ssm, causal-conv1d) took the
        # function's place, or transformers changed the wrapper: either way
        # graphed keeps transformers' function.
        assert reference is not None and reference.__name__ == name, (family, name)


def test_other_functions_are_not_taken_for_the_reference():
    assert torch_reference(torch.exp) is None
    assert torch_reference(lambda x: x) is None
    assert torch_reference(None) is None


def _mamba2():
    import transformers

    torch.manual_seed(0)
    config = transformers.Mamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                       state_size=8, expand=2, head_dim=8, num_heads=8,
                                       n_groups=1, chunk_size=8)
    return transformers.Mamba2ForCausalLM(config).eval()


def test_a_model_on_the_cpu_keeps_transformers_functions_and_says_why():
    pytest.importorskip("transformers")
    from transformers.models.mamba2 import modeling_mamba2

    fused = FusedDecodeKernels(_mamba2())
    assert len(fused.notes) == 1 and "keep transformers' torch reference" in fused.notes[0]
    assert "2 Mamba2Mixer" in fused.notes[0] and "the CPU" in fused.notes[0], fused.notes
    before = modeling_mamba2.mamba2_selective_state_update
    with fused.active():
        assert modeling_mamba2.mamba2_selective_state_update is before


def test_a_model_without_state_space_layers_finds_nothing():
    pytest.importorskip("transformers")
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2)
    fused = FusedDecodeKernels(transformers.LlamaForCausalLM(config))
    assert fused.notes == []
    with fused.active():
        pass


def test_the_swap_is_undone_when_the_step_raises():
    pytest.importorskip("transformers")
    from transformers.models.mamba2 import modeling_mamba2

    fused = FusedDecodeKernels(_mamba2())
    before = (modeling_mamba2.mamba2_selective_state_update, modeling_mamba2.causal_conv1d_update)
    # As if the model were float32 on a GPU: the swap itself is what is tested.
    namespace = vars(modeling_mamba2)
    fused._swaps = {(id(namespace), "mamba2_selective_state_update"): (namespace, len),
                    (id(namespace), "causal_conv1d_update"): (namespace, abs)}
    with pytest.raises(ValueError, match="inside"):
        with fused.active():
            assert modeling_mamba2.mamba2_selective_state_update is len
            raise ValueError("inside")
    assert (modeling_mamba2.mamba2_selective_state_update,
            modeling_mamba2.causal_conv1d_update) == before


def test_arguments_the_kernels_do_not_take_are_refused_with_the_reason():
    state = torch.zeros(1, 4, 2, 3)
    x = dt = torch.zeros(1, 4, 2)
    A = torch.zeros(4, 2, 3)
    B = C = torch.zeros(1, 1, 3)
    why = _C.selective_state_update_refusal(state, x, dt, A, B, C)
    assert "on a CUDA device" in why and "state" in why, why
    assert _C.try_selective_state_update(state, x, dt, A, B, C) is None
    conv_x, conv_state, weight = torch.zeros(1, 4, 1), torch.zeros(1, 4, 4), torch.zeros(4, 4)
    assert "on a CUDA device" in _C.causal_conv1d_update_refusal(conv_x, conv_state, weight)
    assert _C.try_causal_conv1d_update(conv_x, conv_state, weight, None, True) is None


def test_a_fused_kernel_that_differs_from_transformers_is_dropped_at_its_first_call():
    from graphed import _state_space_kernels as kernels

    verdicts, mismatches = {}, []

    def reference(target):
        target.add_(1.0)
        return target.sum(-1)

    def off_by_half(target):
        target.add_(1.5)
        return target.sum(-1)

    state = torch.zeros(2, 3)
    out = kernels._checked("f", verdicts, lambda name, d: mismatches.append((name, d)),
                           off_by_half, reference, state)
    assert verdicts == {"f": False} and mismatches == [("f", 1.5)]
    assert torch.equal(state, torch.ones(2, 3)) and torch.equal(out, torch.full((2,), 3.0))


def test_a_fused_kernel_equal_to_transformers_is_checked_once_then_trusted():
    from graphed import _state_space_kernels as kernels

    verdicts, reference_calls = {}, []

    def reference(target):
        reference_calls.append(1)
        target.mul_(2.0)
        return target.sum(-1)

    def fused(target):
        target.mul_(2.0)
        return target.sum(-1)

    state = torch.ones(2, 3)
    for _ in range(3):
        kernels._checked("f", verdicts, None, fused, reference, state)
    assert verdicts == {"f": True} and len(reference_calls) == 1
    assert torch.equal(state, torch.full((2, 3), 8.0))


def test_a_dropped_kernel_leaves_the_calls_to_transformers(monkeypatch):
    from graphed import _state_space_kernels as kernels

    monkeypatch.setattr(kernels._C, "try_causal_conv1d_update",
                        lambda *args: pytest.fail("a dropped kernel must not run"))
    seen = []

    def transformers_function(hidden_states, conv_state, weight, bias, activation):
        seen.append(activation)
        return hidden_states

    update = kernels._fused_conv1d_update(transformers_function, {"causal_conv1d_update": False},
                                          None)
    x = torch.zeros(1, 4, 1)
    assert update(x, torch.zeros(1, 4, 4), torch.zeros(4, 4), None, "silu") is x
    assert seen == ["silu"]
