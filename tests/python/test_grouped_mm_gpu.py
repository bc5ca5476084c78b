"""graphed.moe.grouped_mm: the grouped product of mixture-of-experts layers,
capturable in every dtype (Note [A grouped GEMM every dtype can capture] in
src/grouped_mm.cpp).

On a GPU (marked ``gpu``): the output and both gradients against a float64
loop of per-group ``torch.mm``, for float32, float16 and bfloat16, through
graphed's kernels and through the automatic choice (torch's kernel for
aligned bfloat16 on sm90/sm100): uneven and empty groups, every row in one
group, rows past ``offs[-1]`` (exactly zero, also in the input gradient),
sizes that are not multiples of the 64x64 tile, weights stored
``[E, N, K]`` and passed transposed (as transformers does), strided inputs,
70 groups, forwards of at most 32 rows (a decode step's: their own kernel);
capture inside ``torch.cuda.graph`` and replays with other offsets written
into the same tensor; offsets out of range and out of order
(no fault, the CUDA context still works). Without the marker, on any machine:
the argument checks, which raise before anything touches a GPU."""

import pytest
import torch

import graphed
from graphed import moe

gpu = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# max |got - want| / max(max |want|, 1): the output's rounding dominates for
# the 16-bit dtypes (2^-11 and 2^-8 relative), float32 accumulation for float32.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def effective_ends(ends, rows):
    """The offsets as the kernels read them: clamped into [0, rows], running max."""
    out, running = [], 0
    for end in ends:
        running = max(running, min(max(int(end), 0), rows))
        out.append(running)
    return out


def reference(a, b, ends):
    """out[rows of g] = a[rows of g] @ b[g] in float64 on the CPU; zeros elsewhere."""
    a64, b64 = a.detach().cpu().double(), b.detach().cpu().double()
    out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            out[start:end] = a64[start:end] @ b64[g]
        start = end
    return out


def reference_weight_grad(a, grad, ends):
    a64, g64 = a.detach().cpu().double(), grad.detach().cpu().double()
    out = torch.zeros(len(ends), a.shape[1], grad.shape[1], dtype=torch.float64)
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            out[g] = a64[start:end].T @ g64[start:end]
        start = end
    return out


def assert_close(got, want, dtype, where):
    assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got64 = got.detach().cpu().double()
    assert torch.isfinite(got64).all(), f"{where}: non-finite values"
    scale = max(float(want.abs().max()) if want.numel() else 0.0, 1.0)
    error = float((got64 - want).abs().max()) / scale if want.numel() else 0.0
    assert error <= TOLERANCE[dtype], f"{where}: relative error {error:.3g}"


def assert_zero_rows(t, start, where):
    tail = t.detach()[start:]
    assert tail.numel() == 0 or float(tail.abs().max()) == 0.0, (
        f"{where}: rows from {start} (past the last offset) must be exactly zero")


def cumulative(counts):
    out, total = [], 0
    for c in counts:
        total += c
        out.append(total)
    return out


def _many_groups():
    counts = [0] * 70
    for g in range(0, 70, 3):
        counts[g] = g % 11 + 1
    counts[69] = 65
    return counts


# name, rows, K, N, rows per group (the rest are rows past the last offset), transposed weights
CASES = [
    ("uneven", 150, 40, 70, [17, 0, 64, 1, 30], False),
    ("uneven-transposed", 150, 40, 70, [17, 0, 64, 1, 30], True),
    ("one-group", 200, 96, 130, [0, 200, 0], False),
    ("70-groups", 400, 24, 33, _many_groups(), True),
    ("tiny", 5, 3, 1, [2, 3], False),
    ("no-rows", 20, 8, 8, [0, 0, 0], False),
    ("aligned", 256, 128, 256, [64, 0, 100, 80], False),
    ("aligned-transposed", 256, 128, 256, [64, 0, 100, 80], True),
    ("k-and-n-past-a-tile", 300, 130, 200, [90, 110, 70], True),
    # At most 32 rows: the few-rows kernel (Note [A decode step's few rows]).
    ("decode-b1-top2", 2, 512, 1024, [0, 1, 0, 0, 1, 0, 0, 0], False),
    ("decode-b8-top2-transposed", 16, 96, 130, [3, 0, 5, 0, 1, 2, 0, 3], True),
    ("few-rows-one-group", 32, 40, 70, [0, 32], False),
    ("few-rows-one-group-transposed", 32, 40, 70, [0, 32], True),
    ("few-rows-odd-sizes", 13, 33, 17, [6, 0, 5], True),
]


