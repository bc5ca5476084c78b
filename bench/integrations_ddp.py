"""DDP rows of bench/integrations.py (issue 25): the HF Trainer and Lightning
on the integrations' GPT-2 workload (bench/integrations_hf.py) under
DistributedDataParallel, eager and graphed (step mode), at world size N
(1 on one GPU). Rows: ``hf_trainer_ddp_eager``, ``hf_trainer_ddp_graphed``,
``lightning_ddp_eager``, ``lightning_ddp_graphed``, each with ``ms`` per step
(rank 0's) and ``world_size``.

accelerate decides its distributed type when the process starts (MULTI_GPU
under torchrun) and keeps it for the process, so the rows run in processes of
their own: ``ddp_rows`` launches ``torchrun --nproc-per-node N`` on this file,
which runs both frameworks' eager and graphed paths on every rank after
``graphed.distributed.init_process_group()`` (NCCL with the settings capture
needs; both paths use the same process group). By hand, on one GPU::

    cd bench && torchrun --nproc-per-node 1 integrations_ddp.py /tmp/ddp.json [--quick]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, Dict

import torch

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 1200


def _attempt(body: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    try:
        return body()
    except Exception as error:  # a failed path is a result
        return {"error": f"{type(error).__name__}: {error}"[-2000:],
                "traceback": traceback.format_exc()[-3000:]}
    finally:
        torch.cuda.synchronize()


def _hf(graphed: bool, quick: bool) -> Dict[str, Any]:
    import integrations_hf

    # The Trainer's default find_unused_parameters=True cannot be captured.
    row = integrations_hf.hf_trainer_step_ms(graphed, steps=60, quick=quick,
                                             ddp_find_unused_parameters=False)
    out = {"ms": row["ms"], "steps": row["steps"], "losses": row["losses"]}
    if graphed:
        out.update(mode=row["mode"], fallbacks=row["fallbacks"], notes=row["notes"],
                   graphed_steps=row.get("graphed_steps"), capture_ms=row.get("capture_ms"))
    return out


def _lightning(graphed: bool, quick: bool) -> Dict[str, Any]:
    import integrations_lightning

    steps, warmup, repeats = (12, 5, 3) if quick else (60, 10, 5)
    row = integrations_lightning.lightning_step_ms(
        graphed, steps=steps, warmup=warmup, repeats=repeats,
        callback_kwargs={"mode": "step"} if graphed else None, strategy="ddp")
    out = {"ms": round(row["ms_per_step"], 4), "steps": row["steps"], "losses": row["losses"]}
    if graphed:
        report = row.get("report") or {}
        out["report"] = {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v))
                         for k, v in dict(report).items()}
    return out


def run_rank(quick: bool) -> Dict[str, Any]:
    """One rank: the four rows (under torchrun)."""
    import integrations

    from graphed import distributed

    distributed.init_process_group(nvlink_multicast=False)
    world = torch.distributed.get_world_size()
    methods: Dict[str, Any] = {}
    methods["hf_trainer_ddp_eager"] = _attempt(lambda: _hf(False, quick))
    methods["hf_trainer_ddp_graphed"] = _attempt(lambda: _hf(True, quick))
    integrations._compare(methods, "hf_trainer_ddp_eager", "hf_trainer_ddp_graphed")
    methods["lightning_ddp_eager"] = _attempt(lambda: _lightning(False, quick))
    methods["lightning_ddp_graphed"] = _attempt(lambda: _lightning(True, quick))
    integrations._compare(methods, "lightning_ddp_eager", "lightning_ddp_graphed")
    for row in methods.values():
        row["world_size"] = world
    distributed.shutdown()
    return methods


def ddp_rows(quick: bool = False, world_size: int = 1) -> Dict[str, Any]:
    """The four rows at ``world_size`` (rank 0's numbers), from a torchrun
    launch of this file; a launch that fails gives every row ``error``."""
    from graphed import distributed

    names = ("hf_trainer_ddp_eager", "hf_trainer_ddp_graphed", "lightning_ddp_eager",
             "lightning_ddp_graphed")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ddp.json"
        env = dict(os.environ)
        env.update(distributed.NVLINK_MULTICAST_OFF)
        env.update(distributed.CAPTURE_ENVIRONMENT)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={world_size}", str(HERE / "integrations_ddp.py"), str(out)]
        if quick:
            command.append("--quick")
        try:
            done = subprocess.run(command, cwd=HERE, env=env, capture_output=True, text=True,
                                  timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {n: {"error": f"torchrun did not finish in {TIMEOUT_S} s",
                        "world_size": world_size} for n in names}
        if done.returncode != 0 or not out.exists():
            tail = (done.stdout + done.stderr)[-2000:]
            return {n: {"error": f"torchrun exited with {done.returncode}: {tail}",
                        "world_size": world_size} for n in names}
        return json.loads(out.read_text())


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    result = run_rank("--quick" in sys.argv)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(sys.argv[1]).write_text(json.dumps(result))
