"""graphed's RMSNorm in three kernels (Note [RMSNorm in three kernels] in
src/rms_norm_ops.cpp) on a GPU (marked ``gpu``): bitwise equal to
transformers' modules (Mamba2RMSNorm, LlamaRMSNorm, GptOssRMSNorm, Gemma 2
and 3's with 1 + weight, MambaRMSNormGated with and without its gate) in
float32, and every form in bfloat16 and float16, at decode and prefill sizes, with the gate a slice
of a projection as Mamba2Mixer passes it; inside a CUDA graph, replayed with
new inputs; and refusals (float64, mixed dtypes, grad, a broadcast gate)
that run nothing."""

import pytest
import torch

from graphed import _C

pytestmark = pytest.mark.gpu


def _norm(family, name, cols, seed):
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    norm = getattr(module, name)(cols, eps=1e-5 if family == "llama" else 1e-6).cuda()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(cols, generator=torch.Generator().manual_seed(seed)))
    return norm


@pytest.mark.parametrize("rows, seq, cols", [(1, 1, 512), (8, 1, 1024), (3, 1, 7), (2, 32, 256)])
@pytest.mark.parametrize("family, name", [("mamba2", "Mamba2RMSNorm"), ("llama", "LlamaRMSNorm"),
                                          ("gpt_oss", "GptOssRMSNorm")])
def test_the_plain_norm_is_transformers_to_the_bit(rows, seq, cols, family, name):
    pytest.importorskip("transformers")
    norm = _norm(family, name, cols, seed=cols)
    g = torch.Generator(device="cuda").manual_seed(rows)
    hidden = torch.randn(rows, seq, cols, device="cuda", generator=g) * 3
    with torch.no_grad():
        want = norm(hidden)
        got = _C.try_rms_norm(hidden, None, norm.weight, norm.variance_epsilon)
        # A row slice of a wider tensor, as a split of a projection gives.
        wide = torch.randn(rows, seq, cols + 5, device="cuda", generator=g)
        sliced = wide[..., 5:]
        want_sliced = norm(sliced)
        got_sliced = _C.try_rms_norm(sliced, None, norm.weight, norm.variance_epsilon)
    assert got is not None and got.shape == want.shape and torch.equal(got, want)
    assert got_sliced is not None and torch.equal(got_sliced, want_sliced)


@pytest.mark.parametrize("rows, cols", [(1, 512), (8, 512), (3, 7)])
@pytest.mark.parametrize("family, name", [("gemma3", "Gemma3RMSNorm"), ("gemma2", "Gemma2RMSNorm")])
def test_gemmas_one_plus_weight_norm_is_transformers_to_the_bit(rows, cols, family, name):
    # Note [RMSNorm in every decode step]: Gemma's (1 + weight), on the hidden
    # states and on its q/k norms' input at decode, [rows, heads, 1, head_dim]
    # transposed from the projection's [rows, 1, heads, head_dim].
    pytest.importorskip("transformers")
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    norm = getattr(module, name)(cols, eps=1e-6).cuda()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(cols, generator=torch.Generator().manual_seed(cols)) / 4)
    g = torch.Generator(device="cuda").manual_seed(rows)
    hidden = torch.randn(rows, 1, cols, device="cuda", generator=g) * 3
    heads = torch.randn(rows, 1, 4, cols, device="cuda", generator=g).transpose(1, 2)
    with torch.no_grad():
        for x in (hidden, heads):
            want = norm(x)
            got = _C.try_rms_norm(x, None, norm.weight, norm.eps, True)
            assert got is not None and got.shape == want.shape and torch.equal(got, want)
            # Without the flag the result is Llama's: the flag is what adds the one.
            assert not torch.equal(_C.try_rms_norm(x, None, norm.weight, norm.eps), want)


@pytest.mark.parametrize("rows, seq, cols", [(1, 1, 1024), (8, 1, 1024), (5, 1, 96), (2, 32, 256)])
def test_the_gated_norm_is_transformers_to_the_bit(rows, seq, cols):
    pytest.importorskip("transformers")
    norm = _norm("mamba2", "MambaRMSNormGated", cols, seed=cols)
    g = torch.Generator(device="cuda").manual_seed(rows + cols)
    # Mamba2Mixer's gate: the first columns of its input projection's output.
    projected = torch.randn(rows, seq, cols + 3 * cols + 8, device="cuda", generator=g) * 2
    gate = projected.split([cols, 3 * cols + 8], dim=-1)[0]
    scan = torch.randn(rows, seq, cols, device="cuda", generator=g)
    with torch.no_grad():
        want = norm(scan, gate)
        got = _C.try_rms_norm(scan, gate, norm.weight, norm.variance_epsilon)
        want_plain = norm(scan)
        got_plain = _C.try_rms_norm(scan, None, norm.weight, norm.variance_epsilon)
    assert got is not None and torch.equal(got, want)
    assert got_plain is not None and torch.equal(got_plain, want_plain)


