"""graphed.generate and graphed.Decoder on the CPU: the adapter decodes eagerly
there (no graphs), so the tokens must equal transformers' StaticCache generate
exactly; bad input is refused before any work."""

import pytest
import torch

import graphed
from generate_models import (ARCHITECTURES, HYBRID_ARCHITECTURES, SLIDING_ARCHITECTURES,
                             assert_eos_and_min_new_tokens_follow_hf, hf_static_generate,
                             left_padded_prompts, tiny_model)

pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ARCHITECTURES + SLIDING_ARCHITECTURES + HYBRID_ARCHITECTURES)
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_tokens_equal_hf_static_cache(arch, batch):
    # Sliding windows: 7 prompt positions and 10 new tokens in windows of 8,
    # left padding included (Note [Sliding windows on a full static cache]).
    model = tiny_model(arch)
    ids, mask = left_padded_prompts(batch, 7, model.config.vocab_size, "cpu")
    want = hf_static_generate(model, ids, mask, 10, max_cache_len=24)
    got = graphed.generate(model, ids, attention_mask=mask, max_new_tokens=10, max_cache_len=24)
    assert torch.equal(got, want)
    notes = model.__dict__["_graphed_decoder"].notes
    if arch in SLIDING_ARCHITECTURES:
        assert len(notes) == 1 and "sliding window of 8" in notes[0], notes
    elif arch in HYBRID_ARCHITECTURES:
        # The state-space layers, and why their steps keep transformers'
        # functions here (Note [Fused state-space decode steps]: float32 on a GPU).
        assert len(notes) == 2, notes
        assert any("2 of 4 layers" in note for note in notes), notes
        assert any("keep transformers' torch reference functions" in note and "the CPU" in note
                   for note in notes), notes
    else:
        assert notes == []


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


def _mamba2():
    import transformers

    torch.manual_seed(0)
    config = transformers.Mamba2Config(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                       state_size=16, expand=2, head_dim=16, num_heads=8,
                                       n_groups=1, chunk_size=8)
    return transformers.Mamba2ForCausalLM(config).eval()


@pytest.mark.parametrize("batch, padded", [(1, False), (3, False), (3, True)])
def test_a_state_space_model_gives_hf_tokens(batch, padded):
    # Note [Decoding a state-space model on graphs]: prompts past a scan chunk,
    # left padding included.
    model = _mamba2()
    ids, mask = left_padded_prompts(batch, 11, model.config.vocab_size, "cpu")
    if not padded:
        ids, mask = ids.clamp(min=1), None
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                              pad_token_id=0)
    got = graphed.generate(model, ids, attention_mask=mask, max_new_tokens=12)
    assert torch.equal(got, want)
    decoder = model.__dict__["_graphed_decoder"]
    assert "recurrent states" in decoder.notes[0], decoder.notes
    again = graphed.generate(model, ids[:1], attention_mask=None if mask is None else mask[:1],
                             max_new_tokens=12)  # a smaller batch, same states
    assert torch.equal(again, want[:1])


def test_mamba_v1_gives_hf_tokens_too():
    import transformers

    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                      state_size=16)
    model = transformers.MambaForCausalLM(config).eval()
    ids = torch.randint(1, 127, (2, 7))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(graphed.generate(model, ids, max_new_tokens=8), want)


def test_a_state_space_models_prefill_and_step_read_nothing_on_the_host():
    from graphed._state_space_decoding import StateSpaceModel

    model = _mamba2()
    ids = torch.randint(1, 127, (2, 6))
    adapter = StateSpaceModel(model, 2, 16)
    with torch.no_grad():
        adapter.reset()
        with _NoHostReads():
            adapter.prefill((ids, None, None))
            adapter.step((ids[:, -1:], None, None))


def test_not_a_transformers_model_is_refused():
    with pytest.raises(graphed.GraphedError, match="Hugging Face causal language model"):
        graphed.generate(torch.nn.Linear(2, 2), torch.ones(1, 2, dtype=torch.long))


def test_bad_decoder_options_name_the_limit():
    model = tiny_model("llama")
    with pytest.raises(graphed.GraphedError, match="below max_batch"):
        graphed.Decoder(model, max_batch=8, max_len=16, buckets=[1, 2])
    with pytest.raises(graphed.GraphedError, match="at least one byte"):
        graphed.Decoder(model, max_batch=2, max_len=16, memory_budget="0GiB")


