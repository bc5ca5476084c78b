"""One rank of test_integrations_ddp_gpu.py: ``python integrations_ddp_worker.py
SCENARIO OUT.json`` under torchrun-like RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT. Trains the tiny GPT-2 of the single-GPU tests
with the framework's DDP eagerly, then with graphed's step mode, and writes
both loss curves and graphed's report to OUT.json (a traceback under "error"
when the scenario raised)."""

from __future__ import annotations

import json
import sys
import tempfile
import traceback
from typing import Any, Dict

import torch

from graphed import distributed

STEPS = 16


def hf() -> Dict[str, Any]:
    import transformers
    from graphed.integrations.transformers import GraphedTrainer
    from hf_trainer_models import TokenData, tiny_gpt2

    def run(graphed: bool, accumulation: int):
        with tempfile.TemporaryDirectory() as out:
            args = transformers.TrainingArguments(
                output_dir=out, per_device_train_batch_size=4, max_steps=STEPS,
                gradient_accumulation_steps=accumulation, logging_steps=1, report_to="none",
                save_strategy="no", learning_rate=1e-3, seed=0, optim="adamw_torch_fused",
                dataloader_drop_last=True, disable_tqdm=True, ddp_find_unused_parameters=False)
            common = dict(model=tiny_gpt2().cuda(), args=args,
                          train_dataset=TokenData(count=4 * STEPS * accumulation * 2))
            trainer = (GraphedTrainer(**common, graphed_fallback="raise") if graphed
                       else transformers.Trainer(**common))
            trainer.train()
            losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
            wrapped = type(trainer.model_wrapped).__name__
            report = trainer.graphed_report.as_dict() if graphed else None
            if graphed:
                report.pop("train_step", None)
                trainer.graphed_report.train_step.release()
            return losses, wrapped, report

    runs = []
    for accumulation in (1, 2):
        eager, wrapped, _ = run(False, accumulation)
        graphed, graphed_wrapped, report = run(True, accumulation)
        runs.append({"accumulation": accumulation, "eager": eager, "graphed": graphed,
                     "wrapped": [wrapped, graphed_wrapped], "report": report})
    return {"runs": runs}


def lightning() -> Dict[str, Any]:
    import lightning.pytorch as pl
    from graphed.integrations.lightning import CUDAGraphs
    from lightning_models import GPTModule, StepOutputs, token_data

    class WrapperDuringTraining(pl.Callback):
        """What wraps the module while it trains: Lightning's teardown unwraps
        DistributedDataParallel again after fit."""
        name = None

        def on_train_batch_end(self, trainer, *args) -> None:
            self.name = type(trainer.strategy.model).__name__

    def run(graphed: bool, accumulation: int):
        outputs = StepOutputs()
        wrapper = WrapperDuringTraining()
        callbacks = [outputs, wrapper]
        graphs = CUDAGraphs(mode="step", fallback="raise") if graphed else None
        if graphs is not None:
            callbacks.append(graphs)
        module = GPTModule()
        # Launched externally (LOCAL_RANK set): Lightning wants devices = ranks.
        trainer = pl.Trainer(accelerator="gpu", devices=torch.distributed.get_world_size(),
                             strategy="ddp", max_steps=STEPS,
                             accumulate_grad_batches=accumulation, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0,
                             limit_val_batches=0, callbacks=callbacks)
        trainer.fit(module, token_data(STEPS * accumulation))
        torch.cuda.synchronize()
        losses = [float(x) for x in outputs.losses]
        wrapped = wrapper.name
        report = None
        if graphs is not None:
            report = {k: v for k, v in graphs.report.items()
                      if isinstance(v, (int, float, str, bool, list, type(None)))}
        return losses, wrapped, report

    runs = []
    for accumulation in (1, 2):
        eager, wrapped, _ = run(False, accumulation)
        graphed, graphed_wrapped, report = run(True, accumulation)
        # Step mode reports one loss per accumulation window, the sum of its
        # batches' losses (as test_lightning_gpu compares them).
        eager = [sum(eager[i:i + accumulation]) for i in range(0, len(eager), accumulation)]
        runs.append({"accumulation": accumulation, "eager": eager, "graphed": graphed,
                     "wrapped": [wrapped, graphed_wrapped], "report": report})
    return {"runs": runs}


def main() -> None:
    scenario, out = sys.argv[1], sys.argv[2]
    result: Dict[str, Any]
    try:
        distributed.init_process_group(nvlink_multicast=False)
        torch.backends.cuda.matmul.allow_tf32 = False
        result = {"hf": hf, "lightning": lightning}[scenario]()
        result["rank"] = torch.distributed.get_rank()
        result["world_size"] = torch.distributed.get_world_size()
        result["device"] = torch.cuda.current_device()
        distributed.shutdown()
    except BaseException:  # noqa: BLE001 - reported to the test
        result = {"error": traceback.format_exc()}
    with open(out, "w") as f:
        json.dump(result, f, default=str)
    sys.exit(1 if "error" in result else 0)


if __name__ == "__main__":
    main()
