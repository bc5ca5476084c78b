"""Models nobody here wrote (transformers, timm, torchvision; random init from
configs, small sizes of bench/zoo_models.py), as users meet graphed: optimize
applies and matches eager, auto trains them without falling back, capture
serves them and keeps their output types."""

import copy
import inspect
import os
import sys

import pytest
import torch

import graphed
from graphed import fp8
from graphed.train import batch_loss

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import zoo_models  # noqa: E402

pytestmark = pytest.mark.gpu

MODELS = list(zoo_models.BUILDERS)


def _needs(library):
    pytest.importorskip({"transformers": "transformers", "timm": "timm",
                         "torchvision": "torchvision"}[library])


def _entry(name, fp8_layers=False):
    library = {"hf": "transformers", "timm": "timm", "tv": "torchvision"}[name.split("_")[0]]
    _needs(library)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    entry = zoo_models.build(name, "test")
    if fp8_layers:
        if torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("needs a GPU with FP8 tensor cores (compute capability 8.9 or newer)")
        fp8.convert(entry.model)
        assert len(fp8.float8_layers(entry.model)) >= 4, fp8.skipped_layers(entry.model)
    return entry


def _eager_losses(entry, model, steps):
    optimizer = entry.make_optimizer(model)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = batch_loss(model, entry.loss_fn, entry.batch)
        loss.backward()
        fp8.update_scales(model)  # a no-op without FP8 layers
        optimizer.step()
        losses.append(loss.detach().float())
    return torch.stack(losses)


# Transformers converted to FP8 (graphed.fp8.convert, delayed scaling), as
# their users would: TrainStep and auto train them like the eager FP8 loop.
# The ViTs' 17 tokens per image exercise Note [Token counts that are not
# multiples of 16].
FP8_MODELS = ["hf_llama", "hf_bert", "hf_t5", "hf_vit", "timm_vit_s16"]
TRAINING = ([pytest.param(name, False, id=name) for name in MODELS]
            + [pytest.param(name, True, id=f"{name}-fp8") for name in FP8_MODELS])


@pytest.mark.parametrize("name", MODELS)
def test_optimize_applies_and_matches_eager(name):
    entry = _entry(name)
    model = copy.deepcopy(entry.model)
    before = [p.detach().clone() for p in model.parameters()]
    report = graphed.optimize(model, entry.make_optimizer(model), entry.loss_fn,
                              sample_batch=entry.batch, force=True)
    assert report.applied, str(report)
    assert report.strategy == "full_capture", str(report)
    assert report.max_abs_diff is not None
    # optimize verified and then restored the weights it was given.
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)
    if "use_cache" in inspect.signature(type(model).forward).parameters:
        assert any("use_cache=False" in note for note in report.notes), report.notes
    # The advice predicts what was captured: nothing the trial capture met counts.
    assert report.advice.strategy == "full_capture"
    assert not report.advice.blockers, report.advice.blockers


@pytest.mark.parametrize("name,fp8_layers", TRAINING)
def test_trainstep_losses_follow_eager(name, fp8_layers):
    entry = _entry(name, fp8_layers)
    reference = copy.deepcopy(entry.model)
    model = copy.deepcopy(entry.model)
    rng = torch.cuda.get_rng_state()
    expected = _eager_losses(entry, reference, 4)
    torch.cuda.set_rng_state(rng)
    step = graphed.TrainStep.from_parts(model, entry.make_optimizer(model), entry.loss_fn,
                                        entry.batch)
    got = torch.stack([step(entry.batch).float() for _ in range(4)])
    torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3)
    # The replays advanced the FP8 scaling state as the eager steps did.
    for (key, value), want in zip(model.state_dict().items(), reference.state_dict().values()):
        if key.endswith("fp8_history_slot"):
            assert torch.equal(value, want), key


@pytest.mark.parametrize("name,fp8_layers", TRAINING)
def test_auto_trains_every_block_with_graphs(name, fp8_layers):
    entry = _entry(name, fp8_layers)
    reference = copy.deepcopy(entry.model)
    model = graphed.auto(copy.deepcopy(entry.model))
    rng = torch.cuda.get_rng_state()
    expected = _eager_losses(entry, reference, 6)
    torch.cuda.set_rng_state(rng)
    got = _eager_losses(entry, model, 6)
    stats = graphed.auto_stats(model)
    assert stats["fallbacks"] == [], stats["fallbacks"]
    assert stats["replays"] > 0, stats
    torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("name", MODELS)
def test_capture_serves_inference_with_the_models_output_type(name):
    entry = _entry(name)
    model = copy.deepcopy(entry.model).eval()
    args, kwargs = entry.inference_inputs(3)
    with torch.no_grad():
        expected = model(*args, **kwargs)
        fast = graphed.capture(model, *args, sample_kwargs=kwargs)
        args2, kwargs2 = entry.inference_inputs(3)
        got = fast(*args2, **kwargs2)
        expected2 = model(*args2, **kwargs2)
    assert type(got) is type(expected)
    if isinstance(expected, dict):
        assert list(got.keys()) == list(expected.keys())
        for key in expected:
            torch.testing.assert_close(got[key], expected2[key], rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(got, expected2, rtol=1e-4, atol=1e-4)


def test_auto_falls_back_on_a_key_value_cache_with_the_reason():
    """Inference calls that hand every layer a DynamicCache run eagerly, counted
    with the reason: a replay would not append to the cache."""
    entry = _entry("hf_gpt2")
    model = graphed.auto(copy.deepcopy(entry.model).eval(), warmup=1)
    ids = entry.batch["input_ids"][:, :8]
    with torch.no_grad():
        for _ in range(3):
            out = model(input_ids=ids, use_cache=True)
    assert out.past_key_values is not None
    reasons = [f["reason"] for f in graphed.auto_stats(model)["fallbacks"]]
    assert reasons and all("key/value cache" in r for r in reasons), reasons


def test_auto_turns_the_cache_off_in_training_and_says_so():
    entry = _entry("hf_llama")
    model = graphed.auto(copy.deepcopy(entry.model))
    _eager_losses(entry, model, 5)
    stats = graphed.auto_stats(model)
    assert any("use_cache=False" in note for note in stats["notes"])
    assert stats["fallbacks"] == []
    assert all(m["replays"] > 0 for m in stats["modules"].values()), stats["modules"]
