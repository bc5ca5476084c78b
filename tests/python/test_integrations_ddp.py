"""DDP in the integrations' step mode, on the CPU: which configurations the HF
Trainer's and Lightning's step mode accept or refuse under
DistributedDataParallel, and the reasons (Note [DDP built by a framework],
Note [DDP in the Trainer's captured step], Note [DDP in Lightning's captured
step]). DDP objects are built over a one-rank gloo process group, which each
test creates and always destroys; captures need NCCL on a GPU
(test_integrations_ddp_gpu.py)."""

from __future__ import annotations

import os
import socket
import types

import pytest
import torch
from torch import nn

from graphed import GraphedError, distributed

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available(),
                       reason="needs torch.distributed"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def gloo():
    """A one-rank gloo process group for the test, destroyed afterwards."""
    if torch.distributed.is_initialized():
        pytest.skip("a process group exists already in this process")
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield torch.distributed.group.WORLD
    finally:
        torch.distributed.destroy_process_group()


def small_ddp(**kwargs):
    torch.manual_seed(0)
    return nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), **kwargs)


# --- graphed.distributed: the shared checks -----------------------------------------

def test_framework_ddp_problems_name_the_backend_device_and_fix(gloo):
    problems = distributed.framework_ddp_problems(small_ddp())
    text = " ".join(problems)
    assert "'gloo' backend" in text and "backend='nccl'" in text
    assert "a captured iteration needs them on one GPU" in text
    assert not any("find_unused_parameters" in p for p in problems)
    assert distributed.describe_problem(problems[0]).startswith(
        "Cannot capture DistributedDataParallel's all-reduces: ")


def test_framework_ddp_problems_refuse_unused_parameter_search_and_comm_hooks(gloo):
    unused = " ".join(distributed.framework_ddp_problems(small_ddp(find_unused_parameters=True)))
    assert "find_unused_parameters=True" in unused and "static_graph=True" in unused
    static = distributed.framework_ddp_problems(
        small_ddp(find_unused_parameters=True, static_graph=True))
    assert not any("find_unused_parameters" in p for p in static)
    hooked = small_ddp()
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    hooked.register_comm_hook(None, default_hooks.allreduce_hook)
    text = " ".join(distributed.framework_ddp_problems(hooked))
    assert "communication hook (allreduce_hook" in text and "remove the hook" in text


def test_framework_ddp_problems_refuse_no_sync(gloo):
    model = small_ddp()
    with model.no_sync():
        assert any("no_sync()" in p for p in distributed.framework_ddp_problems(model))


def test_collective_warmup_rises_under_ddp_only(gloo):
    model = small_ddp()
    wrapper = nn.ModuleDict({"inner": model})
    assert distributed.collective_warmup([wrapper], 3) == distributed.COLLECTIVE_WARMUP_ITERS
    assert distributed.collective_warmup([wrapper], 20) == 20
    assert distributed.collective_warmup([model.module], 3) == 3


def test_build_ddp_needs_torch_distributed_and_checks_nothing(gloo):
    # On the CPU there is no capture stream to build on: the context needs CUDA.
    if torch.cuda.is_available():
        pytest.skip("checks the CPU build")
    with pytest.raises((AssertionError, RuntimeError, GraphedError)):
        distributed.build_ddp(nn.Linear(2, 2))


# --- the HF Trainer --------------------------------------------------------------

hf = pytest.importorskip("graphed.integrations.transformers",
                         reason="needs transformers: pip install transformers")


def test_trainer_under_ddp_runs_step_mode_only():
    # accelerate's MULTI_GPU at any world size (torchrun with one process too).
    for world_size in (1, 2):
        assert hf.training_blockers(device_type="cuda", world_size=world_size,
                                    distributed_type="MULTI_GPU") == []
    for kind in ("MULTI_CPU", "XLA", "MULTI_XPU"):
        (reason,) = hf.training_blockers(device_type="cuda", distributed_type=kind)
        assert "Expected one process on one GPU, or DistributedDataParallel" in reason
        assert kind in reason and "torchrun" in reason
    (modules,) = hf.modules_blockers(ddp=True)
    assert "mode='modules'" in modules and "Use mode='step'" in modules
    assert hf.modules_blockers(ddp=False) == []