class _OpCounter:
    """Counts the ATen operators that would launch a kernel on a GPU (views,
    allocations and metadata ops do not) -- a CPU proxy for the kernels of a
    decode graph (Note [Fewer kernels per token])."""

    _FREE = ("empty", "empty_like", "empty_strided", "lift_fresh", "detach", "alias")

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func._schema.name.split("::")[-1]
                if not func.is_view and name not in _OpCounter._FREE:
                    counter.ops.append(name)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.ops = []

    def __enter__(self):
        self.ops = []
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def _fixed_logits_decoder(eos, do_sample=False, vocab=32):
    logits = torch.zeros(4, 1, vocab)
    logits[:, 0, 3] = 1.0  # never an eos token below
    fixed = lambda args: logits[: args[0].shape[0]]  # noqa: E731  (a view: no operator)
    return graphed._C.Decoder(
        step=fixed, prefill=fixed, reset=lambda: None, max_batch=4, max_len=256, buckets=[],
        do_sample=do_sample, temperature=1.0, top_k=0, top_p=1.0, min_tokens_to_keep=1,
        eos_token_ids=eos, pad_token_id=0 if eos else None, check_every=1000,
        memory_budget=None, warmup=2, use_graphs=False, capture_error_mode="global",
        device=torch.device("cpu"))


@pytest.mark.parametrize("eos, most", [([], 4), ([7], 12), ([7, 8], 13)])
def test_a_greedy_decode_step_launches_few_kernels(eos, most):
    """The token selection of one decode step, counted on the CPU (ATen's
    kernels; on a GPU one fused kernel does it all): greedy without eos is
    argmax_out, the step bounded by the capacity (Note [Token ids are checked
    on the host]), index_copy_, add_; eos tokens add the min_new_tokens
    suppression and the finished-row bookkeeping. More operators here are
    more kernels in every decode graph."""
    decoder = _fixed_logits_decoder(eos)
    ids = torch.ones(4, 3, dtype=torch.long)
    counts = {}
    for new_tokens in (20, 36):
        decoder.generate(ids, None, new_tokens, 0, None)  # shapes seen once
        with _OpCounter() as counter:
            tokens, steps, _ = decoder.generate(ids, None, new_tokens, 0, None)
        assert steps == new_tokens and bool((tokens == 3).all())
        counts[new_tokens] = counter.ops
    per_step = (len(counts[36]) - len(counts[20])) / 16
    assert per_step == int(per_step), (counts[20], counts[36])
    assert per_step <= most, counts[36][len(counts[20]):][:int(per_step)]


def test_a_request_outside_its_decode_steps_launches_few_kernels():
    """Everything of a request but its decode steps -- the prefill body (state
    set-up and first token) and the host's copies -- stays small: the prefill
    graph replaces all but the prompt copy (Note [The decode loop])."""
    decoder = _fixed_logits_decoder([7])
    ids = torch.ones(4, 3, dtype=torch.long)
    decoder.generate(ids, None, 1, 0, None)
    with _OpCounter() as counter:
        decoder.generate(ids, None, 1, 0, None)
    # The prompt's id range, read once (Note [Token ids are checked on the
    # host]); prompt copy; in the prefill body: positions copy, mask fill,
    # counters zero, finished, done; the selection; the result's read and clone.
    assert len(counter.ops) <= 25, counter.ops


