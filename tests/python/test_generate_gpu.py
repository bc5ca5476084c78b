"""graphed.generate and graphed.Decoder on a GPU: decode steps replay captured
graphs. Greedy tokens equal transformers' StaticCache generate (eager) exactly
at batch sizes that are buckets; sampling follows the distribution; capture is
fast and its memory reported. The lead runs: pytest -q tests/python/test_generate_gpu.py"""

import time

import pytest
import torch

import graphed
from generate_models import (ARCHITECTURES, HYBRID_ARCHITECTURES, SLIDING_ARCHITECTURES,
                             assert_eos_and_min_new_tokens_follow_hf, hf_static_generate,
                             left_padded_prompts, tiny_model)

# fp32 gpt-oss would run transformers' experts GEMM with host-read offsets;
# its bf16 form is tested on its own below.
SLIDING_FP32 = tuple(a for a in SLIDING_ARCHITECTURES if a != "gpt_oss")

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ARCHITECTURES + SLIDING_FP32)
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_tokens_equal_hf_static_cache(arch, batch):
    # Sliding windows (of 8, past which 49 positions go): Note [Sliding
    # windows on a full static cache]; one decode graph per bucket all the same.
    model = tiny_model(arch, "cuda")
    ids, mask = left_padded_prompts(batch, 9, model.config.vocab_size, "cuda")
    want = hf_static_generate(model, ids, mask, 40, max_cache_len=64)
    got = graphed.generate(model, ids, attention_mask=mask, max_new_tokens=40, max_cache_len=64)
    assert torch.equal(got, want)
    decoder = model.__dict__["_graphed_decoder"]
    report = {r["batch"]: r for r in decoder.memory_report() if r["kind"] == "decode"}
    assert report[batch]["captured"] and report[batch]["replays"] == 39
    notes = decoder.notes
    assert any("sliding window" in note for note in notes) == (arch in SLIDING_FP32), notes
    # Note [RMSNorm in every decode step]: every RMSNorm model (GPT-2 has
    # LayerNorms), checked to the bit on its first call (no "differed").
    assert any("run graphed's rms_norm" in note for note in notes) == (arch != "gpt2"), notes
    # Note [Rotary embedding in one kernel]: every model here but GPT-2 (learned positions).
    assert any("rotary_embedding" in note for note in notes) == (arch != "gpt2"), notes
    assert not any("differed" in note for note in notes), notes
    fused = decoder._adapter[0].fused
    assert (fused is not None and set(fused.verdicts.values()) == {True}) == (arch != "gpt2")


@pytest.mark.parametrize("arch", ("gpt_oss",) + HYBRID_ARCHITECTURES)
def test_bf16_experts_models_with_sliding_or_state_space_layers_decode_with_hf_tokens(arch):
    # gpt-oss: sliding and full layers alternate, eager attention (Note [An
    # eager-attention mask a graph can hold]); granite-moe-hybrid: Mamba2 and
    # attention layers (Note [Decoding a state-space model on graphs]).
    model = tiny_model(arch, "cuda").to(torch.bfloat16)
    ids, mask = left_padded_prompts(2, 9, model.config.vocab_size, "cuda")
    want = hf_static_generate(model, ids, mask, 24, max_cache_len=40)
    got = graphed.generate(model, ids, attention_mask=mask, max_new_tokens=24, max_cache_len=40)
    assert torch.equal(got, want)
    # Note [RMSNorm in every decode step]: in bfloat16 too, checked to the bit.
    notes = model.__dict__["_graphed_decoder"].notes
    assert any("run graphed's rms_norm" in note and "bfloat16" in note for note in notes), notes
    assert not any("differed" in note for note in notes), notes


def test_fp32_experts_decode_on_graphed_grouped_gemm_and_say_so():
    model = tiny_model("gpt_oss", "cuda")  # fp32 experts: host-read offsets in transformers
    ids, mask = left_padded_prompts(2, 9, model.config.vocab_size, "cuda")
    got = graphed.generate(model, ids, attention_mask=mask, max_new_tokens=16, max_cache_len=32)
    assert got.shape == (2, 25)
    decoder = model.__dict__["_graphed_decoder"]
    assert any("graphed_grouped_mm" in note for note in decoder.notes), decoder.notes
    report = {r["batch"]: r for r in decoder.memory_report() if r["kind"] == "decode"}
    assert report[2]["captured"] and report[2]["replays"] == 15


