"""graphed's own device kernels under adversarial inputs (issue 29): token ids,
vocabularies, eos and pad ids, batch sizes, scores with NaN and infinities for
the decoder's fused token selection; shapes, views, values and scales for the
FP8 casts; history slots of any value for the delayed-scaling update. Every
case either runs and matches the ATen reference, or is refused with a
GraphedError before any kernel reads the bad value; after every case the
process's CUDA context must still work (Note [Token ids are checked on the
host] in src/decoder.cpp: a device-side assert would lose it for good)."""

import math

import pytest
import torch

import graphed
from graphed import _C

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

pytestmark = pytest.mark.gpu

FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


def assert_cuda_alive():
    """A device-side assert poisons the context: every later call fails."""
    torch.cuda.synchronize()
    probe = torch.arange(4, device="cuda")
    assert int((probe * 2).sum().item()) == 12


class TableModel:
    """A language model of one lookup: the next token's scores are row
    ``table[token]``. ``index_select`` asserts on the device for an id outside
    the table, as an embedding does, so any unchecked id would show."""

    def __init__(self, vocab, dtype, device, seed):
        generator = torch.Generator(device="cpu").manual_seed(seed)
        table = torch.randn(vocab, vocab, generator=generator)
        self.table = table.to(device=device, dtype=dtype)

    def step(self, args):
        return self.table.index_select(0, args[0][:, 0]).unsqueeze(1)

    def prefill(self, args):
        return self.table.index_select(0, args[0][:, -1]).unsqueeze(1)


def decoder_for(model, device, *, max_batch, eos, pad, vocab_size, use_graphs):
    return _C.Decoder(
        step=model.step, prefill=model.prefill, reset=lambda: None, max_batch=max_batch,
        max_len=48, buckets=[], do_sample=False, temperature=1.0, top_k=0, top_p=1.0,
        min_tokens_to_keep=1, eos_token_ids=eos, pad_token_id=pad, check_every=4,
        memory_budget=None, warmup=2, use_graphs=use_graphs, capture_error_mode="global",
        device=torch.device(device), prefill_graphs=0, vocab_size=vocab_size)


ids = st.integers(min_value=-3, max_value=70)


@FUZZ
@given(vocab=st.integers(1, 64), batch=st.integers(1, 5), max_batch=st.integers(1, 6),
       eos=st.lists(ids, max_size=3), pad=st.one_of(st.none(), ids),
       prompt=st.lists(ids, min_size=1, max_size=6), min_new=st.integers(0, 5),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       poison=st.sampled_from(["none", "nan", "inf", "-inf"]), seed=st.integers(0, 2**16),
       use_graphs=st.booleans())
