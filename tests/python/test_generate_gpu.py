"""graphed.generate and graphed.Decoder on a GPU: decode steps replay captured
graphs. Greedy tokens equal transformers' StaticCache generate (eager) exactly
at batch sizes that are buckets; sampling follows the distribution; capture is
fast and its memory reported. The lead runs: pytest -q tests/python/test_generate_gpu.py"""

import time

import pytest
import torch

import graphed
from generate_models import (ARCHITECTURES, assert_eos_and_min_new_tokens_follow_hf,
                             hf_static_generate, left_padded_prompts, tiny_model)

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_tokens_equal_hf_static_cache(arch, batch):
    model = tiny_model(arch, "cuda")
    ids, mask = left_padded_prompts(batch, 9, model.config.vocab_size, "cuda")
    want = hf_static_generate(model, ids, mask, 40, max_cache_len=64)
    got = graphed.generate(model, ids, attention_mask=mask, max_new_tokens=40, max_cache_len=64)
    assert torch.equal(got, want)
    decoder = model.__dict__["_graphed_decoder"]
    report = {r["batch"]: r for r in decoder.memory_report()}
    assert report[batch]["captured"] and report[batch]["replays"] == 39


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


def test_capturing_every_bucket_is_fast_and_reports_memory():
    model = tiny_model("llama", "cuda")
    started = time.perf_counter()
    decoder = graphed.Decoder(model, max_batch=32, max_len=160, capture=False)
    decoder.capture()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    report = decoder.memory_report()
    assert [r["batch"] for r in report] == [1, 2, 4, 8, 16, 32]
    assert all(r["captured"] and r["kernels"] > 0 and r["graph_bytes"] >= 0 for r in report)
    assert report[-1]["graph_bytes"] > 0  # the largest, captured first, creates the pool
    assert elapsed < 1.0, report


def test_memory_budget_keeps_the_bucket_in_use():
    model = tiny_model("llama", "cuda")
    decoder = graphed.Decoder(model, max_batch=4, max_len=32, memory_budget=1, capture=False)
    for batch in (1, 4, 2):
        decoder.generate(torch.ones(batch, 3, dtype=torch.long, device="cuda"), max_new_tokens=4)
    captured = [r["batch"] for r in decoder.memory_report() if r["captured"]]
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