class _NoHostReads:
    """Fails on any operator that reads a device value on the host (what
    breaks a CUDA graph capture): .item(), bool(tensor), nonzero..."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func._schema.name.split("::")[-1]
                assert name not in ("_local_scalar_dense", "is_nonzero", "item", "nonzero",
                                    "equal", "unique", "_unique2"), f"host read: {func}"
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


# gpt-oss left out: its experts' grouped GEMM reads offsets on the host off the GPU.
@pytest.mark.parametrize("arch", ARCHITECTURES + SLIDING_ARCHITECTURES[:3] + HYBRID_ARCHITECTURES)
@pytest.mark.parametrize("padded", [False, True])
def test_the_adapters_prefill_and_step_read_nothing_on_the_host(arch, padded):
    """Note [A capturable prefill]: the HF adapter's prefill (with and without
    left padding) and decode step make no host reads, so they can be captured;
    and the prefill's logits are transformers' own."""
    from graphed.generate import _StaticCacheModel

    model = tiny_model(arch)
    ids, mask = left_padded_prompts(2, 6, model.config.vocab_size, "cpu")
    if not padded:
        mask = torch.ones_like(mask)
    positions = graphed._C.prompt_positions(mask)
    adapter = _StaticCacheModel(model, 2, 16)
    with torch.no_grad():
        adapter.reset()
        with _NoHostReads():
            logits = adapter.prefill((ids, mask if padded else None, positions))
        adapter.reset()
        want = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1:]
        assert torch.allclose(logits, want, atol=1e-5, rtol=1e-4)
        adapter.reset()
        adapter.prefill((ids, mask if padded else None, positions))
        step_mask = torch.ones(2, 16, dtype=torch.long)
        step_mask[:, :6] = mask
        with _NoHostReads():
            adapter.step((ids[:, -1:], positions[:, -1:] + 1, step_mask))


def test_one_decoder_serves_shapes_batches_and_min_new_tokens_like_hf():
    """One decoder, requests whose prefill shapes, live rows and min_new_tokens
    change from one to the next (the values the host writes only on change)."""
    model = tiny_model("llama")
    vocab = model.config.vocab_size
    free = hf_static_generate(model, *left_padded_prompts(2, 5, vocab, "cpu"), 12,
                              max_cache_len=32, eos_token_id=None)
    eos = int(free[0, 5 + 2])
    decoder = graphed.Decoder(model, max_batch=4, max_len=32, eos_token_id=eos, pad_token_id=0)
    for batch, length, min_new in [(2, 5, 0), (2, 5, 6), (4, 5, 6), (1, 7, 0), (2, 5, 0),
                                   (4, 3, 2)]:
        ids, mask = left_padded_prompts(batch, length, vocab, "cpu")
        want = hf_static_generate(model, ids, mask, 12, max_cache_len=32, eos_token_id=eos,
                                  pad_token_id=0, min_new_tokens=min_new)
        got = decoder.generate(ids, mask, max_new_tokens=12, min_new_tokens=min_new)
        assert torch.equal(got, want), (batch, length, min_new)
    assert all(r["kind"] == "decode" for r in decoder.memory_report())  # no graphs on the CPU


@pytest.mark.parametrize("compile, needle", [
    ("yes", "Expected compile=True, False or a dict"),
    ({"mode": "reduce-overhead"}, "records no CUDA graphs of its own"),
    ({"options": {"triton.cudagraphs": True}}, "records no CUDA graphs of its own"),
    ({"fullgraph": True, "cudagraphs": True}, "got cudagraphs"),
])
def test_a_compile_option_that_cannot_work_is_refused(compile, needle):
    model = tiny_model("llama")
    with pytest.raises(graphed.GraphedError, match=needle):
        graphed.generate(model, torch.ones(1, 3, dtype=torch.long), max_new_tokens=2,
                         compile=compile)
    assert "_graphed_decoder" not in model.__dict__
    with pytest.raises(graphed.GraphedError, match=needle):
        graphed.Decoder(model, max_batch=1, max_len=8, compile=compile)


def test_a_compiled_decode_step_is_traced_once_per_shape_and_gives_hf_tokens():
    # Dynamo traces the step on the CPU too; backend="eager"-like counting keeps
    # the test fast (no Inductor code generation) and proves the compiled step,
    # not the eager one, made the tokens.
    traced = []

    def counting_backend(graph_module, example_inputs):
        traced.append(len(example_inputs))
        return graph_module.forward

    model = tiny_model("llama")
    ids, mask = left_padded_prompts(2, 6, model.config.vocab_size, "cpu")
    want = hf_static_generate(model, ids, mask, 8, max_cache_len=20)
    compile = {"backend": counting_backend, "dynamic": False}
    got = graphed.generate(model, ids, attention_mask=mask, max_new_tokens=8, max_cache_len=20,
                           compile=compile)
    assert torch.equal(got, want)
    assert traced, "the decode step was not compiled"
    first = len(traced)
    again = graphed.generate(model, ids, attention_mask=mask, max_new_tokens=8, max_cache_len=20,
                             compile=compile)
    assert torch.equal(again, want) and len(traced) == first, "a repeated request recompiled"
    eager = graphed.generate(model, ids, attention_mask=mask, max_new_tokens=8, max_cache_len=20)
    assert torch.equal(eager, want)
    assert "None" in repr(model.__dict__["_graphed_decoder"].key[-1]), \
        "compile=False reused the compiled decoder"


def test_a_model_whose_forward_runs_under_autocast_decodes_its_own_tokens():
    # accelerate's mixed precision wraps forward in autocast: a Llama layer then
    # hands the cache fp32 keys (rotary) and bf16 values (Note [A static cache
    # under autocast]), which transformers' StaticLayer alone refuses.
    model = tiny_model("llama")
    forward = model.forward

    def autocast_forward(*args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return forward(*args, **kwargs)

    model.forward = autocast_forward
    ids, mask = left_padded_prompts(2, 5, model.config.vocab_size, "cpu")
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                              pad_token_id=0)
    got = graphed.generate(model, ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0)
    assert torch.equal(got, want)
