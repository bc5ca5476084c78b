"""Today's architectures (small sizes of bench/zoo_modern_models.py: the
mixture-of-experts models of transformers, Mamba2, a Mamba2/attention/experts
hybrid, and a hand-written mixture of experts) in both setups of the second
zoo, bf16 parameters and fp32 master weights under bf16 autocast: TrainStep
and auto train them like eager, and the transformers experts are switched
to graphed's grouped GEMM where torch's would read its offsets on the host."""

import copy
import os
import sys

import pytest
import torch

import graphed
from graphed.train import batch_loss

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import zoo_modern_models  # noqa: E402

pytestmark = pytest.mark.gpu

TRANSFORMERS_MODELS = ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3", "mamba2",
                       "granite_moe_hybrid"]
STEPS = 4


def _entry(name, setup):
    if not name.startswith("handwritten_moe"):
        pytest.importorskip("transformers")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return zoo_modern_models.build(name, "test", setup)


def _autocast(setup):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=setup == "amp_bf16")


def _losses(model, entry, setup, steps=STEPS):
    optimizer = entry.make_optimizer(model)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        with _autocast(setup):
            loss = batch_loss(model, None, entry.batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().float())
    return torch.stack(losses)


def _tolerance(setup):
    # bf16 parameters: bf16 rounding of kernels chosen differently inside a graph.
    return 2e-2 if setup == "bf16" else 2e-3


@pytest.mark.parametrize("setup", zoo_modern_models.SETUPS)
@pytest.mark.parametrize("name", TRANSFORMERS_MODELS)
def test_trainstep_trains_like_eager(name, setup):
    # gpt-oss's eager attention mask is built without a host copy while
    # capturing: Note [An eager-attention mask a graph can hold].
    entry = _entry(name, setup)
    eager_model = copy.deepcopy(entry.model)
    expected = _losses(eager_model, entry, setup)
    model = copy.deepcopy(entry.model)
    step = graphed.TrainStep.from_parts(model, entry.make_optimizer(model), None, entry.batch,
                                        amp="bf16" if setup == "amp_bf16" else None)
    got = torch.stack([step(entry.batch).float() for _ in range(STEPS)])
    torch.testing.assert_close(got, expected, rtol=_tolerance(setup), atol=1e-3)
    experts = [m for m in model.modules() if hasattr(m, "has_gate")]
    if experts and setup == "amp_bf16":
        # fp32 experts: torch's grouped GEMM would read the offsets on the host.
        assert all(m.config._experts_implementation == "graphed_grouped_mm" for m in experts)
        assert any("graphed_grouped_mm" in note for note in step.notes), step.notes


@pytest.mark.parametrize("setup", zoo_modern_models.SETUPS)
@pytest.mark.parametrize("name", TRANSFORMERS_MODELS)
def test_auto_graphs_every_layer_and_trains_like_eager(name, setup):
    entry = _entry(name, setup)
    expected = _losses(copy.deepcopy(entry.model), entry, setup, steps=STEPS + 2)
    model = graphed.auto(copy.deepcopy(entry.model))
    got = _losses(model, entry, setup, steps=STEPS + 2)
    torch.testing.assert_close(got, expected, rtol=_tolerance(setup), atol=1e-3)
    stats = graphed.auto_stats(model)
    assert stats["replays"] > 0, stats
    assert not stats["fallbacks"], stats["fallbacks"]


