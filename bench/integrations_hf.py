"""Hugging Face Trainer rows for bench/integrations.py (issue 15).

GPT-2 (6 layers, d384, 6 heads, vocabulary 8192 as in bench/zoo_models.py),
batch 8x128 random tokens, fused AdamW (optim="adamw_torch_fused"),
use_cache=False, no dropout, fp32 with TF32 matmuls allowed, seed 0. The same
model, data and arguments train once with the plain ``transformers.Trainer``
and once with graphed's ``GraphedTrainer`` (mode="step"). A TrainerCallback
times each optimizer step from on_step_begin to on_step_end with
torch.cuda.synchronize() on both ends (the batch's loading and the Trainer's
logging fall outside); the result is the median after warm-up (graphed's
capture happens in its first step). The logged per-step losses
(logging_steps=1) let the caller compute loss_rel_diff_vs_eager.

Importable on a machine without a GPU (transformers and CUDA are touched only
when a function runs)::

    from bench.integrations_hf import hf_trainer_step_ms, hf_trainer_rows
    rows = hf_trainer_rows(steps=60, quick=False)
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch

VOCAB, LAYERS, WIDTH, HEADS, BATCH, LENGTH = 8192, 6, 384, 6, 8, 128
QUICK_STEPS = 12


def gpt2_config(layers: int = LAYERS, width: int = WIDTH, heads: int = HEADS,
                vocab: int = VOCAB, length: int = LENGTH):
    """The benchmark's GPT-2 config (no dropout, no cache); bench/integrations_lightning.py
    trains the same model."""
    import transformers

    return transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab,
        n_positions=max(length, 128), bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)


def gpt2_model(seed: int = 0):
    """The benchmark's GPT-2, random init from its config, on the GPU."""
    import transformers

    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(gpt2_config()).cuda()


class TokenDataset(torch.utils.data.Dataset):
    """Random tokens (labels = inputs), generated once from a seed."""

    def __init__(self, count: int, seed: int = 1, length: int = LENGTH,
                 vocab: int = VOCAB) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (count, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _step_timer():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Milliseconds of each optimizer step, GPU work included."""

        def __init__(self) -> None:
            self.ms: List[float] = []
            self._started: Optional[float] = None

        def on_step_begin(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            self._started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            if self._started is not None:
                self.ms.append((time.perf_counter() - self._started) * 1000)
            self._started = None

    return StepTimer()


def training_arguments(output_dir: str, steps: int, **overrides: Any):
    """The benchmark's TrainingArguments (shared by both paths)."""
    import transformers

    values = dict(output_dir=output_dir, per_device_train_batch_size=BATCH, max_steps=steps,
                  logging_steps=1, report_to="none", save_strategy="no", learning_rate=1e-4,
                  seed=0, optim="adamw_torch_fused", dataloader_drop_last=True,
                  disable_tqdm=True, lr_scheduler_type="constant")
    values.update(overrides)
    return transformers.TrainingArguments(**values)


def hf_trainer_step_ms(graphed: bool, steps: int = 60, quick: bool = False,
                       warmup: int = 5, **args_overrides: Any) -> Dict[str, Any]:
    """Trains the benchmark GPT-2 for ``steps`` optimizer steps (``quick``:
    12) with the plain Trainer or GraphedTrainer; returns ``{"path", "ms"``
    (median ms per step after ``warmup`` steps)``, "ms_all", "losses",
    "steps", "mode", "fallbacks", "notes"}`` (mode and fallbacks are graphed's;
    ``None`` for the plain Trainer). ``args_overrides`` go to the
    TrainingArguments (bench/integrations_ddp.py: ddp_find_unused_parameters)."""
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = True
    if quick:
        steps = min(steps, QUICK_STEPS)
        warmup = min(warmup, 3)
    timer = _step_timer()
    with tempfile.TemporaryDirectory() as output_dir:
        args = training_arguments(output_dir, steps, **args_overrides)
        common = dict(model=gpt2_model(), args=args, train_dataset=TokenDataset(BATCH * steps),
                      callbacks=[timer])
        if graphed:
            from graphed.integrations.transformers import GraphedTrainer

            trainer = GraphedTrainer(**common)
        else:
            trainer = transformers.Trainer(**common)
        trainer.train()
    timed = timer.ms[warmup:] or timer.ms
    result: Dict[str, Any] = {
        "path": "graphed_trainer" if graphed else "hf_trainer",
        "ms": round(statistics.median(timed), 4),
        "ms_all": [round(ms, 4) for ms in timer.ms],
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "steps": trainer.state.global_step,
        "mode": None, "fallbacks": None, "notes": None,
    }
    if graphed:
        report = trainer.graphed_report
        result.update(mode=report.mode, fallbacks=[dict(f) for f in report.fallbacks],
                      notes=list(report.notes), graphed_steps=report.graphed_steps)
        if report.train_step is not None:
            stats = report.train_step.stats()
            result["capture_ms"] = stats.get("capture_ms")
    return result


def loss_rel_diff(losses: List[float], reference: List[float]) -> Optional[float]:
    """The largest relative difference of two loss curves (None if their lengths differ)."""
    if len(losses) != len(reference) or not reference:
        return None
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference))


def hf_trainer_rows(steps: int = 60, quick: bool = False) -> List[Dict[str, Any]]:
    """Both paths, plain first; the graphed row adds ``speedup`` and
    ``loss_rel_diff_vs_eager``."""
    plain = hf_trainer_step_ms(False, steps, quick)
    fast = hf_trainer_step_ms(True, steps, quick)
    fast["speedup"] = round(plain["ms"] / fast["ms"], 3) if fast["ms"] else None
    fast["loss_rel_diff_vs_eager"] = loss_rel_diff(fast["losses"], plain["losses"])
    return [plain, fast]


if __name__ == "__main__":
    import json
    import sys

    for row in hf_trainer_rows(quick="--quick" in sys.argv):
        print(json.dumps({k: v for k, v in row.items() if k not in ("ms_all", "losses")}))
