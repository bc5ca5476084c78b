"""Lightning ``Trainer.fit`` with and without graphed's CUDAGraphs callback.

The workload of the "Frameworks" row of DESIGN.md: Hugging Face GPT-2, 6
layers d384 (6 heads), vocabulary 8192, 8x128 random tokens, ``use_cache=False``,
no dropout, fused AdamW (lr 1e-4), fp32 with TF32 matmuls, seed 0.
:func:`lightning_step_ms` is what bench/integrations.py calls; this module
imports CPU-only (lightning and transformers are imported when it runs).

    python bench/integrations_lightning.py      # both sides, printed as JSON
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from integrations_hf import TokenDataset, gpt2_config  # noqa: E402  (the same model and data)

LAYERS, WIDTH, HEADS, VOCAB, BATCH, LENGTH = 6, 384, 6, 8192, 8, 128


def gpt2_module(lr: float = 1e-4, seed: int = 0, layers: int = LAYERS, width: int = WIDTH,
                heads: int = HEADS, vocab: int = VOCAB, length: int = LENGTH) -> Any:
    """A LightningModule around GPT2LMHeadModel from its config, logging its
    loss with ``self.log`` as Lightning users do."""
    import lightning.pytorch as pl
    from transformers import GPT2LMHeadModel

    class LitGPT(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.model = GPT2LMHeadModel(gpt2_config(layers, width, heads, vocab, length))

        def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = self.model(**batch).loss
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=lr, fused=True)

    return LitGPT()


def token_loader(steps: int, batch: int = BATCH, length: int = LENGTH,
                 vocab: int = VOCAB) -> torch.utils.data.DataLoader:
    """``steps`` batches of random tokens (labels = inputs), the same each call."""
    return torch.utils.data.DataLoader(TokenDataset(steps * batch, length=length, vocab=vocab),
                                       batch_size=batch, pin_memory=True, drop_last=True)


def _timer_callback(warmup: int, window: int) -> Any:
    import lightning.pytorch as pl

    class Timer(pl.Callback):
        """Synchronizes at window boundaries only (after warm-up, then every
        ``window`` steps) and keeps each batch's loss on the device."""

        def __init__(self) -> None:
            self.marks: List[float] = []
            self.losses: List[torch.Tensor] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            if outputs and outputs.get("loss") is not None:
                self.losses.append(outputs["loss"].detach().float().reshape(()))
            step = trainer.global_step
            if step >= warmup and (step - warmup) % window == 0:
                torch.cuda.synchronize()
                self.marks.append(time.perf_counter())

    return Timer()


def lightning_step_ms(graphed: bool, steps: int = 60, warmup: int = 10, repeats: int = 5,
                      callback_kwargs: Optional[Dict[str, Any]] = None,
                      strategy: str = "auto") -> Dict[str, Any]:
    """ms per training step of ``Trainer.fit`` on the GPT-2 workload, eager or
    with ``CUDAGraphs`` (``graphed=True``).

    One fit of ``warmup + steps`` steps; after ``warmup`` steps (capture
    included) the remaining steps are cut into ``repeats`` windows, timed with a
    CUDA sync at each boundary; the result is the median window's ms/step.
    Returns ``ms_per_step``, ``windows_ms``, ``losses`` (per step, as floats,
    read after the fit) and, with the callback, its ``report``. ``strategy``:
    Lightning's (``"ddp"`` under torchrun: bench/integrations_ddp.py)."""
    import lightning.pytorch as pl

    torch.backends.cuda.matmul.allow_tf32 = True
    window = max(1, steps // repeats)
    timer = _timer_callback(warmup, window)
    callbacks: List[Any] = [timer]
    graphs = None
    if graphed:
        from graphed.integrations.lightning import CUDAGraphs

        graphs = CUDAGraphs(**(callback_kwargs or {}))
        callbacks.append(graphs)
    module = gpt2_module()
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=strategy,
                         max_steps=warmup + window * repeats,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=callbacks)
    trainer.fit(module, token_loader(warmup + window * repeats))
    torch.cuda.synchronize()
    marks = timer.marks
    windows = [(b - a) * 1e3 / window for a, b in zip(marks, marks[1:])]
    result: Dict[str, Any] = {
        "method": "lightning_graphed" if graphed else "lightning_eager",
        "ms_per_step": statistics.median(windows) if windows else float("nan"),
        "windows_ms": windows, "steps": trainer.global_step,
        "losses": torch.stack(timer.losses).tolist() if timer.losses else []}
    if graphs is not None:
        result["report"] = graphs.report
    return result


def loss_rel_diff_vs_eager(eager: Dict[str, Any], graphed: Dict[str, Any]) -> float:
    """The largest relative difference between the two fits' per-step losses."""
    a = torch.tensor(eager["losses"], dtype=torch.float64)
    b = torch.tensor(graphed["losses"], dtype=torch.float64)
    n = min(len(a), len(b))
    if n == 0:
        return float("nan")
    return float(((a[:n] - b[:n]).abs() / a[:n].abs().clamp_min(1e-12)).max())


def compare(steps: int = 60, warmup: int = 10, repeats: int = 5) -> Dict[str, Any]:
    """Both sides, their speed ratio and loss difference."""
    eager = lightning_step_ms(False, steps, warmup, repeats)
    graphed = lightning_step_ms(True, steps, warmup, repeats)
    return {"eager": eager, "graphed": graphed,
            "speedup": eager["ms_per_step"] / graphed["ms_per_step"],
            "loss_rel_diff_vs_eager": loss_rel_diff_vs_eager(eager, graphed)}


if __name__ == "__main__":
    summary = compare()
    for side in ("eager", "graphed"):
        summary[side].pop("losses")
    print(json.dumps(summary, indent=2, default=str))