def test_the_norm_replays_in_a_graph_with_new_inputs():
    pytest.importorskip("transformers")
    norm = _norm("mamba2", "MambaRMSNormGated", 512, seed=0)
    scan = torch.randn(4, 1, 512, device="cuda")
    gate = torch.randn(4, 1, 512, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        _C.try_rms_norm(scan, gate, norm.weight, norm.variance_epsilon)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = _C.try_rms_norm(scan, gate, norm.weight, norm.variance_epsilon)
    for seed in (1, 2):
        g = torch.Generator(device="cuda").manual_seed(seed)
        scan.copy_(torch.randn(4, 1, 512, device="cuda", generator=g))
        gate.copy_(torch.randn(4, 1, 512, device="cuda", generator=g))
        graph.replay()
        with torch.no_grad():
            assert torch.equal(out, norm(scan, gate)), seed


# (family, class, Llama's rounding before the weight, Gemma's 1 + weight)
FORMS = [("llama", "LlamaRMSNorm", True, False), ("gpt_oss", "GptOssRMSNorm", False, False),
         ("gemma3", "Gemma3RMSNorm", False, True)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family, name, round_before, plus_one", FORMS)
@pytest.mark.parametrize("rows, seq, cols", [(1, 1, 512), (8, 1, 1024), (3, 1, 7), (2, 32, 256)])
def test_every_form_in_half_precision_is_transformers_to_the_bit(dtype, family, name,
                                                                 round_before, plus_one, rows,
                                                                 seq, cols):
    # Note [RMSNorm in every decode step]: the casts of bfloat16 and float16
    # folded into the kernels, each form rounding where its forward rounds.
    pytest.importorskip("transformers")
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    norm = getattr(module, name)(cols, eps=1e-6).to("cuda", dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(cols, generator=torch.Generator().manual_seed(cols)) / 4)
    eps = norm.eps if plus_one else norm.variance_epsilon
    g = torch.Generator(device="cuda").manual_seed(rows * seq)
    hidden = (torch.randn(rows, seq, cols, device="cuda", generator=g) * 3).to(dtype)
    # A q/k norm's input: [rows, heads, seq, head_dim] transposed from the projection.
    heads = torch.randn(rows, seq, 4, cols, device="cuda", generator=g).to(dtype).transpose(1, 2)
    wide = torch.randn(rows, seq, cols + 5, device="cuda", generator=g).to(dtype)[..., 5:]
    with torch.no_grad():
        if seq > 1:  # heads and positions interleave: no single row stride, refused
            assert _C.try_rms_norm(heads, None, norm.weight, eps, plus_one, round_before) is None
        for x in (hidden, wide) + ((heads,) if seq == 1 else ()):
            want = norm(x)
            got = _C.try_rms_norm(x, None, norm.weight, eps, plus_one, round_before)
            assert got is not None and got.dtype == want.dtype == dtype
            assert got.shape == want.shape and torch.equal(got, want), (x.shape, x.stride())
        # Rounding at the other place differs: the flag is what reproduces the form.
        many = (torch.randn(64, 1, cols, device="cuda", generator=g) * 3).to(dtype)
        other = _C.try_rms_norm(many, None, norm.weight, eps, plus_one, not round_before)
        assert cols < 64 or not torch.equal(other, norm(many))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_gated_norm_in_half_precision_is_transformers_to_the_bit(dtype):
    pytest.importorskip("transformers")
    norm = _norm("mamba2", "MambaRMSNormGated", 512, seed=5).to(dtype)
    g = torch.Generator(device="cuda").manual_seed(7)
    projected = (torch.randn(4, 1, 4 * 512, device="cuda", generator=g) * 2).to(dtype)
    gate = projected[..., :512]
    scan = torch.randn(4, 1, 512, device="cuda", generator=g).to(dtype)
    with torch.no_grad():
        assert torch.equal(_C.try_rms_norm(scan, gate, norm.weight, norm.variance_epsilon),
                           norm(scan, gate))
        assert torch.equal(_C.try_rms_norm(scan, None, norm.weight, norm.variance_epsilon),
                           norm(scan))


def test_arguments_the_kernels_do_not_take_are_refused():
    weight = torch.ones(64, device="cuda")
    hidden = torch.randn(2, 1, 64, device="cuda")
    assert "float32, bfloat16 or float16" in _C.rms_norm_refusal(hidden.double(), None,
                                                                weight.double())
    assert _C.try_rms_norm(hidden.double(), None, weight.double(), 1e-6) is None
    # A float32 weight with bfloat16 states (autocast): transformers promotes.
    assert "dtype" in _C.rms_norm_refusal(hidden.bfloat16(), None, weight)
    assert _C.try_rms_norm(hidden.bfloat16(), None, weight, 1e-6) is None
    grad = hidden.detach().requires_grad_()
    assert "grad" in _C.rms_norm_refusal(grad, None, weight)
    assert "broadcasts" in _C.rms_norm_refusal(hidden, torch.randn(1, 1, 64, device="cuda"),
                                               weight)
    assert "shape [64]" in _C.rms_norm_refusal(hidden, None, torch.ones(32, device="cuda"))
    assert "row stride" in _C.rms_norm_refusal(hidden.transpose(0, 2), None,
                                               torch.ones(2, device="cuda"))
