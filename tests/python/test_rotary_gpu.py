"""graphed's rotary embedding in one kernel (Note [Rotary embedding in one
kernel] in src/rotary_ops.cpp) on a GPU (marked ``gpu``): bitwise equal to
transformers' apply_rotary_pos_emb in float32, bfloat16 and float16, on
queries and keys as Llama's attention makes them (a transposed projection)
with cosines and sines from its rotary module, at decode and prefill sizes;
inside a CUDA graph, replayed with new inputs; refusals that run nothing."""

import pytest
import torch

from graphed import _C

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers")


def _rotary(head_dim=64):
    import transformers
    from transformers.models.llama import modeling_llama

    config = transformers.LlamaConfig(hidden_size=8 * head_dim, num_attention_heads=8,
                                      num_key_value_heads=2, max_position_embeddings=4096)
    return modeling_llama.LlamaRotaryEmbedding(config).cuda(), modeling_llama


def _states(batch, seq, heads, head_dim, dtype, generator):
    # Llama's attention: the projection viewed as [batch, seq, heads, dim], transposed.
    projected = torch.randn(batch, seq, heads * head_dim, device="cuda", generator=generator)
    return (projected * 2).to(dtype).view(batch, seq, heads, head_dim).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch, seq", [(1, 1), (8, 1), (3, 16)])
def test_the_rotation_is_transformers_to_the_bit(dtype, batch, seq):
    rotary, modeling = _rotary()
    g = torch.Generator(device="cuda").manual_seed(batch * 100 + seq)
    q = _states(batch, seq, 8, 64, dtype, g)
    k = _states(batch, seq, 2, 64, dtype, g)
    positions = torch.randint(0, 4000, (batch, seq), device="cuda", generator=g)
    with torch.no_grad():
        cos, sin = rotary(q, positions)
        want_q, want_k = modeling.apply_rotary_pos_emb(q, k, cos, sin)
        got_q = _C.try_rotary_embedding(q, cos, sin)
        got_k = _C.try_rotary_embedding(k, cos, sin)
        # One row of positions for every batch row (a broadcast batch of 1).
        one_cos, one_sin = cos[:1], sin[:1]
        want_one, _ = modeling.apply_rotary_pos_emb(q, k, one_cos, one_sin)
        got_one = _C.try_rotary_embedding(q, one_cos, one_sin)
    for got, want in ((got_q, want_q), (got_k, want_k), (got_one, want_one)):
        assert got is not None and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
        # The reference's layout (the strides of dimensions longer than one).
        assert [s for s, n in zip(got.stride(), got.shape) if n > 1] == \
            [s for s, n in zip(want.stride(), want.shape) if n > 1]


def test_the_rotation_replays_in_a_graph_with_new_inputs():
    rotary, modeling = _rotary()
    g = torch.Generator(device="cuda").manual_seed(0)
    q = _states(4, 1, 8, 64, torch.bfloat16, g).contiguous()
    positions = torch.zeros(4, 1, dtype=torch.long, device="cuda")
    with torch.no_grad():
        cos, sin = rotary(q, positions)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _C.try_rotary_embedding(q, cos, sin)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _C.try_rotary_embedding(q, cos, sin)
    for seed in (1, 2):
        g = torch.Generator(device="cuda").manual_seed(seed)
        q.copy_(_states(4, 1, 8, 64, torch.bfloat16, g))
        with torch.no_grad():
            new_cos, new_sin = rotary(q, torch.randint(0, 4000, (4, 1), device="cuda",
                                                       generator=g))
        cos.copy_(new_cos)
        sin.copy_(new_sin)
        graph.replay()
        want, _ = modeling.apply_rotary_pos_emb(q, q, cos, sin)
        assert torch.equal(out, want), seed


def test_arguments_the_kernel_does_not_take_are_refused():
    x = torch.randn(2, 4, 1, 8, device="cuda")
    cos, sin = torch.randn(2, 1, 8, device="cuda"), torch.randn(2, 1, 8, device="cuda")
    assert _C.rotary_embedding_refusal(x, cos, sin) is None
    assert "even last dimension" in _C.rotary_embedding_refusal(x[..., :7], cos[..., :7],
                                                                sin[..., :7])
    assert "dtype" in _C.rotary_embedding_refusal(x.bfloat16(), cos, sin.bfloat16())
    assert _C.try_rotary_embedding(x.bfloat16(), cos, sin.bfloat16()) is None
    assert "[2 or 1, 1, 8]" in _C.rotary_embedding_refusal(x, torch.randn(2, 3, 8,
                                                                          device="cuda"), sin)
    grad = x.detach().requires_grad_()
    assert "grad" in _C.rotary_embedding_refusal(grad, cos, sin)
    overlapping = torch.randn(2, 1, 1, 8, device="cuda").expand(2, 4, 1, 8)
    assert "dense" in _C.rotary_embedding_refusal(overlapping, cos, sin)
