"""Train a Hugging Face GPT-2 with PyTorch Lightning, with and without
graphed's CUDAGraphs callback, and print the time per step of each.

    python examples/lightning_gpt.py [--steps 100]

GPT-2 with 6 layers of width 384 (from its config: random weights), random
8x128 token batches, fused AdamW. The callback captures each whole training
step (forward, backward, optimizer) as one CUDA graph; what it cannot capture
runs as Lightning would, with the reason in ``callback.report``."""

import argparse
import time

import torch
import lightning.pytorch as pl
from transformers import GPT2Config, GPT2LMHeadModel

from graphed.integrations.lightning import CUDAGraphs


class LitGPT(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        config = GPT2Config(n_layer=6, n_embd=384, n_head=6, vocab_size=8192, n_positions=128,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                            bos_token_id=0, eos_token_id=0)
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True)  # logged after every replay, no sync
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count):
        self.ids = torch.randint(0, 8192, (count, 128), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepTimer(pl.Callback):
    """Wall time of the steps after the first ``skip`` (warm-up and capture)."""

    def __init__(self, skip=10):
        self.skip, self.start, self.end, self.steps = skip, None, None, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.skip:
            torch.cuda.synchronize()
            self.start = time.perf_counter()
        elif trainer.global_step > self.skip:
            self.steps = trainer.global_step - self.skip

    def on_train_end(self, trainer, pl_module):
        torch.cuda.synchronize()
        self.end = time.perf_counter()

    @property
    def ms_per_step(self):
        return (self.end - self.start) * 1e3 / self.steps


def fit(steps, graphs):
    timer = StepTimer()
    callbacks = [timer] + ([graphs] if graphs else [])
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_model_summary=False,
                         enable_progress_bar=False, callbacks=callbacks)
    data = torch.utils.data.DataLoader(Tokens(steps * 8), batch_size=8, drop_last=True)
    trainer.fit(LitGPT(), data)
    return timer.ms_per_step, trainer.callback_metrics.get("train_loss")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    eager_ms, eager_loss = fit(args.steps, None)
    graphs = CUDAGraphs()
    graphed_ms, graphed_loss = fit(args.steps, graphs)
    print(f"Lightning eager:        {eager_ms:7.2f} ms/step  (last loss {float(eager_loss):.4f})")
    print(f"Lightning + CUDAGraphs: {graphed_ms:7.2f} ms/step  (last loss {float(graphed_loss):.4f})"
          f"  {eager_ms / graphed_ms:.2f}x")
    report = graphs.report
    print(f"mode {report['active']}, {report['graphed_steps']} graphed steps, "
          f"{report['eager_steps']} eager, capture {report['capture_s']:.2f} s")
    for fallback in report["fallbacks"]:
        print(f"  fell back: {fallback['what']}: {fallback['reason']} (x{fallback['count']})")


if __name__ == "__main__":
    main()