def make_operands(rows, k, n, counts, transposed, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    groups = len(counts)
    a = torch.randn(rows, k, device="cuda", generator=g).to(dtype).requires_grad_()
    shape = (groups, n, k) if transposed else (groups, k, n)
    weight = torch.randn(*shape, device="cuda", generator=g).to(dtype).requires_grad_()
    return a, weight, (weight.transpose(-2, -1) if transposed else weight)


@gpu
@pytest.mark.parametrize("kernels", ["graphed", "auto"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_output_and_gradients_match_a_float64_loop(case, dtype, kernels):
    name, rows, k, n, counts, transposed = case
    a, weight, b = make_operands(rows, k, n, counts, transposed, dtype)
    ends = cumulative(counts)
    offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
    eff = effective_ends(ends, rows)

    out = moe.grouped_mm(a, b, offs, kernels=kernels)
    assert out.dtype == dtype and out.shape == (rows, n)
    assert_close(out, reference(a, b, eff), dtype, "output")
    assert_zero_rows(out, eff[-1], "output")

    grad = torch.randn(rows, n, device="cuda").to(dtype)
    grad_a, grad_w = torch.autograd.grad(out, (a, weight), grad)
    assert grad_w.shape == weight.shape
    assert_close(grad_a, reference(grad, b.transpose(-2, -1), eff), dtype, "input gradient")
    assert_zero_rows(grad_a, eff[-1], "input gradient")
    grad_b = grad_w.transpose(-2, -1) if transposed else grad_w
    assert_close(grad_b, reference_weight_grad(a, grad, eff), dtype, "weight gradient")
    start = 0
    for g, end in enumerate(eff):
        if end == start:
            assert float(grad_b[g].abs().max()) == 0.0, f"empty group {g} has a gradient"
        start = end


@gpu
def test_backward_into_parameters_accumulates_like_the_loop():
    # .backward() into leaf weights stored [E, N, K] (transformers' layout),
    # twice: the gradients accumulate.
    torch.manual_seed(1)
    a = torch.randn(96, 48, device="cuda", requires_grad=True)
    w = torch.nn.Parameter(torch.randn(3, 40, 48, device="cuda"))
    offs = torch.tensor([30, 30, 90], dtype=torch.int32, device="cuda")
    for _ in range(2):
        moe.grouped_mm(a, w.transpose(-2, -1), offs).sum().backward()
    ones = torch.ones(96, 40, device="cuda")
    eff = effective_ends([30, 30, 90], 96)
    want_w = 2 * reference_weight_grad(a, ones, eff).transpose(-2, -1)
    assert_close(w.grad, want_w, torch.float32, "accumulated weight gradient")
    assert_close(a.grad, 2 * reference(ones, w.detach(), eff), torch.float32,
                 "accumulated input gradient")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_input_needs_no_copy(dtype):
    torch.manual_seed(2)
    wide = torch.randn(90, 50, device="cuda").to(dtype)
    a = wide[:, 3:43]
    b = torch.randn(3, 70, 40, device="cuda").to(dtype).permute(0, 2, 1)
    offs = torch.tensor([30, 30, 77], dtype=torch.int32, device="cuda")
    eff = effective_ends([30, 30, 77], 90)
    assert_close(moe.grouped_mm(a, b, offs), reference(a, b, eff), dtype, "strided operands")


@gpu
def test_torch_kernel_is_chosen_for_aligned_bfloat16_on_hopper_and_blackwell():
    major = torch.cuda.get_device_capability()[0]
    a = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4, 256, 128, device="cuda", dtype=torch.bfloat16)
    assert moe.grouped_mm_uses_torch(a, w.transpose(-2, -1)) == (major in (9, 10))
    assert not moe.grouped_mm_uses_torch(a.float(), w.float().transpose(-2, -1))
    assert not moe.grouped_mm_uses_torch(a.half(), w.half().transpose(-2, -1))
    # in_features 12: leading strides of 24 bytes are not what torch's kernel takes.
    assert not moe.grouped_mm_uses_torch(a[:, :12].contiguous(),
                                         torch.randn(4, 12, 8, device="cuda",
                                                     dtype=torch.bfloat16))


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [192, 16], ids=["tiles", "few-rows"])
def test_captured_graph_follows_the_offsets_written_before_each_replay(dtype, rows):
    torch.manual_seed(3)
    k, n, groups = 64, 128, 4
    a = torch.randn(rows, k, device="cuda").to(dtype).requires_grad_()
    w = torch.randn(groups, n, k, device="cuda").to(dtype).requires_grad_()
    grad = torch.randn(rows, n, device="cuda").to(dtype)
    scale = rows / 192  # the offsets below are for 192 rows
    offs = torch.tensor([int(e * scale) for e in (50, 50, 120, 150)], dtype=torch.int32,
                        device="cuda")

    def step():
        out = moe.grouped_mm(a, w.transpose(-2, -1), offs)
        grad_a, grad_w = torch.autograd.grad(out, (a, w), grad)
        return out, grad_a, grad_w

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()

    for ends in ([0, 192, 192, 192], [10, 20, 30, 40], [64, 64, 64, 180], [50, 50, 120, 150],
                 [192, 192, 192, 192]):
        ends = [int(e * scale) for e in ends]
        offs.copy_(torch.tensor(ends, dtype=torch.int32))
        graph.replay()
        eff = effective_ends(ends, rows)
        b = w.transpose(-2, -1)
        assert_close(static[0], reference(a, b, eff), dtype, f"output, offsets {ends}")
        assert_zero_rows(static[0], eff[-1], f"output, offsets {ends}")
        assert_close(static[1], reference(grad, w, eff), dtype, f"input gradient, offsets {ends}")
        assert_zero_rows(static[1], eff[-1], f"input gradient, offsets {ends}")
        assert_close(static[2].transpose(-2, -1), reference_weight_grad(a, grad, eff), dtype,
                     f"weight gradient, offsets {ends}")


@gpu
def test_transformers_style_routing_captures_in_float32():
    # The routing of transformers' grouped_mm_experts_forward, all on the
    # device: sort by expert, histc, int32 cumsum; then the two projections.
    torch.manual_seed(4)
    experts, tokens, top_k, hidden, inter = 8, 64, 2, 32, 48
    x = torch.randn(tokens, hidden, device="cuda")
    router = torch.randn(tokens, experts, device="cuda")
    up = torch.randn(experts, inter, hidden, device="cuda") * 0.1
    down = torch.randn(experts, hidden, inter, device="cuda") * 0.1

    def layer():
        top = router.topk(top_k, dim=-1).indices.reshape(-1)
        ids, perm = torch.sort(top)
        rows = x[perm // top_k]
        counts = torch.histc(ids.int(), bins=experts, min=0, max=experts - 1)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = torch.nn.functional.gelu(moe.grouped_mm(rows, up.transpose(-2, -1), offs))
        return moe.grouped_mm(h, down.transpose(-2, -1), offs), ids, rows

    eager, ids, rows = layer()
    want = torch.zeros(tokens * top_k, hidden, dtype=torch.float64)
    for r in range(tokens * top_k):
        e = int(ids[r])
        hid = torch.nn.functional.gelu(rows[r].double().cpu() @ up[e].double().cpu().T)
        want[r] = hid @ down[e].double().cpu().T
    assert_close(eager, want, torch.float32, "eager layer")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static, _, _ = layer()
    router.copy_(torch.randn(tokens, experts, device="cuda"))  # a new routing
    graph.replay()
    assert_close(static, layer()[0].double().cpu(), torch.float32, "replay after a new routing")


@gpu
@pytest.mark.parametrize("kernels", ["graphed", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [100, 12], ids=["tiles", "few-rows"])
def test_offsets_out_of_range_or_order_do_not_fault(dtype, kernels, rows):
    big = 2**31 - 1
    for ends in ([-5, 1000000, 3, big], [big, big, big], [-1, -1, -1], [40, 10, 70, 5],
                 [7, 2, 11, 5]):
        a = torch.randn(rows, 64, device="cuda").to(dtype).requires_grad_()
        b = torch.randn(len(ends), 64, 128, device="cuda").to(dtype).requires_grad_()
        offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
        out = moe.grouped_mm(a, b, offs, kernels=kernels)
        grad_a, grad_b = torch.autograd.grad(out, (a, b), torch.randn_like(out))
        torch.cuda.synchronize()
        eff = effective_ends(ends, rows)
        assert_close(out, reference(a, b, eff), dtype, f"offsets {ends}")
        assert_zero_rows(out, eff[-1], f"offsets {ends}")
        assert torch.isfinite(grad_a).all() and torch.isfinite(grad_b).all()
    # The CUDA context still works.
    assert float(torch.ones(1024, device="cuda").sum()) == 1024.0
    torch.cuda.synchronize()


# --- the argument checks: no GPU needed ----------------------------------------------

def _cpu_operands():
    return torch.randn(6, 4), torch.randn(2, 4, 3), torch.tensor([2, 6], dtype=torch.int32)


@pytest.mark.parametrize("mutate, message", [
    (lambda a, b, o: (a.reshape(-1), b, o), "Expected the input of grouped_mm to be 2-D"),
    (lambda a, b, o: (a, b[0], o), "Expected the weights of grouped_mm to be 3-D"),
    (lambda a, b, o: (a.double(), b.double(), o), "in float32, bfloat16 or float16"),
    (lambda a, b, o: (a, b.bfloat16(), o),
     "Expected the input and the weights of grouped_mm in one dtype"),
    (lambda a, b, o: (a, b, o.long()), "Expected the offsets of grouped_mm to be a 1-D int32"),
    (lambda a, b, o: (a, b, o[:1]), "Expected one offset per group of grouped_mm"),
    (lambda a, b, o: (a, torch.randn(2, 5, 3), o),
     "Expected the input's in_features to match the weights' of grouped_mm"),
    (lambda a, b, o: (a, b, o), "Expected CUDA tensors for grouped_mm"),
], ids=["1d-input", "2d-weights", "float64", "mixed-dtypes", "int64-offsets", "offset-count",
        "in-features", "cpu"])
def test_arguments_are_checked_before_anything_runs(mutate, message):
    a, b, offs = mutate(*_cpu_operands())
    with pytest.raises(graphed.GraphedError, match=message):
        moe.grouped_mm(a, b, offs)


def test_unknown_kernels_are_refused():
    with pytest.raises(graphed.GraphedError, match='Expected kernels "auto"'):
        moe.grouped_mm(*_cpu_operands(), kernels="cutlass")


def test_torch_kernel_is_never_chosen_for_cpu_tensors():
    a, b, _ = _cpu_operands()
    assert not moe.grouped_mm_uses_torch(a.bfloat16(), b.bfloat16())
    assert "grouped_mm" in graphed.moe.__all__
