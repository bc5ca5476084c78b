"""The Hugging Face Trainer with each optimizer step captured as one CUDA graph.

    python examples/hf_trainer.py [--steps 60] [--accumulation 1] [--bf16]

Trains a GPT-2 (6 layers, d384, 6 heads, random init from its config) on
random tokens (batch 8x128) with optim="adamw_torch_fused", first with the
plain ``transformers.Trainer``, then with graphed's ``GraphedTrainer``, and
prints the milliseconds per optimizer step of each (median after warm-up,
GPU work included) and the largest relative difference of the logged losses.
An existing Trainer can be graphed in place instead:
``graphed.integrations.transformers.optimize_trainer(trainer)``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import transformers

from graphed.integrations.transformers import GraphedTrainer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.integrations_hf import TokenDataset, gpt2_model, loss_rel_diff  # noqa: E402


class StepTimer(transformers.TrainerCallback):
    """Milliseconds per optimizer step, synchronized with the GPU."""

    def __init__(self):
        self.ms = []

    def on_step_begin(self, args, state, control, **kwargs):
        torch.cuda.synchronize()
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        torch.cuda.synchronize()
        self.ms.append((time.perf_counter() - self.started) * 1000)


def train(trainer_class, steps, accumulation, bf16, **extra):
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        args = transformers.TrainingArguments(
            output_dir=output_dir, per_device_train_batch_size=8, max_steps=steps,
            gradient_accumulation_steps=accumulation, logging_steps=1, report_to="none",
            save_strategy="no", learning_rate=1e-4, warmup_steps=5, max_grad_norm=1.0,
            optim="adamw_torch_fused", bf16=bf16, dataloader_drop_last=True, disable_tqdm=True,
            seed=0)
        trainer = trainer_class(model=gpt2_model(), args=args,
                                train_dataset=TokenDataset(8 * accumulation * steps),
                                callbacks=[timer], **extra)
        trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return trainer, statistics.median(timer.ms[5:] or timer.ms), losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--bf16", action="store_true")
    options = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("This example needs a CUDA GPU.")
    torch.backends.cuda.matmul.allow_tf32 = True
    transformers.logging.set_verbosity_error()
    _, plain_ms, plain_losses = train(transformers.Trainer, options.steps, options.accumulation,
                                      options.bf16)
    trainer, graphed_ms, graphed_losses = train(GraphedTrainer, options.steps,
                                                options.accumulation, options.bf16)
    print(f"plain Trainer:   {plain_ms:7.2f} ms/step")
    print(f"GraphedTrainer:  {graphed_ms:7.2f} ms/step ({plain_ms / graphed_ms:.2f}x)")
    print(f"largest relative loss difference: {loss_rel_diff(graphed_losses, plain_losses):.2e}")
    print(trainer.graphed_report)


if __name__ == "__main__":
    main()
