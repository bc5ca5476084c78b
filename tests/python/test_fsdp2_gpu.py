"""FSDP2 (fully_shard) on one and two GPUs: 10 steps of graphed.TrainStep over
the gpt_train model sharded per block and as a whole (unshards, all-gathers,
reduce-scatters and AdamW on the shards captured) give eager FSDP2's losses
and weights within 1e-5, with the default resharding and with
reshard_after_forward=False; an eager evaluation forward between steps
changes nothing; a capture that fails leaves the model, its optimizer and
FSDP2 as they were; what cannot be captured is refused before warm-up.
Each test starts one process per rank (fsdp2_worker.py) over NCCL.

At one rank FSDP2 runs no collective (it copies shards instead); the
captured NCCL all-gathers and reduce-scatters run at two ranks
(Note [FSDP2 inside a captured step], point 8)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from graphed import fsdp
from test_ddp_gpu import WORLD_SIZES, run_ranks as run_worker_ranks

pytestmark = [
    pytest.mark.gpu,
    # Worker processes of their own on the GPU: scripts/gpu-check runs these
    # (world size 1) after the tests it spreads over several processes.
    pytest.mark.exclusive,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not (torch.distributed.is_available()
                            and torch.distributed.is_nccl_available()),
                       reason="needs torch.distributed with NCCL"),
    pytest.mark.skipif(not fsdp.available(), reason="this torch build has no FSDP2"),
]

WORKER = Path(__file__).with_name("fsdp2_worker.py")
TOLERANCE = 1e-5


def run_ranks(scenario: str, world_size: int, tmp_path: Path) -> List[Dict[str, Any]]:
    """``scenario`` of fsdp2_worker.py on ``world_size`` ranks (test_ddp_gpu's
    launcher): what every rank reported."""
    return run_worker_ranks(scenario, world_size, tmp_path, WORKER)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_trainstep_under_fsdp2_equals_eager_fsdp2(world_size, tmp_path):
    results = run_ranks("trainstep", world_size, tmp_path)
    for result in results:
        assert [run["name"] for run in result["runs"]] == [
            "trainstep default", "trainstep reshard_after_forward=False"]
        for run in result["runs"]:
            where = f"{run['name']}, rank {result['rank']}"
            assert len(run["losses"]) == 10
            assert run["loss_max_rel_diff"] <= TOLERANCE, (
                f"{where}: losses differ from eager FSDP2 by up to "
                f"{run['loss_max_rel_diff']:.3g} relative\n graphed {run['losses']}\n"
                f" eager   {run['eager_losses']}")
            assert run["weights_close"], (
                f"{where}: weights differ from eager FSDP2 by up to "
                f"{run['weight_max_abs_diff']:.3g}")
            assert run["weights_moved"] > 1e-4, f"{where}: training did not change the weights"
            assert run["capture_changed_nothing"], f"{where}: warm-up or capture trained"
            assert run["grads_are_dtensors"], f"{where}: .grad is not FSDP2's sharded DTensor"
            assert run["eval_between_steps_matches"], f"{where}: evaluation differs from eager"
            assert run["later_loss_max_rel_diff"] <= TOLERANCE, (
                f"{where}: steps after an eager evaluation differ from eager by "
                f"{run['later_loss_max_rel_diff']:.3g}")
            assert run["steps"] == 12
        assert result["released"] == [True, True]
        assert result["shutdown_s"] < 90
    if world_size > 1:
        # Each rank trained on its own tokens: equal losses would mean equal data.
        assert results[0]["runs"][0]["losses"] != results[1]["runs"][0]["losses"]


def test_a_failed_capture_leaves_model_optimizer_and_fsdp2_as_they_were(tmp_path):
    result = run_ranks("capture_failure", 1, tmp_path)[0]
    assert result["message"] != "no error", "the capture with .item() should have failed"
    assert result["weights_untouched"], "the failed capture changed the weights"
    assert result["optimizer_state_zero"], "the failed capture changed the optimizer state"
    assert result["fsdp_idle_and_sharded"], "FSDP2 was left mid-step"
    assert result["eager_after_failure_matches"], "eager training after the failure differs"


def test_trainstep_refuses_what_fsdp2_capture_cannot_do_before_warmup(tmp_path):
    result = run_ranks("refusals", 1, tmp_path)[0]
    messages = result["messages"]
    prefix = "Cannot capture FSDP2's all-gathers and reduce-scatters:"
    for name, message in messages.items():
        assert message.startswith(prefix), f"{name}: {message}"
    assert "The root GPT reshards its parameters after forward" in messages["root_reshards"]
    assert "set_requires_gradient_sync(True)" in messages["no_gradient_sync"]
    assert "set_reshard_after_backward(True)" in messages["no_reshard_after_backward"]
    assert "clip_grad_norm under FSDP2 is not supported yet" in messages["clip"]
    assert "CPUOffloadPolicy" in messages["cpu_offload"]
    assert result["weights_untouched"]
