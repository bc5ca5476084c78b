"""graphed.generate_batch and graphed.Decoder.submit/run (continuous batching,
Note [Continuous batching on graphs]) on the CPU, where the decode steps run
eagerly: every request's tokens must equal model.generate on that request
alone, whatever the other slots do. GPU tests (graphs) are marked gpu."""

import pytest
import torch

import graphed
from generate_models import tiny_model

pytest.importorskip("transformers")


def _prompts(count, vocab, low=3, high=12, seed=3):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=generator).tolist()
    return [torch.randint(1, vocab - 1, (n,), generator=generator).tolist() for n in lengths]


def _hf_alone(model, prompt, new_tokens, max_len, static=True, **kwargs):
    """model.generate on one prompt, StaticCache of max_len positions (eager); a
    state-space model on its own cache."""
    ids = torch.tensor([prompt], device=model.device)
    cache = dict(cache_implementation="static", max_cache_len=max_len) if static else {}
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                             disable_compile=True, **cache, **kwargs)
    return out[0, len(prompt):].tolist()


def test_a_state_space_model_serves_one_request_per_row_of_its_states():
    from test_generate import _mamba2

    model = _mamba2()
    prompts = _prompts(6, model.config.vocab_size, low=3, high=13, seed=19)
    budgets = [7, 3, 10, 1, 6, 9]
    got = graphed.generate_batch(model, prompts, max_new_tokens=budgets, max_batch=2,
                                 eos_token_id=None, pad_token_id=0)
    for prompt, budget, tokens in zip(prompts, budgets, got):
        assert tokens == _hf_alone(model, prompt, budget, 0, static=False, pad_token_id=0)
    assert "recurrent states" in model.__dict__["_graphed_serving"].notes[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "granite_hybrid"])
def test_every_request_gets_the_tokens_it_gets_alone(arch):
    # 7 requests on 3 slots: later ones are prefilled while others are mid-decode,
    # budgets differ (one of a single token), prompts differ in length.
    model = tiny_model(arch)
    model.generation_config.eos_token_id = None  # granite's is 0: every request runs its budget
    prompts = _prompts(7, model.config.vocab_size)
    budgets = [9, 4, 1, 12, 6, 3, 10]
    max_len = max(len(p) + n - 1 for p, n in zip(prompts, budgets))
    got = graphed.generate_batch(model, prompts, max_new_tokens=budgets, max_batch=3,
                                 eos_token_id=None)
    for prompt, budget, tokens in zip(prompts, budgets, got):
        assert tokens == _hf_alone(model, prompt, budget, max_len, eos_token_id=None)
    stats = model.__dict__["_graphed_serving"].stats()
    assert stats["prefills"] == 7 and stats["finished"] == 7
    assert stats["live_row_steps"] == sum(budgets) - len(budgets)
    limited = graphed.generate_batch(model, prompts, max_new_tokens=budgets, max_batch=3,
                                     eos_token_id=None, prefills_per_round=1)
    assert limited == got


def test_end_of_sequence_ends_a_request_in_the_middle_and_frees_its_slot():
    model = tiny_model("llama")
    prompts = _prompts(5, model.config.vocab_size, seed=5)
    max_len = max(len(p) for p in prompts) + 15
    free = [_hf_alone(model, p, 16, max_len, eos_token_id=None) for p in prompts]
    eos = free[1][4]  # request 1 ends after 5 tokens; others where the token shows up
    got = graphed.generate_batch(model, prompts, max_new_tokens=16, max_batch=2,
                                 eos_token_id=eos, pad_token_id=0, max_len=max_len)
    for prompt, tokens in zip(prompts, got):
        want = _hf_alone(model, prompt, 16, max_len, eos_token_id=eos, pad_token_id=0)
        assert tokens == want
    assert len(got[1]) == 5 and got[1][-1] == eos


def test_streaming_gives_each_requests_tokens_in_order_with_its_index():
    model = tiny_model("llama")
    prompts = _prompts(4, model.config.vocab_size, seed=7)
    seen = {i: [] for i in range(4)}
    ended = []

    def on_token(index, tokens, finished):
        assert index not in ended
        seen[index].extend(tokens)
        if finished:
            ended.append(index)

    got = graphed.generate_batch(model, prompts, max_new_tokens=[5, 11, 3, 8], max_batch=2,
                                 on_token=on_token, chunk_steps=2)
    assert sorted(ended) == [0, 1, 2, 3]
    assert [seen[i] for i in range(4)] == got