@pytest.mark.parametrize("batch, padded", [(1, False), (8, False), (8, True)])
def test_a_state_space_model_decodes_on_graphs_with_hf_tokens(batch, padded):
    # Note [Decoding a state-space model on graphs]: Mamba2's torch path.
    import transformers

    torch.manual_seed(0)
    config = transformers.Mamba2Config(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                       state_size=16, expand=2, head_dim=16, num_heads=8,
                                       n_groups=1, chunk_size=8)
    model = transformers.Mamba2ForCausalLM(config).cuda().eval()
    ids, mask = left_padded_prompts(batch, 11, config.vocab_size, "cuda")
    if not padded:
        ids, mask = ids.clamp(min=1), None
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                              pad_token_id=0)
    # pad_token_id as HF was given it: rows that reach eos (2) are padded with it.
    got = graphed.generate(model, ids, attention_mask=mask, max_new_tokens=24, pad_token_id=0)
    assert torch.equal(got, want)
    decoder = model.__dict__["_graphed_decoder"]
    report = {r["batch"]: r for r in decoder.memory_report() if r["kind"] == "decode"}
    assert report[batch]["captured"] and report[batch]["replays"] == 23


def test_eos_and_min_new_tokens_follow_hf():
    model = tiny_model("llama", "cuda")
    ids, mask = left_padded_prompts(8, 6, model.config.vocab_size, "cuda")
    assert_eos_and_min_new_tokens_follow_hf(model, ids, mask, 30, 40, eos_after=3,
                                            min_new_tokens=(0, 10))

def test_one_decoder_serves_batches_and_prompt_lengths():
    model = tiny_model("llama", "cuda")
    decoder = graphed.Decoder(model, max_batch=8, max_len=64)
    assert all(r["captured"] for r in decoder.memory_report())
    for batch, length in [(1, 5), (8, 11), (1, 20), (8, 3)]:
        ids, mask = left_padded_prompts(batch, length, model.config.vocab_size, "cuda", seed=length)
        want = hf_static_generate(model, ids, mask, 24, max_cache_len=64)
        assert torch.equal(decoder.generate(ids, mask, max_new_tokens=24), want), (batch, length)
    # A batch between buckets runs padded to the next bucket: its rows decode as
    # they do alone (first tokens; later ones may differ in the last bits).
    ids, mask = left_padded_prompts(3, 7, model.config.vocab_size, "cuda")
    got = decoder.generate(ids, mask, max_new_tokens=12)
    want = hf_static_generate(model, ids, mask, 12, max_cache_len=64)
    assert torch.equal(got[:, :7 + 4], want[:, :7 + 4])


@pytest.mark.exclusive
def test_capturing_every_bucket_is_fast_and_reports_memory():
    model = tiny_model("llama", "cuda")
    # The process's one-time costs (the CUDA context, cuBLAS handles, lazily loaded
    # kernel modules of the model and of sampling) are paid once by a throwaway
    # one-bucket decoder: they are not what capturing six buckets costs.
    graphed.Decoder(model, max_batch=1, max_len=160).generate(
        torch.ones(1, 4, dtype=torch.long, device="cuda"), max_new_tokens=2)
    torch.cuda.synchronize()
    started = time.perf_counter()
    decoder = graphed.Decoder(model, max_batch=32, max_len=160, capture=False)
    decoder.capture()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    report = decoder.memory_report()
    assert [(r["kind"], r["batch"]) for r in report] == [("decode", b) for b in (1, 2, 4, 8, 16, 32)]
    assert all(r["captured"] and r["kernels"] > 0 and r["graph_bytes"] >= 0 for r in report)
    assert report[-1]["graph_bytes"] > 0  # the largest, captured first, creates the pool
    assert elapsed < 1.0, report


def test_memory_budget_keeps_the_bucket_in_use():
    model = tiny_model("llama", "cuda")
    decoder = graphed.Decoder(model, max_batch=4, max_len=32, memory_budget=1, capture=False)
    for batch in (1, 4, 2):
        decoder.generate(torch.ones(batch, 3, dtype=torch.long, device="cuda"), max_new_tokens=4)
    captured = [r["batch"] for r in decoder.memory_report()
                if r["captured"] and r["kind"] == "decode"]
    assert captured == [2]
    assert sum(r["evictions"] for r in decoder.memory_report()) >= 1