@pytest.mark.parametrize("find_unused, static_graph, refused", [
    (None, None, True),     # the Trainer's default: find_unused_parameters=True
    (True, None, True),
    (True, True, False),    # static_graph: the unused set is recorded once
    (False, None, False),
])
def test_trainer_step_mode_needs_ddp_without_unused_parameter_search(find_unused, static_graph,
                                                                     refused):
    reasons = hf.step_blockers(optim="adamw_torch_fused", ddp=True,
                               ddp_find_unused_parameters=find_unused,
                               ddp_static_graph=static_graph)
    assert bool(reasons) == refused
    if refused:
        (reason,) = reasons
        assert "Expected ddp_find_unused_parameters=False" in reason
        assert "TrainingArguments(ddp_find_unused_parameters=False)" in reason
        assert ("unset" in reason) == (find_unused is None)
    # Without DDP the arguments do not matter.
    assert hf.step_blockers(optim="adamw_torch_fused", ddp_find_unused_parameters=True) == []


def test_choose_mode_under_ddp():
    ddp_modules = hf.modules_blockers(ddp=True)
    assert hf.choose_mode("step", "eager", [], [], ddp_modules) == ("step", [])
    assert hf.choose_mode("modules", "eager", [], [], ddp_modules) == ("eager", ddp_modules)
    # A refused step does not fall back to modules under DDP.
    mode, reasons = hf.choose_mode("step", "modules", [], ["find unused"], ddp_modules)
    assert mode == "eager" and reasons == ["find unused"] + ddp_modules
    with pytest.raises(GraphedError, match="mode='modules'"):
        hf.choose_mode("modules", "raise", [], [], ddp_modules)


def fake_trainer(distributed_type, **args):
    values = dict(device="cuda", n_gpu=1, world_size=1, torch_compile=False, optim="adamw_torch",
                  gradient_checkpointing=False, fp16=False, half_precision_backend="auto",
                  ddp_find_unused_parameters=None, ddp_static_graph=None)
    values.update(args)
    accelerator = types.SimpleNamespace(
        state=types.SimpleNamespace(distributed_type=distributed_type), parallelism_config=None)

    class Fake(hf._GraphedTrainerMixin, hf.Trainer):
        def __init__(self):  # no Trainer.__init__: only what trainer_blockers reads
            self.args = types.SimpleNamespace(**values)
            self.accelerator = accelerator
            self.optimizer = None
            self.optimizer_cls_and_kwargs = None

    return Fake()


def test_trainer_blockers_read_the_ddp_arguments():
    blockers = hf.trainer_blockers(fake_trainer("MULTI_GPU"))
    assert blockers["training"] == []
    assert any("ddp_find_unused_parameters" in r for r in blockers["step"])
    assert blockers["modules"] and "mode='modules'" in blockers["modules"][0]
    ok = hf.trainer_blockers(fake_trainer("MULTI_GPU", ddp_find_unused_parameters=False))
    assert ok == {"training": [], "step": [], "modules": blockers["modules"]}
    single = hf.trainer_blockers(fake_trainer("NO"))
    assert single == {"training": [], "step": [], "modules": []}


def test_trainer_prepares_ddp_on_the_capture_stream_only_under_multi_gpu():
    trainer = fake_trainer("NO")
    assert trainer._graphed_patch_prepare() is None
    trainer = fake_trainer("MULTI_GPU")
    trainer.accelerator.prepare_model = lambda model, *a, **k: model
    if not torch.cuda.is_available():
        assert trainer._graphed_patch_prepare() is None  # no capture stream without CUDA
        return
    before = trainer.accelerator.prepare_model
    undo = trainer._graphed_patch_prepare()
    assert trainer.accelerator.prepare_model is not before
    undo()
    assert trainer.accelerator.prepare_model is before