@pytest.mark.parametrize("setup", zoo_modern_models.SETUPS)
def test_auto_graphs_the_parts_of_hand_written_moe_blocks_and_trains_like_eager(setup):
    # The blocks and their experts layers cannot be captured (nonzero/where
    # dispatch): their attention is graphed in their place, the experts (a
    # new token count every call) stay eager. Note [Graphing the parts of a
    # block]: blocks fall back at step 3, parts warm up in 4-6, replay from 7.
    entry = _entry("handwritten_moe", setup)
    steps = 10
    expected = _losses(copy.deepcopy(entry.model), entry, setup, steps=steps)
    model = graphed.auto(copy.deepcopy(entry.model))
    got = _losses(model, entry, setup, steps=steps)
    torch.testing.assert_close(got, expected, rtol=_tolerance(setup), atol=1e-3)
    stats = graphed.auto_stats(model)
    parts = stats["parts"]
    assert "nonzero" in parts["blocks.0"]["eager_because"], parts
    assert "blocks.0.attn" in parts["blocks.0"]["graphed"], parts
    assert stats["modules"]["blocks.0.attn"]["replays"] >= 3, stats["modules"]
    assert "blocks.0.moe" in parts["blocks.0"]["eager"], parts
    # An expert graphs while its token count holds (bf16 routing of a random
    # init can send every token to the same experts) and stays eager once it
    # changes.
    eager_experts = parts["blocks.0.moe"]["eager"]
    for name, why in eager_experts.items():
        assert any(text in why for text in ("different shapes", "no replay yet",
                                            "recorded order")), (name, why)
    if setup == "amp_bf16":
        assert any("different shapes" in why for why in eager_experts.values()), eager_experts
    assert any("blocks.0.attn" in g["modules"] and not g["failure"]
               for g in stats["training_groups"]), stats["training_groups"]
    graphed.auto_undo(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_optimize_reports_the_parts_it_graphed_in_hand_written_moe_blocks():
    entry = _entry("handwritten_moe", "bf16")
    model = copy.deepcopy(entry.model)
    report = graphed.optimize(model, entry.make_optimizer(model), None, sample_batch=entry.batch,
                              progress=False, force=True)
    assert report.applied, report.reason
    assert report.strategy == "per_block", report.reason
    assert "blocks.0.attn" in report.parts["blocks.0"]["graphed"], report.parts
    assert any("blocks.*.attn" in note for note in report.notes), report.notes
    assert "parts" in report.to_dict()
    # Note [Work in graphs and work launched eagerly]: the attention graphs
    # hold some of the step's GPU work, the experts' loop launches the rest.
    work = report.graphed_work
    assert 0 < work["in_graphs"] < work["activities_per_step"], work
    assert any("GPU activities per step" in note for note in report.notes), report.notes


@pytest.mark.parametrize("setup", zoo_modern_models.SETUPS)
def test_the_hand_written_moe_dispatched_at_fixed_sizes_captures_whole(setup):
    # SortedDispatchMoE: handwritten_moe's parameters and routing, its
    # experts run through graphed.moe.grouped_mm. It computes what the loop
    # over experts computes, and the whole step is one graph.
    loop, sorted_ = _entry("handwritten_moe", setup), _entry("handwritten_moe_sorted", setup)
    sorted_.model.load_state_dict(loop.model.state_dict())
    with torch.no_grad(), _autocast(setup):
        want = loop.model(**loop.batch).loss
        got = sorted_.model(**sorted_.batch).loss
    torch.testing.assert_close(got.float(), want.float(), rtol=_tolerance(setup), atol=1e-3)
    expected = _losses(copy.deepcopy(sorted_.model), sorted_, setup)
    model = copy.deepcopy(sorted_.model)
    step = graphed.TrainStep.from_parts(model, sorted_.make_optimizer(model), None,
                                        sorted_.batch,
                                        amp="bf16" if setup == "amp_bf16" else None)
    got = torch.stack([step(sorted_.batch).float() for _ in range(STEPS)])
    torch.testing.assert_close(got, expected, rtol=_tolerance(setup), atol=1e-3)


def test_graphed_experts_match_transformers_grouped_mm_in_fp32():
    pytest.importorskip("transformers")
    entry = _entry("qwen3_moe", "amp_bf16")  # fp32 parameters
    reference = copy.deepcopy(entry.model)
    model = copy.deepcopy(entry.model)
    from graphed.integrations.transformers_experts import use_graphed_experts
    assert use_graphed_experts(model)
    with torch.no_grad():
        want = reference(input_ids=entry.batch["input_ids"]).logits
        got = model(input_ids=entry.batch["input_ids"]).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_optimize_captures_gpt_oss_whole_with_its_eager_attention_mask():
    # transformers builds gpt-oss's eager attention mask with a host-to-device
    # copy of a scalar (masking_utils.eager_mask), which sent optimize to
    # per-block graphs: Note [An eager-attention mask a graph can hold].
    entry = _entry("gpt_oss", "amp_bf16")
    model = copy.deepcopy(entry.model)
    report = graphed.optimize(model, entry.make_optimizer(model), None, sample_batch=entry.batch,
                              amp="bf16", progress=False, force=True)
    assert report.applied, report.reason
    assert report.strategy == "full_capture", report.reason