def test_token_selection_survives_any_ids_and_scores(vocab, batch, max_batch, eos, pad, prompt,
                                                     min_new, dtype, poison, seed, use_graphs):
    if eos and pad is None:
        pad = eos[0]  # as graphed.generate and transformers do
    model = TableModel(vocab, dtype, "cuda", seed)
    if poison != "none":
        model.table[seed % vocab, (seed // 7) % vocab] = float(poison)
    reference_model = TableModel(vocab, dtype, "cpu", seed)
    reference_model.table.copy_(model.table.cpu())
    input_ids = torch.tensor([prompt] * batch, dtype=torch.long)
    outcome = None
    try:
        decoder = decoder_for(model, "cuda", max_batch=max(batch, max_batch), eos=eos, pad=pad,
                              vocab_size=vocab, use_graphs=use_graphs)
        tokens, steps, _ = decoder.generate(input_ids.cuda(), None, 12, min_new, None)
        outcome = tokens.cpu()
    except graphed.GraphedError as error:
        message = str(error)
        in_vocab = [0 <= i < vocab for i in prompt]
        assert ("prompt token ids" in message and not all(in_vocab)) or \
            "pad_token_id within the model's vocabulary" in message, message
    assert_cuda_alive()
    if outcome is None:
        return
    # The CPU decoder runs ATen's selection: the same tokens, bit for bit.
    reference = decoder_for(reference_model, "cpu", max_batch=max(batch, max_batch), eos=eos,
                            pad=pad, vocab_size=vocab, use_graphs=False)
    want, _, _ = reference.generate(input_ids, None, 12, min_new, None)
    assert torch.equal(outcome, want), (outcome, want)
    assert int(outcome.min()) >= 0 and int(outcome.max()) < vocab


def test_gpt2_eos_outside_a_small_vocabulary_generates_like_transformers():
    """GPT-2's default eos and pad (50256) with a 1000-token vocabulary:
    transformers only warns and generates; so does graphed, and the process
    keeps its CUDA context."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000,
                                     n_positions=128)
    model = transformers.GPT2LMHeadModel(config).cuda().eval()
    input_ids = torch.randint(0, 1000, (2, 8), device="cuda")
    with pytest.warns(UserWarning, match="outside the model's vocabulary of 1000 tokens"):
        out = graphed.generate(model, input_ids, max_new_tokens=10, min_new_tokens=3)
    assert_cuda_alive()
    want = model.generate(input_ids, max_new_tokens=10, min_new_tokens=3, do_sample=False,
                          cache_implementation="static")
    assert torch.equal(out, want)
    with pytest.raises(graphed.GraphedError, match=r"prompt token ids in \[0, 1000\)"):
        graphed.generate(model, torch.full((1, 4), 1000, device="cuda"), max_new_tokens=4)
    assert_cuda_alive()


shapes = st.tuples(st.integers(0, 70), st.integers(1, 70))
values = st.sampled_from(["normal", "huge", "tiny", "nan", "inf", "zeros"])


def adversarial(shape, kind, dtype, seed):
    generator = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    if kind == "huge":
        x = x * 1e30
    elif kind == "tiny":
        x = x * 1e-30
    elif kind == "zeros":
        x = torch.zeros(shape)
    elif kind in ("nan", "inf") and x.numel():
        x.view(-1)[seed % x.numel()] = float(kind)
    return x.to(device="cuda", dtype=dtype)


@FUZZ
@given(shape=shapes, kind=values, dtype=st.sampled_from([torch.float32, torch.bfloat16,
                                                         torch.float16]),
       fmt=st.sampled_from(["e4m3", "e5m2"]),
       scale=st.sampled_from([1.0, 0.0, 448.0, 1e-30, math.inf, math.nan]),
       transposed=st.booleans(), strided=st.booleans(), seed=st.integers(0, 2**16))
def test_fp8_casts_match_aten_on_any_values_shapes_and_scales(shape, kind, dtype, fmt, scale,
                                                              transposed, strided, seed):
    x = adversarial(shape, kind, dtype, seed)
    if strided and x.shape[1] > 1:
        x = x[:, ::2]  # a view: the elementwise path
    scale_tensor = torch.tensor([scale], device="cuda")
    amax = torch.zeros(1, device="cuda")
    amax_ref = torch.zeros(1, device="cuda")
    data, t = _C.fp8_cast(x, scale_tensor, fmt, True, transposed, amax, "auto")
    want, want_t = _C.fp8_cast(x, scale_tensor, fmt, True, transposed, amax_ref, "aten")
    assert_cuda_alive()
    assert torch.equal(data.view(torch.uint8), want.view(torch.uint8))
    if transposed:
        assert torch.equal(t.view(torch.uint8), want_t.view(torch.uint8))
    assert torch.equal(amax, amax_ref) or (amax.isnan().all() and amax_ref.isnan().all())


@FUZZ
@given(rows=st.integers(1, 9), history_len=st.integers(1, 8),
       slot=st.integers(-(2**40), 2**40), kind=values, margin=st.integers(0, 3),
       reduction=st.sampled_from(["max", "most_recent"]), seed=st.integers(0, 2**16))
def test_delayed_scaling_update_wraps_any_slot_and_matches_aten(rows, history_len, slot, kind,
                                                                margin, reduction, seed):
    recipe = _C.Float8Recipe(scaling="delayed", history_len=history_len, margin=margin,
                             amax_compute=reduction, grad_format="e5m2", cache_weights=True,
                             fast_accum_forward=True, fast_accum_backward=False, emulate=False)

    def table():
        generator = torch.Generator(device="cpu").manual_seed(seed)
        amax = adversarial((rows,), kind, torch.float32, seed).abs()
        history = torch.rand(rows, history_len, generator=generator).cuda()
        scale = torch.rand(rows, generator=generator).cuda() + 0.5
        return [history, amax, scale, 1 / scale, torch.full((rows,), 448.0, device="cuda"),
                torch.tensor([slot], device="cuda")]

    fused, aten = table(), table()
    _C.fp8_update_delayed_scaling(*fused, recipe, kernels="auto")
    _C.fp8_update_delayed_scaling(*aten, recipe, kernels="aten")
    assert_cuda_alive()
    for got, want in zip(fused, aten):
        assert torch.equal(got.nan_to_num(nan=-1.0), want.nan_to_num(nan=-1.0)), (got, want)
    assert 0 <= int(fused[5]) < history_len