# --- Lightning ------------------------------------------------------------------

pl = pytest.importorskip("lightning.pytorch", reason="needs lightning: pip install lightning")
from graphed.integrations import lightning_step as gls  # noqa: E402

from lightning_models import CPUGraphs, MLPModule, regression_data, trainer  # noqa: E402


class DDPStrategy:
    """Stands in for Lightning's DDPStrategy (the name and what is read)."""

    def __init__(self, model, device="cuda:0"):
        self.model = model
        self.root_device = torch.device(device)
        self._ddp_kwargs = {}

    def _setup_model(self, model):
        return model


DDPStrategy.__name__ = "DDPStrategy"


def test_lightning_ddp_strategy_is_the_step_modes_only():
    strategy = DDPStrategy(nn.Linear(2, 2))
    fake = types.SimpleNamespace(strategy=strategy)
    assert gls.is_ddp_strategy(strategy)
    assert gls._device_problem(fake, ddp=True) is None
    problem = gls._device_problem(fake)
    assert "mode='modules' (graphed.auto) supports one device" in problem
    assert "CUDAGraphs(mode='step')" in problem
    other = types.SimpleNamespace(strategy=types.SimpleNamespace(
        root_device=torch.device("cuda:0")))
    assert "and DDP (strategy='ddp', mode='step')" in gls._device_problem(other, ddp=True)
    # The strategy's model must be DDP's wrapper.
    (reason,) = gls.ddp_problems(fake)
    assert "not a DistributedDataParallel" in reason
    assert gls.ddp_problems(other) == []


def test_lightning_ddp_problems_come_from_the_wrapper(gloo):
    fake = types.SimpleNamespace(strategy=DDPStrategy(small_ddp(find_unused_parameters=True)))
    reasons = gls.ddp_problems(fake)
    assert all(r.startswith("Cannot capture DistributedDataParallel's all-reduces: ")
               for r in reasons)
    text = " ".join(reasons)
    assert "'gloo' backend" in text and "find_unused_parameters=True" in text
    assert gls.ddp_wrapper(fake) is fake.strategy.model


def test_training_step_runs_through_the_ddp_wrapper(gloo):
    module = MLPModule()
    wrapper = nn.parallel.DistributedDataParallel(module)
    calls = []
    wrapper.register_forward_pre_hook(lambda m, args: calls.append(len(args)))
    recorder = gls.LogRecorder(1)
    adapter = gls.TrainingStepModule(module, recorder, (0,), wrapper)
    assert distributed.find_ddp([adapter]) == [wrapper]
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    loss = adapter((x, y))
    assert calls == [2]  # DDP's forward got (batch, batch_idx)
    assert "forward" not in module.__dict__  # the redirection put forward back
    expected = nn.functional.mse_loss(module.net(x), y)
    assert torch.allclose(loss, expected)
    loss.backward()
    assert all(p.grad is not None for p in module.parameters())
    assert "train_loss" in recorder.logged
    # Without a wrapper: training_step directly.
    direct = gls.TrainingStepModule(module, gls.LogRecorder(1), (0,))
    assert direct.wrapper is None and torch.allclose(direct((x, y)), expected)


def test_lightning_step_mode_refuses_gloo_ddp_in_a_fit_on_cpu():
    # The real DDPStrategy on the CPU (gloo, one process): step conditions
    # refuse its backend; the fit runs eagerly with the reasons.
    callback = CPUGraphs(mode="step")
    t, _ = trainer([callback], max_steps=3, strategy="ddp")
    # Lightning's DDP launcher sets WORLD_SIZE, RANK, MASTER_PORT ... in the
    # environment; left there they would make every later Trainer (accelerate
    # reads them) believe it runs distributed.
    environment = dict(os.environ)
    try:
        t.fit(MLPModule(), regression_data())
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)
    assert t.global_step == 3 and callback.report["active"] == "eager"
    text = " ".join(f["reason"] for f in callback.fallbacks)
    assert "'gloo' backend" in text and "backend='nccl'" in text
