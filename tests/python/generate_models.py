"""Small Hugging Face causal LMs, random init from configs, for the generate tests."""

import torch

ARCHITECTURES = ("llama", "gpt2", "qwen2")

#: Models whose attention layers (some or all) see a sliding window of 8
#: positions: Note [Sliding windows on a full static cache].
SLIDING_ARCHITECTURES = ("mistral_sliding", "qwen2_sliding", "gemma3", "gpt_oss")

#: Models whose layers mix Mamba2 (state-space) and attention: Note [Decoding a
#: state-space model on graphs].
HYBRID_ARCHITECTURES = ("granite_hybrid",)


def tiny_model(arch, device="cpu", vocab=128, layers=2):
    """A 2-layer model of `arch` with GQA where the architecture has it, in eval mode."""
    import transformers

    torch.manual_seed(0)
    if arch == "llama":
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        model = transformers.LlamaForCausalLM(config)
    elif arch == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=layers, n_head=4,
                                         n_positions=512, bos_token_id=vocab - 1,
                                         eos_token_id=vocab - 1)
        model = transformers.GPT2LMHeadModel(config)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        model = transformers.Qwen2ForCausalLM(config)
    elif arch == "mistral_sliding":
        config = transformers.MistralConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
            max_position_embeddings=512)
        model = transformers.MistralForCausalLM(config)
    elif arch == "qwen2_sliding":
        config = transformers.Qwen2Config(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
            sliding_window=8, max_window_layers=0, max_position_embeddings=512)
        model = transformers.Qwen2ForCausalLM(config)
    elif arch == "gemma3":
        # Local (sliding) and global layers alternate, as in Gemma 3.
        config = transformers.Gemma3TextConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2 * layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * layers,
            max_position_embeddings=512)
        model = transformers.Gemma3ForCausalLM(config)
    elif arch == "gpt_oss":
        # Sliding and full layers alternate; attention sinks need eager attention.
        config = transformers.GptOssConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=8, max_position_embeddings=512,
            attn_implementation="eager")
        model = transformers.GptOssForCausalLM(config)
    elif arch == "granite_hybrid":
        config = transformers.GraniteMoeHybridConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, shared_intermediate_size=128,
            num_hidden_layers=2 * layers, num_attention_heads=4, num_key_value_heads=2,
            num_local_experts=4, num_experts_per_tok=2,
            layer_types=["mamba", "attention"] * layers, mamba_n_heads=8, mamba_d_head=16,
            mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=8,
            max_position_embeddings=512, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = transformers.GraniteMoeHybridForCausalLM(config)
    else:
        raise ValueError(arch)
    return model.to(device).eval()


def left_padded_prompts(batch, length, vocab, device, pad_token_id=0, seed=1):
    """Random prompts; every second row is left-padded by a few tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab - 1, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(1, batch, 2):
        pad = 1 + row % 3
        ids[row, :pad] = pad_token_id
        mask[row, :pad] = 0
    return ids.to(device), mask.to(device)


def hf_static_generate(model, ids, mask, max_new_tokens, max_cache_len, **kwargs):
    """model.generate on transformers' StaticCache, eager (auto-compile off)."""
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                              cache_implementation="static", max_cache_len=max_cache_len,
                              disable_compile=True, **kwargs)


def assert_eos_and_min_new_tokens_follow_hf(model, ids, mask, max_new_tokens, max_cache_len,
                                            eos_after, min_new_tokens):
    """The token row 0 generates `eos_after` tokens in becomes the eos token;
    graphed.generate must then stop rows where model.generate stops them, for
    each value of min_new_tokens."""
    import graphed

    prompt_len = ids.shape[1]
    free = hf_static_generate(model, ids, mask, max_new_tokens, max_cache_len=max_cache_len,
                              eos_token_id=None)
    eos = int(free[0, prompt_len + eos_after])
    for min_new in min_new_tokens:
        want = hf_static_generate(model, ids, mask, max_new_tokens, max_cache_len=max_cache_len,
                                  eos_token_id=eos, pad_token_id=0, min_new_tokens=min_new)
        got = graphed.generate(model, ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                               max_cache_len=max_cache_len, eos_token_id=eos, pad_token_id=0,
                               min_new_tokens=min_new)
        assert torch.equal(got, want), min_new