def test_a_decoder_takes_requests_while_it_runs():
    model = tiny_model("qwen2")
    vocab = model.config.vocab_size
    prompts = _prompts(5, vocab, seed=11)
    decoder = graphed.Decoder(model, max_batch=2, max_len=32, eos_token_id=None)
    first = [decoder.submit(p, max_new_tokens=6) for p in prompts[:2]]
    later = []

    def on_token(request_id, tokens, finished):
        if finished and len(later) < 3:  # a new request each time one ends
            later.append(decoder.submit(prompts[2 + len(later)], max_new_tokens=7))

    results = decoder.run(on_token)
    ids = first + later
    assert sorted(results) == sorted(ids)
    for request_id, prompt, budget in zip(ids, prompts, [6, 6, 7, 7, 7]):
        assert results[request_id] == _hf_alone(model, prompt, budget, 32, eos_token_id=None)
    # The slot cache is the serving half's own: generate() still works next to it.
    ids0 = torch.tensor([prompts[0]])
    assert decoder.generate(ids0, max_new_tokens=6)[0, len(prompts[0]):].tolist() == \
        results[first[0]]
    assert decoder.serving_stats()["prefills"] == 5


def test_a_decoder_step_returns_requests_as_they_finish():
    model = tiny_model("llama")
    decoder = graphed.Decoder(model, max_batch=2, max_len=24, eos_token_id=None)
    a = decoder.submit(torch.tensor([5, 6, 7]), max_new_tokens=2)
    b = decoder.submit([8, 9], max_new_tokens=9)
    finished = {}
    rounds = 0
    while len(finished) < 2:
        finished.update(decoder.step())
        rounds += 1
        assert rounds < 50
    assert len(finished[a]) == 2 and len(finished[b]) == 9


def test_the_serving_decoder_is_kept_and_reused():
    model = tiny_model("llama")
    prompts = _prompts(3, model.config.vocab_size)
    first = graphed.generate_batch(model, prompts, max_new_tokens=4, max_len=32)
    serving = model.__dict__["_graphed_serving"]
    again = graphed.generate_batch(model, prompts[:2], max_new_tokens=4, max_batch=3,
                                   max_len=20)
    assert model.__dict__["_graphed_serving"] is serving
    assert again == first[:2]


def test_top_k_one_sampling_is_greedy_per_request():
    model = tiny_model("llama")
    prompts = _prompts(3, model.config.vocab_size, seed=9)
    greedy = graphed.generate_batch(model, prompts, max_new_tokens=6)
    sampled = graphed.generate_batch(model, prompts, max_new_tokens=6, do_sample=True, top_k=1,
                                     temperature=0.7)
    assert sampled == greedy


@pytest.mark.parametrize("call, needle", [
    (lambda m: graphed.generate_batch(m, [[1, 2]], max_new_tokens=2, min_new_tokens=1),
     "does not implement min_new_tokens"),
    (lambda m: graphed.generate_batch(m, torch.ones(2, 3, dtype=torch.long)),
     "Expected prompts as a list"),
    (lambda m: graphed.generate_batch(m, [[1, 2], [3]], max_new_tokens=[2]),
     "one max_new_tokens per prompt"),
    (lambda m: graphed.generate_batch(m, [[1.5, 2]]), "Expected a prompt as a list of token"),
    (lambda m: graphed.generate_batch(m, [[1, 2]], attention_mask=None),
     "does not take attention_mask"),
    (lambda m: graphed.generate_batch(m, [[1, 2]], max_new_tokens=0),
     "Expected max_new_tokens >= 1"),
    (lambda m: graphed.generate_batch(m, [[1, 500]], max_new_tokens=2),
     "Expected prompt token ids in"),
    (lambda m: graphed.generate_batch(m, [[]], max_new_tokens=2),
     "at least one token"),
    (lambda m: graphed.generate_batch(m, [[1, 2]], num_beams=2), "num_beams=2"),
])
def test_bad_requests_are_refused_with_the_fix(call, needle):
    model = tiny_model("llama")
    with pytest.raises(graphed.GraphedError, match=needle):
        call(model)