def _sample_counts(draw, vocab, rounds):
    counts = torch.zeros(vocab, dtype=torch.float64)
    for _ in range(rounds):
        tokens = draw()
        counts += torch.bincount(tokens.reshape(-1).cpu(), minlength=vocab).double()
    return counts / counts.sum()


def test_sampling_in_graphs_follows_eager_sampling_statistics():
    """Constant logits through the real decode graph (temperature, top-k, top-p)
    against torch.multinomial on HF's warped distribution."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    vocab = 16
    torch.manual_seed(0)
    logits = torch.randn(vocab, device="cuda") * 2
    step = lambda args: logits.expand(args[0].shape[0], vocab).clone()  # noqa: E731
    prefill = lambda args: logits.expand(args[0].shape[0], vocab).clone()  # noqa: E731
    core = graphed._C.Decoder(step=step, prefill=prefill, reset=lambda: None, max_batch=64,
                              max_len=130, buckets=[], do_sample=True, temperature=0.7, top_k=8,
                              top_p=0.9, min_tokens_to_keep=1, eos_token_ids=[],
                              pad_token_id=None, check_every=8, memory_budget=None, warmup=2,
                              use_graphs=True, capture_error_mode="global",
                              device=torch.device("cuda"))
    ids = torch.zeros(64, 1, dtype=torch.long, device="cuda")
    torch.manual_seed(1)
    ours = _sample_counts(lambda: core.generate(ids, None, 128, 0, None)[0], vocab, 4)
    scores = logits.expand(64, vocab).clone()
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(8), TopPLogitsWarper(0.9)):
        scores = warper(None, scores)
    probs = torch.softmax(scores, -1)
    eager = _sample_counts(lambda: torch.multinomial(probs, 128, replacement=True), vocab, 4)
    expected = probs[0].double().cpu()
    # 32768 draws each: total variation distance to the distribution well below 3%.
    assert 0.5 * (ours - expected).abs().sum() < 0.03, (ours, expected)
    assert 0.5 * (eager - expected).abs().sum() < 0.03
    assert bool((ours[expected == 0] == 0).all()), "a filtered token was sampled"
    # Each replay draws anew: successive columns differ.
    tokens = core.generate(ids, None, 64, 0, None)[0]
    assert not torch.equal(tokens[:, 10], tokens[:, 11])
    # A seed makes a request reproducible.
    torch.manual_seed(5)
    first = core.generate(ids, None, 64, 0, None)[0]
    torch.manual_seed(5)
    assert torch.equal(core.generate(ids, None, 64, 0, None)[0], first)


def test_sampling_generate_runs_and_stays_in_top_k():
    model = tiny_model("gpt2", "cuda")
    ids, _ = left_padded_prompts(8, 5, model.config.vocab_size, "cuda")
    torch.manual_seed(0)
    out = graphed.generate(model, ids, max_new_tokens=20, do_sample=True, top_k=1)
    assert torch.equal(out, graphed.generate(model, ids, max_new_tokens=20))


def test_batch_above_the_largest_bucket_is_refused_before_capture():
    model = tiny_model("llama", "cuda")
    decoder = graphed.Decoder(model, max_batch=4, max_len=32, capture=False)
    with pytest.raises(graphed.GraphedError, match="max_batch >= 5"):
        decoder.generate(torch.ones(5, 3, dtype=torch.long, device="cuda"), max_new_tokens=4)
    assert not any(r["captured"] for r in decoder.memory_report())


def _prefill_rows(decoder):
    return [r for r in decoder.memory_report() if r["kind"] == "prefill"]


@pytest.mark.parametrize("arch", ARCHITECTURES + SLIDING_FP32)
@pytest.mark.parametrize("batch, padded", [(1, False), (8, True), (8, False)])
def test_greedy_tokens_equal_hf_static_with_the_prefill_graph(arch, batch, padded):
    """The first `warmup` requests of a shape prefill eagerly, the next one
    captures the prefill and later ones replay it: every request's tokens are
    HF's StaticCache tokens (with and without left padding, which take
    different attention paths: Note [A capturable prefill])."""
    model = tiny_model(arch, "cuda")
    ids, mask = left_padded_prompts(batch, 9, model.config.vocab_size, "cuda")
    if not padded:
        mask = torch.ones_like(mask)
        ids = ids.clamp(min=1)
    want = hf_static_generate(model, ids, mask, 40, max_cache_len=64)
    decoder = graphed.Decoder(model, max_batch=8, max_len=64, warmup=2)
    for request in range(1, 5):
        got = decoder.generate(ids, mask, max_new_tokens=40)
        assert torch.equal(got, want), request
        rows = _prefill_rows(decoder)
        if request <= 2:
            assert rows == [], request
        else:
            assert len(rows) == 1
            row = rows[0]
            assert (row["batch"], row["prompt_len"], row["padded"]) == (batch, 9, padded)
            assert row["captured"] and row["kernels"] > 0 and row["graph_bytes"] >= 0
            assert row["replays"] == request - 2 and row["capture_ms"] > 0


def test_prefill_graph_reads_new_prompts_and_min_new_tokens():
    """A captured prefill reads each request's prompt from its static buffers,
    and the eos thresholds the host rewrites only when min_new_tokens changes."""
    model = tiny_model("llama", "cuda")
    vocab = model.config.vocab_size
    decoder = graphed.Decoder(model, max_batch=8, max_len=64, warmup=1, eos_token_id=5,
                              pad_token_id=0)
    for seed, min_new in [(1, 0), (2, 0), (3, 8), (4, 8), (5, 0), (6, 20)]:
        ids, mask = left_padded_prompts(8, 6, vocab, "cuda", seed=seed)
        want = hf_static_generate(model, ids, mask, 30, max_cache_len=64, eos_token_id=5,
                                  pad_token_id=0, min_new_tokens=min_new)
        assert torch.equal(decoder.generate(ids, mask, max_new_tokens=30,
                                            min_new_tokens=min_new), want), seed
    assert _prefill_rows(decoder)[0]["replays"] == 5


def test_prefill_graphs_are_bounded_and_count_in_the_memory_report():
    model = tiny_model("llama", "cuda")
    decoder = graphed.Decoder(model, max_batch=2, max_len=64, warmup=1, prefill_graphs=2)
    for length in (4, 5, 6):
        for _ in range(2):
            ids = torch.randint(1, 100, (2, length), device="cuda")
            want = hf_static_generate(model, ids, torch.ones_like(ids), 8, max_cache_len=64)
            assert torch.equal(decoder.generate(ids, max_new_tokens=8), want), length
    rows = {r["prompt_len"]: r for r in _prefill_rows(decoder)}
    assert sorted(rows) == [4, 5, 6]
    assert not rows[4]["captured"] and rows[4]["evictions"] == 1
    assert rows[5]["captured"] and rows[6]["captured"]
    assert decoder.pool_bytes() >= sum(r["graph_bytes"] for r in rows.values() if r["captured"])


def test_prefill_graphs_off_keeps_prefills_eager():
    model = tiny_model("gpt2", "cuda")
    decoder = graphed.Decoder(model, max_batch=1, max_len=32, warmup=1, prefill_graphs=0)
    ids = torch.randint(1, 100, (1, 5), device="cuda")
    for _ in range(3):
        decoder.generate(ids, max_new_tokens=4)
    assert _prefill_rows(decoder) == []


def test_a_compiled_decode_step_is_captured_with_fewer_kernels_and_replays_exactly():
    # Note [A compiled decode step]: the graph must replay what the compiled
    # step computes eagerly, token for token, and hold fewer kernels than the
    # eager step's graph.
    model = tiny_model("llama", "cuda")
    ids, mask = left_padded_prompts(2, 7, model.config.vocab_size, "cuda")
    compiled = graphed.Decoder(model, max_batch=2, max_len=48, compile=True)
    compiled_eagerly = graphed.Decoder(model, max_batch=2, max_len=48, compile=True,
                                       use_graphs=False)
    eager = graphed.Decoder(model, max_batch=2, max_len=48)
    got = compiled.generate(ids, mask, max_new_tokens=30)
    assert torch.equal(got, compiled_eagerly.generate(ids, mask, max_new_tokens=30))
    want = hf_static_generate(model, ids, mask, 30, max_cache_len=48)
    assert torch.equal(got[:, :8], want[:, :8]), "the first tokens come from the same prefill"

    def decode_rows(decoder):
        return {r["batch"]: r for r in decoder.memory_report() if r["kind"] == "decode"}

    fused, unfused = decode_rows(compiled)[2], decode_rows(eager)[2]
    assert fused["kernels"] < 0.7 * unfused["kernels"], (fused["kernels"], unfused["kernels"])
    assert 0 < fused["warmup_ms"] < fused["capture_ms"]
