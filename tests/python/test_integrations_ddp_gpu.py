"""The HF Trainer and Lightning under DistributedDataParallel in graphed's
step mode, on the GPU: each rank (a process, launched as
test_ddp_gpu.py launches its ranks) trains the tiny GPT-2 of the single-GPU
tests with the framework's DDP eagerly and graphed, with and without
gradient accumulation; the losses agree within the single-GPU tests'
tolerance and the integrations' reports say every step replayed. World size
1 runs in scripts/gpu-check's exclusive phase; world size 2 needs two GPUs
(scripts/gpu-check-multi)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from test_ddp_gpu import WORLD_SIZES, run_ranks as _run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.exclusive,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not (torch.distributed.is_available()
                            and torch.distributed.is_nccl_available()),
                       reason="needs torch.distributed with NCCL"),
]

# The single-GPU tests' tolerance for fp32 losses (test_hf_trainer_gpu.run_both;
# test_lightning_gpu compares as closely).
REL = 1e-4


def run_ranks(scenario, world_size, tmp_path):
    return _run_ranks(scenario, world_size, tmp_path,
                      Path(__file__).with_name("integrations_ddp_worker.py"))


def check_runs(result, steps_key, world_size, ddp=True):
    for run in result["runs"]:
        where = f"rank {result['rank']}, accumulation {run['accumulation']}"
        assert run["wrapped"] == ["DistributedDataParallel"] * 2 if ddp else \
            run["wrapped"][0] == run["wrapped"][1] != "DistributedDataParallel", where
        assert len(run["graphed"]) == len(run["eager"]) > 0, where
        assert run["graphed"] == pytest.approx(run["eager"], rel=REL), where
        report = run["report"]
        assert report[steps_key] > 0, f"{where}: no step replayed: {report}"
        assert report["fallbacks"] == [] or all(
            f.get("what", f.get("scope")) not in ("training", "trainer", "the training step")
            for f in report["fallbacks"]), f"{where}: {report['fallbacks']}"
        assert any("DistributedDataParallel" in n for n in report["notes"]) == ddp, where
    assert result["world_size"] == world_size


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_hf_trainer_ddp_step_mode_equals_eager_ddp(world_size, tmp_path):
    # accelerate wraps the model in DistributedDataParallel only with more
    # than one process (Accelerator.multi_device), so at world size 1 the
    # Trainer trains the bare model, as graphed's report then says.
    for result in run_ranks("hf", world_size, tmp_path):
        check_runs(result, "graphed_steps", world_size, ddp=world_size > 1)
        for run in result["runs"]:
            assert run["report"]["mode"] == "step"
            assert run["report"]["eager_steps"] == 0


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_lightning_ddp_step_mode_equals_eager_ddp(world_size, tmp_path):
    for result in run_ranks("lightning", world_size, tmp_path):
        check_runs(result, "graphed_steps", world_size)
        for run in result["runs"]:
            assert run["report"]["active"] == "step"