def test_a_request_longer_than_the_cache_is_refused_at_submit():
    model = tiny_model("llama")
    decoder = graphed.Decoder(model, max_batch=2, max_len=8)
    with pytest.raises(graphed.GraphedError, match="needs 9 cache positions"):
        decoder.submit([1, 2, 3, 4, 5, 6], max_new_tokens=4)


@pytest.mark.parametrize("arch", ["mistral_sliding", "gemma3"])
def test_sliding_windows_are_served_within_the_window_and_refused_past_it(arch):
    model = tiny_model(arch)  # windows of 8
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [3, 4]]
    got = graphed.generate_batch(model, prompts, max_new_tokens=[4, 3, 6], max_batch=2,
                                 max_len=8, eos_token_id=None)
    for prompt, budget, tokens in zip(prompts, [4, 3, 6], got):
        assert tokens == _hf_alone(model, prompt, budget, 8, eos_token_id=None)
    with pytest.raises(graphed.GraphedError, match=r"max_len \(9\) <= the window \(8\)"):
        graphed.generate_batch(model, [[1, 2, 3]], max_new_tokens=7, eos_token_id=None)


def test_the_decode_step_reads_nothing_on_the_host_and_masks_per_row():
    from graphed.serving import SlotCacheModel
    from test_generate import _NoHostReads

    model = tiny_model("llama")
    adapter = SlotCacheModel(model, 3, 16)
    positions = torch.tensor([[4], [9], [0]])
    mask = torch.zeros(3, 16, dtype=torch.long)
    with torch.no_grad(), _NoHostReads():
        logits = adapter.step((torch.tensor([[1], [2], [3]]), positions, mask))
    assert logits.shape[0] == 3
    assert mask.sum(1).tolist() == [5, 10, 1]
    keys = adapter.cache.layers[0].keys
    written = keys.abs().sum((1, 3)) > 0  # [rows, positions]
    assert written.nonzero().tolist() == [[0, 4], [1, 9], [2, 0]]


# --- the scheduler on a model whose next token is its position + 1 ----------------


def _counting_decoder(max_batch=3, max_len=40, vocab=64, eos=(), chunk_steps=4,
                      prefills_per_round=0):
    """_C.Decoder + RequestScheduler on logits that pick (position + 1) % vocab: a
    request with a prompt of n tokens gets n, n + 1, ... -- any slip of a row's
    position or token column shows."""
    def one_hot(index):
        return torch.nn.functional.one_hot(index % vocab, vocab).float()

    step = lambda args: one_hot(args[1] + 1)  # noqa: E731  [rows, 1, vocab]
    core = graphed._C.Decoder(
        step=step, prefill=lambda args: None, reset=lambda: None, max_batch=max_batch,
        max_len=max_len, buckets=[], do_sample=False, temperature=1.0, top_k=0, top_p=1.0,
        min_tokens_to_keep=1, eos_token_ids=[], pad_token_id=None, check_every=8,
        memory_budget=None, warmup=2, use_graphs=False, capture_error_mode="global",
        device=torch.device("cpu"), prefill_graphs=0, vocab_size=vocab)
    prefills = []

    def prefill(args):
        ids, slot = args
        prefills.append((slot, ids.shape[1]))
        return one_hot(torch.tensor([[ids.shape[1]]]))

    scheduler = graphed._C.RequestScheduler(core, prefill, chunk_steps=chunk_steps,
                                            eos_token_ids=list(eos),
                                            prefills_per_round=prefills_per_round)
    return scheduler, prefills


@pytest.mark.parametrize("prefills_per_round", [0, 1])
def test_the_scheduler_keeps_each_slots_positions_and_budgets(prefills_per_round):
    scheduler, prefills = _counting_decoder(prefills_per_round=prefills_per_round)
    lengths, budgets = [3, 7, 2, 5, 9, 4], [5, 1, 8, 3, 6, 2]
    ids = [scheduler.submit(torch.arange(n), b) for n, b in zip(lengths, budgets)]
    finished = {i: (tokens, eos) for i, tokens, eos in scheduler.run()}
    for request_id, n, b in zip(ids, lengths, budgets):
        assert finished[request_id] == (list(range(n, n + b)), False)
    assert scheduler.idle and len(prefills) == 6
    if prefills_per_round == 0:
        assert [slot for slot, _ in prefills[:3]] == [0, 1, 2]  # lowest free slot first
    stats = scheduler.stats()
    assert stats["live_row_steps"] == sum(budgets) - len(budgets)
    if prefills_per_round == 1:
        assert stats["chunks"] >= 6  # one prefill per round, a chunk after each


