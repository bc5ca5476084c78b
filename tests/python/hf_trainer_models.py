"""The tiny GPT-2 and token data the HF Trainer tests train (CPU and GPU tier)."""

import torch
import transformers


def tiny_gpt2(seed=0, vocab=64, length=32, width=32, heads=2):
    """A 2-layer GPT-2 from its config, random init, no dropout."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=length, n_embd=width,
                                     n_layer=2, n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


class TokenData(torch.utils.data.Dataset):
    """Random tokens, labels = inputs; ``ignore_some`` masks half of every
    third row's labels (-100), so batches hold uneven label counts and
    num_items_in_batch normalization matters."""

    def __init__(self, count=24, length=16, seed=1, ignore_some=False, vocab=64):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (count, length), generator=generator)
        self.labels = self.ids.clone()
        if ignore_some:
            self.labels[::3, : length // 2] = -100

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}
