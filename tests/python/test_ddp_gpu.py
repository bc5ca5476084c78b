"""DistributedDataParallel on one and two GPUs: 20 steps of graphed.TrainStep
(all-reduces captured) and of graphed.make_graphed_callables (all-reduces
around the graphed backward) give eager DDP's losses and weights on every
rank; an FP8 model reduces its amaxes once per step across the ranks; what
cannot be captured is refused before warm-up; teardown ends within
a time limit. Each test starts one process per rank (ddp_worker.py) and fails
when they do not all finish in time."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

import graphed
from graphed import distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.distributed.is_available()
                            and torch.distributed.is_nccl_available()),
                       reason="needs torch.distributed with NCCL"),
]

WORKER = Path(__file__).with_name("ddp_worker.py")
# Start-up, eager reference, warm-up, capture, 20 steps and teardown take well
# under a minute; a rank that is still running after this is hung.
TIMEOUT_S = 240
RTOL = 1e-6

WORLD_SIZES = [
    1,
    pytest.param(2, marks=pytest.mark.skipif(
        torch.cuda.device_count() < 2,
        reason=f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")),
]

needs_make_graphed_callables = pytest.mark.skipif(
    not hasattr(graphed, "make_graphed_callables"),
    reason="graphed.make_graphed_callables is not in this build yet")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(scenario: str, world_size: int, tmp_path: Path, worker: Path = WORKER
              ) -> List[Dict[str, Any]]:
    """Runs ``scenario`` of ``worker`` (a script taking the scenario and an
    output path; the FSDP2 and integration tests pass theirs) on
    ``world_size`` ranks, one process and GPU each, and returns what every
    rank reported. Fails the test when a rank does not finish within
    TIMEOUT_S (a hang, e.g. in teardown) or fails."""
    port = free_port()
    processes, outputs, logs = [], [], []
    for rank in range(world_size):
        env = dict(os.environ)
        env.update(distributed.NVLINK_MULTICAST_OFF)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                   RANK=str(rank), LOCAL_RANK=str(rank), PYTHONUNBUFFERED="1")
        outputs.append(tmp_path / f"{scenario}-rank{rank}.json")
        logs.append(tmp_path / f"{scenario}-rank{rank}.log")
        with open(logs[-1], "w") as log:
            processes.append(subprocess.Popen(
                [sys.executable, str(worker), scenario, str(outputs[-1])], env=env, stdout=log,
                stderr=subprocess.STDOUT))

    def log_tails() -> str:
        return "\n".join(f"--- rank {rank} ---\n" + "\n".join(
            log.read_text(errors="replace").splitlines()[-40:]) for rank, log in enumerate(logs))

    try:
        for rank, process in enumerate(processes):
            try:
                process.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{scenario}: rank {rank} did not finish within {TIMEOUT_S} s "
                            f"(hung; teardown after capture?)\n{log_tails()}")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    results = []
    for rank, (process, output) in enumerate(zip(processes, outputs)):
        if not output.exists():
            pytest.fail(f"{scenario}: rank {rank} exited with {process.returncode} and no "
                        f"result\n{log_tails()}")
        result = json.loads(output.read_text())
        if "error" in result:
            pytest.fail(f"{scenario}: rank {rank} failed:\n{result['error']}\n{log_tails()}")
        assert process.returncode == 0, f"rank {rank} exited with {process.returncode}"
        results.append(result)
    assert sorted(r["rank"] for r in results) == list(range(world_size))
    assert len({r["device"] for r in results}) == world_size, "two ranks shared a GPU"
    return results


def assert_matches_eager(run: Dict[str, Any], rank: int) -> None:
    where = f"{run['name']}, rank {rank}"
    assert len(run["losses"]) == 20
    assert run["loss_max_rel_diff"] <= RTOL, (
        f"{where}: losses differ from eager DDP by up to {run['loss_max_rel_diff']:.3g} "
        f"relative\n graphed {run['losses']}\n eager   {run['eager_losses']}")
    assert run["weights_close"], (
        f"{where}: weights differ from eager DDP by up to {run['weight_max_abs_diff']:.3g}")
    assert run["weights_moved"] > 1e-4, f"{where}: training did not change the weights"
    assert run["ranks_agree"], f"{where}: the ranks' weights differ: gradients not all-reduced"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_trainstep_under_ddp_equals_eager_ddp_and_tears_down(world_size, tmp_path):
    results = run_ranks("trainstep", world_size, tmp_path)
    for result in results:
        assert len(result["runs"]) == 2  # gradient_as_bucket_view False and True
        for run in result["runs"]:
            assert_matches_eager(run, result["rank"])
            assert run["capture_changed_nothing"], f"{run['name']}: capture trained the model"
            assert run["steps"] == 20
        assert result["released"] == [True, True]
        assert "was released" in result["step_after_shutdown"]
        assert result["shutdown_s"] < 90
    if world_size > 1:
        # Each rank trained on its own tokens: equal losses would mean equal data.
        assert results[0]["runs"][0]["losses"] != results[1]["runs"][0]["losses"]


@needs_make_graphed_callables
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_make_graphed_callables_under_ddp_equals_eager_ddp(world_size, tmp_path):
    for result in run_ranks("make_graphed_callables", world_size, tmp_path):
        run = result["runs"][0]
        assert run["returned_the_ddp_model"], "make_graphed_callables should return the DDP model"
        assert "prepare_ddp" in run["plain_ddp_refusal"], run["plain_ddp_refusal"]
        assert_matches_eager(run, result["rank"])
        assert result["shutdown_s"] < 90


@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
    reason="needs a GPU with FP8 tensor cores (compute capability 8.9 or newer)")
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fp8_trainstep_under_ddp_reduces_the_amaxes_once_per_step(world_size, tmp_path):
    results = run_ranks("fp8", world_size, tmp_path)
    for result in results:
        run = result["runs"][0]
        assert_matches_eager(run, result["rank"])
        assert run["fp8_state_buffers"] > 0
        assert run["fp8_state_equals_eager"], "the graphs advanced the FP8 state unlike eager"
        assert run["fp8_state_ranks_agree"], "the ranks' FP8 scales differ: amaxes not reduced"
        assert run["fp8_scales_moved"], "delayed scaling never changed a scale"
        # One all_reduce of every layer's amax per step (update_scales, after
        # the last microbatch's backward), not one per layer or microbatch.
        fp8_kernels, bf16_kernels = run["nccl_kernels_fp8"], run["nccl_kernels_bf16"]
        assert len(fp8_kernels) == len(bf16_kernels) + (world_size > 1), (
            f"NCCL kernels of one replay: FP8 {fp8_kernels}, bf16 {bf16_kernels}")
        assert result["shutdown_s"] < 90
    if world_size > 1:
        assert results[0]["runs"][0]["losses"] != results[1]["runs"][0]["losses"]


def test_trainstep_refuses_what_ddp_capture_cannot_do_before_warmup(tmp_path):
    result = run_ranks("refusals", 1, tmp_path)[0]
    messages = result["messages"]
    assert "runs on the default stream of cuda:0" in messages["default_stream"]
    assert "graphed.distributed.prepare_ddp(module)" in messages["default_stream"]
    assert "at least 11 warm-up iterations before capture, got 3" in messages["short_warmup"]
    assert 'capture_error_mode="thread_local"' in messages["global_mode"]
    assert result["weights_untouched"]
