"""graphed's fused decode-step kernels for Mamba2-family layers (Note [Fused
state-space decode steps] in src/state_space_ops.cpp) on a GPU (marked
``gpu``): every output and every updated state bitwise equal to
transformers' torch reference functions, on the arguments Mamba2Mixer
passes (expanded dt, A, D and dt_bias; B and C split from one projection;
the convolution's input a transposed view), at batch 1 and 5, one and two
groups, softplus on and off, with and without D, bias and SiLU; inside a
CUDA graph, replayed with new inputs; refusals for bfloat16, grad and a gate
z (transformers' function runs); and a float32 Mamba2 and granite-moe-hybrid
decoding on graphs with transformers' tokens and saying that it fused."""

import pytest
import torch

import graphed
from graphed import _C
from graphed._state_space_kernels import torch_reference

pytestmark = pytest.mark.gpu


def _references():
    from transformers.models.mamba2 import modeling_mamba2

    return (torch_reference(modeling_mamba2.mamba2_selective_state_update),
            torch_reference(modeling_mamba2.causal_conv1d_update))


def _step_arguments(batch, heads=16, head_dim=64, state_size=64, groups=1, seed=0):
    """The arguments Mamba2Mixer's decode step passes, built the way it builds them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    intermediate = heads * head_dim
    projected = torch.randn(batch, 1, intermediate + 2 * groups * state_size + heads,
                            device="cuda", generator=g)
    x_bc, dt = projected.split([intermediate + 2 * groups * state_size, heads], dim=-1)
    x, B, C = x_bc.split([intermediate, groups * state_size, groups * state_size], dim=-1)
    A_log = torch.rand(heads, device="cuda", generator=g) * 2
    A = (-torch.exp(A_log.float()))[:, None, None].expand(-1, head_dim, state_size)
    D = torch.randn(heads, device="cuda", generator=g)[:, None].expand(-1, head_dim)
    dt_bias = torch.randn(heads, device="cuda", generator=g)[:, None].expand(-1, head_dim)
    state = torch.randn(batch, heads, head_dim, state_size, device="cuda", generator=g)
    return dict(state=state, x=x.reshape(batch, heads, head_dim),
                dt=dt.transpose(1, 2).expand(-1, -1, head_dim),
                A=A, B=B.reshape(batch, groups, state_size), C=C.reshape(batch, groups, state_size),
                D=D, dt_bias=dt_bias)


@pytest.mark.parametrize("batch, groups", [(1, 1), (5, 1), (5, 2)])
@pytest.mark.parametrize("softplus, skip", [(True, True), (False, False)])
def test_the_state_update_is_transformers_to_the_bit(batch, groups, softplus, skip):
    reference, _ = _references()
    args = _step_arguments(batch, groups=groups)
    D = args["D"] if skip else None
    want_state = args["state"].clone()
    want = reference(want_state, args["x"], args["dt"], args["A"], args["B"], args["C"], D,
                     dt_bias=args["dt_bias"], dt_softplus=softplus)
    got_state = args["state"].clone()
    got = _C.try_selective_state_update(got_state, args["x"], args["dt"], args["A"], args["B"],
                                        args["C"], D, args["dt_bias"], softplus)
    assert got is not None
    assert torch.equal(got_state, want_state)
    assert got.shape == want.shape and torch.equal(got, want)


def _conv_arguments(batch, channels=1152, width=4, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    projected = torch.randn(batch, 1, channels + 40, device="cuda", generator=g)
    x = projected[..., 20:20 + channels].transpose(1, 2)  # the Mixer's transposed view
    state = torch.randn(batch, channels, width, device="cuda", generator=g)
    weight = torch.randn(channels, 1, width, device="cuda", generator=g).squeeze(1)
    bias = torch.randn(channels, device="cuda", generator=g)
    return x, state, weight, bias


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("activation, with_bias", [("silu", True), (None, False)])
def test_the_convolution_update_is_transformers_to_the_bit(batch, activation, with_bias):
    _, reference = _references()
    x, state, weight, bias = _conv_arguments(batch)
    bias = bias if with_bias else None
    want_state = state.clone()
    want = reference(x, want_state, weight, bias, activation)
    got_state = state.clone()
    got = _C.try_causal_conv1d_update(x, got_state, weight, bias, activation is not None)
    assert got is not None
    assert torch.equal(got_state, want_state)
    assert got.shape == want.shape and torch.equal(got, want)


def test_both_kernels_replay_in_a_graph_with_new_inputs():
    reference, conv_reference = _references()
    args = _step_arguments(2, seed=1)
    x, conv_state, weight, bias = _conv_arguments(2, seed=1)
    state, conv_input = args["state"].clone(), x.clone()
    start_state, start_conv = state.clone(), conv_state.clone()

    def step():
        conv = _C.try_causal_conv1d_update(conv_input, conv_state, weight, bias, True)
        out = _C.try_selective_state_update(state, args["x"], args["dt"], args["A"], args["B"],
                                            args["C"], args["D"], args["dt_bias"], True)
        return conv, out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        conv_out, out = step()
    for seed in (2, 3):
        fresh = _step_arguments(2, seed=seed)
        for name in ("x", "B", "C"):
            args[name].copy_(fresh[name])
        conv_input.copy_(_conv_arguments(2, seed=seed)[0])
        state.copy_(start_state)
        conv_state.copy_(start_conv)
        graph.replay()
        want_state, want_conv_state = start_state.clone(), start_conv.clone()
        want_conv = conv_reference(conv_input, want_conv_state, weight, bias, "silu")
        want = reference(want_state, args["x"], args["dt"], args["A"], args["B"], args["C"],
                         args["D"], dt_bias=args["dt_bias"], dt_softplus=True)
        assert torch.equal(out, want) and torch.equal(state, want_state), seed
        assert torch.equal(conv_out, want_conv) and torch.equal(conv_state, want_conv_state)


def test_arguments_the_kernels_do_not_take_are_refused():
    args = _step_arguments(1)
    half = {k: v.to(torch.bfloat16) for k, v in args.items()}
    why = _C.selective_state_update_refusal(half["state"], half["x"], half["dt"], half["A"],
                                            half["B"], half["C"], half["D"], half["dt_bias"])
    assert "float32" in why, why
    grad = args["x"].detach().requires_grad_()
    why = _C.selective_state_update_refusal(args["state"], grad, args["dt"], args["A"],
                                            args["B"], args["C"])
    assert "grad" in why, why
    wrong = _C.selective_state_update_refusal(args["state"], args["x"], args["dt"], args["A"],
                                              torch.zeros(1, 3, 64, device="cuda"), args["C"])
    assert "divisor of 16" in wrong, wrong
    x, state, weight, bias = _conv_arguments(1)
    longer = torch.zeros(1, x.shape[1], 3, device="cuda")
    assert "one new position" in _C.causal_conv1d_update_refusal(longer, state, weight, bias)
    assert _C.try_causal_conv1d_update(x.half(), state.half(), weight.half(), None,
                                       True) is None


@pytest.mark.parametrize("arch", ["mamba2", "granite_hybrid"])
def test_float32_state_space_models_decode_fused_with_transformers_tokens(arch):
    import transformers

    torch.manual_seed(0)
    if arch == "mamba2":
        config = transformers.Mamba2Config(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                           state_size=16, expand=2, head_dim=16, num_heads=8,
                                           n_groups=1, chunk_size=8)
        model = transformers.Mamba2ForCausalLM(config).cuda().eval()
    else:
        from generate_models import tiny_model

        model = tiny_model("granite_hybrid", "cuda")
    ids = torch.randint(3, 127, (3, 10), device="cuda")
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    got = graphed.generate(model, ids, max_new_tokens=24, pad_token_id=0)
    assert torch.equal(got, want)
    decoder = model.__dict__["_graphed_decoder"]
    assert any("fused selective state update" in note for note in decoder.notes), decoder.notes
    # The first call's check against transformers' functions passed for both.
    assert not any("differed" in note for note in decoder.notes), decoder.notes
    assert decoder._adapter[0].fused.verdicts == {"mamba2_selective_state_update": True,
                                                  "causal_conv1d_update": True,
                                                  "rms_norm": True, "rms_norm_gated": True}
    assert any("run graphed's rms_norm" in note for note in decoder.notes), decoder.notes