def test_the_scheduler_ends_a_request_on_eos_and_refills_its_slot():
    scheduler, prefills = _counting_decoder(max_batch=1, eos=(12,))
    a = scheduler.submit(torch.arange(9), 10)  # 9, 10, 11, 12: ends on eos
    b = scheduler.submit(torch.arange(2), 3)   # waits for the only slot
    finished = {i: (tokens, eos) for i, tokens, eos in scheduler.run()}
    assert finished[a] == ([9, 10, 11, 12], True)
    assert finished[b] == ([2, 3, 4], False)
    assert prefills == [(0, 9), (0, 2)]


def test_free_rows_never_leave_the_cache():
    # One long request in slot 1 keeps the bucket at 2 rows while slot 0 is free
    # for many chunks: the free row's position must wrap to 0, not pass max_len.
    scheduler, _ = _counting_decoder(max_batch=2, max_len=12, chunk_steps=3)
    scheduler.submit(torch.arange(2), 1)
    long = scheduler.submit(torch.arange(1), 12)
    finished = {i: tokens for i, tokens, _ in scheduler.run()}
    assert finished[long] == list(range(1, 13))


def test_scheduler_options_are_checked():
    with pytest.raises(graphed.GraphedError, match="chunk_steps >= 1"):
        _counting_decoder(chunk_steps=0)
    core = graphed._C.Decoder(
        step=lambda a: None, prefill=lambda a: None, reset=lambda: None, max_batch=1,
        max_len=8, buckets=[], do_sample=False, temperature=1.0, top_k=0, top_p=1.0,
        min_tokens_to_keep=1, eos_token_ids=[3], pad_token_id=0, check_every=8,
        memory_budget=None, warmup=2, use_graphs=False, capture_error_mode="global",
        device=torch.device("cpu"))
    with pytest.raises(graphed.GraphedError, match="built without eos_token_ids"):
        graphed._C.RequestScheduler(core, lambda a: None)
    scheduler, _ = _counting_decoder()
    with pytest.raises(graphed.GraphedError, match="1-D tensor of token ids"):
        scheduler.submit(torch.ones(2, 2, dtype=torch.long), 2)


# --- GPU: the same on captured graphs ---------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_graphs_give_every_request_its_tokens_alone(arch):
    model = tiny_model(arch, device="cuda")
    prompts = _prompts(12, model.config.vocab_size, low=3, high=30)
    budgets = [(7 * i) % 23 + 1 for i in range(12)]
    max_len = max(len(p) + n - 1 for p, n in zip(prompts, budgets))
    got = graphed.generate_batch(model, prompts, max_new_tokens=budgets, max_batch=4,
                                 eos_token_id=None, max_len=max_len)
    for prompt, budget, tokens in zip(prompts, budgets, got):
        assert tokens == _hf_alone(model, prompt, budget, max_len, eos_token_id=None)
    serving = model.__dict__["_graphed_serving"]
    assert all(r["captured"] for r in serving.memory_report() if r["kind"] == "decode")
    # The served steps run graphed's RMSNorm as generate's do, checked to the bit.
    assert any("run graphed's rms_norm" in note for note in serving.notes), serving.notes
    assert serving._adapter.fused.verdicts == {"rms_norm": True, "apply_rotary_pos_emb": True}, \
        serving.notes


@pytest.mark.gpu
def test_graphs_end_requests_on_eos_and_refill_while_others_decode():
    model = tiny_model("llama", device="cuda")
    prompts = _prompts(9, model.config.vocab_size, seed=13)
    max_len = max(len(p) for p in prompts) + 23
    free = [_hf_alone(model, p, 24, max_len, eos_token_id=None) for p in prompts]
    eos = free[2][6]
    got = graphed.generate_batch(model, prompts, max_new_tokens=24, max_batch=4,
                                 eos_token_id=eos, pad_token_id=0, max_len=max_len)
    for prompt, tokens in zip(prompts, got):
        assert tokens == _hf_alone(model, prompt, 24, max_len, eos_token_id=eos, pad_token_id=0)


