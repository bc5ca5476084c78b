"""graphed optimize's compiled candidate (Note [A compiled candidate]): the
compile argument, the decision of compile="auto" from the advice, and the time
limit. CPU tier: no compile runs here; the GPU tier builds candidates."""

import time

import pytest
import torch

import graphed
from graphed._compiled import (AUTO_GAIN, CompileTimeout, time_limit, torch_compile_options,
                               worth_compiling)


@pytest.mark.parametrize("compile, expected", [
    (False, ("off", None)), (None, ("off", None)), (True, ("on", {})), ("auto", ("auto", {})),
    ({"mode": "max-autotune-no-cudagraphs"}, ("on", {"mode": "max-autotune-no-cudagraphs"})),
])
def test_compile_choices(compile, expected):
    assert torch_compile_options(compile, "training step", allow_auto=True) == expected


@pytest.mark.parametrize("compile, needle", [
    ("yes", 'Expected compile=True, False, "auto" or a dict'),
    ({"mode": "reduce-overhead"}, "graphed captures the training step itself"),
    ({"options": {"triton.cudagraphs": True}}, "records no CUDA graphs of its own"),
    ({"cudagraphs": True}, "got cudagraphs"),
])
def test_compile_settings_that_cannot_work_are_refused_before_anything_runs(compile, needle):
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(graphed.GraphedError, match=needle):
        graphed.optimize(model, optimizer, torch.nn.functional.mse_loss,
                         sample_batch=(torch.ones(2, 4), torch.ones(2, 4)), compile=compile)


def test_auto_is_not_for_generate():
    with pytest.raises(graphed.GraphedError, match="Expected compile=True, False or a dict"):
        torch_compile_options("auto", "decode step")


def test_compile_settings_are_checked_for_inference_too():
    with pytest.raises(graphed.GraphedError, match="records no CUDA graphs of its own"):
        graphed.optimize(torch.nn.Linear(4, 4), sample_batch=torch.ones(2, 4),
                         compile={"mode": "reduce-overhead"})


class _Advice:
    def __init__(self, graphed_ms, compiled_ms):
        self.predicted_ms = graphed_ms
        self._compiled = {"predicted_ms": compiled_ms, "fusible_ms": 1.0}

    def to_dict(self):
        return {"compiled": self._compiled}


def test_auto_builds_the_candidate_only_where_the_prediction_pays():
    build, why = worth_compiling("auto", _Advice(10.0, 10.0 * AUTO_GAIN - 0.01))
    assert build and "predicted" in why
    build, why = worth_compiling("auto", _Advice(10.0, 10.0 * AUTO_GAIN + 0.01))
    assert not build and why.startswith("not built: predicted")
    assert worth_compiling("on", _Advice(1.0, 5.0))[0]
    assert not worth_compiling("off", _Advice(5.0, 1.0))[0]


def test_time_limit_interrupts_the_block():
    started = time.perf_counter()
    with pytest.raises(CompileTimeout, match="took longer than compile_timeout=0.2 s"):
        with time_limit(0.2, "building the compiled training step"):
            while time.perf_counter() - started < 5:
                pass
    assert time.perf_counter() - started < 2
    with time_limit(None, "nothing"):  # no limit
        pass
