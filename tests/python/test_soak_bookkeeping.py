"""bench/soak.py's bookkeeping on the CPU (no GPU needed): replay counting,
warm-up and sampling, the eager comparisons, the record and its "ok" verdict,
with eager stand-ins for the graph APIs (the real run is
``python bench/run.py soak`` on a GPU)."""

import importlib.util
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class FakeCaptured:
    """graphed.capture's CapturedFunction, run eagerly."""

    def __init__(self, fn, *args, input_update="copy", **kwargs):
        self.fn, self.replays = fn, 0
        self.static_inputs = [a.clone() for a in args]

    def __call__(self, *args):
        self.replays += 1
        return self.fn(*args)

    def stats(self):
        return {"replays": self.replays, "input_copies": self.replays, "input_repoints": 0,
                "repointable_inputs": 0}


class FakeTrainStep:
    """graphed.TrainStep.from_parts, run eagerly with the optimizer it gets."""

    def __init__(self, model, optimizer, loss_fn):
        self.model, self.optimizer, self.loss_fn, self.steps = model, optimizer, loss_fn, 0

    @classmethod
    def from_parts(cls, model, optimizer, loss_fn, sample_batch, **options):
        return cls(model, optimizer, loss_fn)

    def __call__(self, batch):
        self.steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(batch[0]), batch[1])
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def stats(self):
        return {"steps": self.steps}

    def release(self):
        pass


def fake_auto(model, warmup=1, buckets=None, memory_budget=None):
    counters = {"replays": 0}
    forward = model.forward

    def counted(x):
        counters["replays"] += len(model.blocks)
        return forward(x)

    model.forward = counted
    model.stats = lambda: {"replays": counters["replays"], "graph_memory_bytes": 1000,
                           "evictions": 3, "captures": 9, "graphs": 5, "fallback_calls": 0}
    return model


@pytest.fixture
def soak(monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        spec = importlib.util.spec_from_file_location("soak_under_test",
                                                      os.path.join(ROOT, "bench", "soak.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))
    graphed = module.graphed
    monkeypatch.setattr(module, "DEVICE", "cpu")
    monkeypatch.setattr(module, "WIDTH", 16)
    monkeypatch.setattr(module, "BATCH", 4)
    monkeypatch.setattr(graphed, "capture", FakeCaptured)
    monkeypatch.setattr(graphed, "make_graphed_callables", lambda model, sample: model)
    monkeypatch.setattr(graphed, "graph_stats", lambda layer: {
        "forward_replays": layer.calls, "backward_replays": layer.calls, "eager_calls": 0})
    monkeypatch.setattr(graphed, "TrainStep", FakeTrainStep)
    monkeypatch.setattr(graphed, "auto", fake_auto)
    monkeypatch.setattr(graphed, "make_capturable", lambda optimizer: optimizer)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 0)
    # make_graphed_callables' stand-in counts calls on the module itself.
    make_mlp = module.mlp

    def counting_mlp():
        model = make_mlp()
        model.calls = 0
        hook = model.register_forward_pre_hook(
            lambda m, args: setattr(m, "calls", m.calls + 1))
        model._soak_hook = hook
        return model

    monkeypatch.setattr(module, "mlp", counting_mlp)
    return module


def test_every_api_records_replays_memory_and_diffs(soak):
    record = soak.run(quick=True)
    assert set(record["apis"]) == {"capture", "capture_repoint", "make_graphed_callables",
                                   "train_step", "auto"}
    for api, result in record["apis"].items():
        assert "error" not in result, (api, result.get("error"))
        assert result["replays"] >= soak.QUICK_REPLAYS, (api, result["replays"])
        assert result["samples"] == soak.SAMPLES, api
        assert result["allocated_growth_mb"] == 0 and result["reserved_growth_mb"] == 0
        assert result["max_abs_diff_vs_eager"] <= soak.DIFF_LIMIT, (api, result)
        assert result["ok"] or api == "auto", (api, result)
    auto = record["apis"]["auto"]
    assert auto["memory_budget_bytes"] == 999 and auto["evictions"] == 3
    # The stand-in reports 1000 bytes of graphs against a budget of 999: not ok.
    assert auto["within_budget"] is False and auto["ok"] is False
    assert record["ok"] is False
    lines = soak.markdown(record)
    assert len(lines) == 2 + 5


def test_a_failing_api_is_recorded_and_the_others_still_run(soak, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("capture broke")

    monkeypatch.setattr(soak.graphed, "capture", broken)
    record = soak.run(quick=True)
    assert "capture broke" in record["apis"]["capture"]["error"]
    assert record["apis"]["capture"]["ok"] is False
    assert record["apis"]["train_step"]["ok"]
    assert "FAILED: RuntimeError: capture broke" in "\n".join(soak.markdown(record))