@pytest.mark.gpu
def test_graphs_serve_a_bf16_mixture_of_experts():
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
        num_experts_per_tok=2, max_position_embeddings=512)
    model = transformers.Qwen3MoeForCausalLM(config).to("cuda", torch.bfloat16).eval()
    prompts = _prompts(6, 128, seed=17)
    budgets = [5, 9, 3, 12, 7, 4]
    # The decoder's attention kernels (Note [Served attention without cuDNN's plans]).
    from graphed._attention_backends import attention_without_cudnn

    with attention_without_cudnn():
        want = [_hf_alone(model, p, n, 40, eos_token_id=None) for p, n in zip(prompts, budgets)]
    # One slot: every request at batch 1, as alone (bf16 routing can flip between GEMM
    # shapes, so two slots are held to most tokens, not all).
    alone = graphed.generate_batch(model, prompts, max_new_tokens=budgets, max_batch=1,
                                   eos_token_id=None, max_len=40)
    assert alone == want
    serving = model.__dict__["_graphed_serving"]
    assert set(serving._adapter.fused.verdicts.values()) == {True}, serving.notes
    assert any("not cuDNN's" in note for note in serving.notes), serving.notes
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after every prefill and step
    paired = graphed.generate_batch(model, prompts, max_new_tokens=budgets, max_batch=2,
                                    eos_token_id=None, max_len=40)
    equal = sum(a == b for x, y in zip(paired, want) for a, b in zip(x, y))
    assert [len(t) for t in paired] == budgets and equal >= 0.8 * sum(budgets)


@pytest.mark.gpu
def test_graphs_serve_a_state_space_model_and_a_hybrid():
    from test_generate import _mamba2

    mamba = _mamba2().cuda()
    prompts = _prompts(7, mamba.config.vocab_size, low=3, high=20, seed=23)
    budgets = [9, 2, 14, 5, 1, 11, 6]
    got = graphed.generate_batch(mamba, prompts, max_new_tokens=budgets, max_batch=3,
                                 eos_token_id=None, pad_token_id=0)
    for prompt, budget, tokens in zip(prompts, budgets, got):
        assert tokens == _hf_alone(mamba, prompt, budget, 0, static=False, pad_token_id=0)
    hybrid = tiny_model("granite_hybrid", device="cuda")
    hybrid.generation_config.eos_token_id = None
    max_len = max(len(p) + n - 1 for p, n in zip(prompts, budgets))
    got = graphed.generate_batch(hybrid, prompts, max_new_tokens=budgets, max_batch=3,
                                 eos_token_id=None, max_len=max_len)
    for prompt, budget, tokens in zip(prompts, budgets, got):
        assert tokens == _hf_alone(hybrid, prompt, budget, max_len, eos_token_id=None)
    # Both serve on graphed's fused state-space steps and RMSNorms, as generate does.
    for model in (mamba, hybrid):
        serving = model.__dict__["_graphed_serving"]
        assert any("fused selective state update" in n for n in serving.notes), serving.notes
        assert set(serving._adapter.fused.verdicts.values()) == {True}, serving.notes


@pytest.mark.gpu
def test_a_gpu_decoder_takes_requests_while_it_runs_and_streams_them():
    model = tiny_model("llama", device="cuda")
    prompts = _prompts(6, model.config.vocab_size, seed=29)
    decoder = graphed.Decoder(model, max_batch=2, max_len=40, eos_token_id=None)
    ids = [decoder.submit(p, max_new_tokens=9) for p in prompts[:2]]
    streamed = {}

    def on_token(request_id, tokens, finished):
        streamed.setdefault(request_id, []).extend(tokens)
        if finished and len(ids) < len(prompts):
            ids.append(decoder.submit(prompts[len(ids)], max_new_tokens=9))

    results = decoder.run(on_token)
    assert sorted(results) == sorted(ids) and len(ids) == 6
    for request_id, prompt in zip(ids, prompts):
        want = _hf_alone(model, prompt, 9, 40, eos_token_id=None)
        assert results[request_id] == want and streamed[request_id] == want
