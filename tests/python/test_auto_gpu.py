"""graphed.auto on a GPU: per-layer graphs equal eager over changing batch
sizes (with and without buckets), eviction under a small budget, fallbacks of
a block that cannot be captured, and training loops whose outputs and
gradients equal eager: a small GPT, a block that cannot be captured, backward
passes in another order than reversed, and a block called twice per step."""

import copy

import pytest
import torch
from torch import nn

import graphed
from graphed import workloads

pytestmark = pytest.mark.gpu

BATCHES = tuple(range(1, 65))


def small_decoder():
    workloads.configure_numerics()
    torch.manual_seed(0)
    model = workloads.Decoder(width=128, heads=4, layers=3, max_batch=64, length=32).eval()
    return model


@pytest.fixture(autouse=True)
def exact_fp32():
    """TF32 off: padded buckets run matmuls of other shapes than eager, and with
    TF32 their rounding differs by ~1e-4; in fp32 by ~1e-7."""
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def assert_equal_to_eager(managed, reference, batches, cycles=2, buckets=None):
    """Outputs equal eager's. A padded bucket runs its matmuls and attention at
    the bucket's row count, where cuBLAS and SDPA may pick other kernels than
    at the call's (torch_buckets shows the same 6e-4 on the decode bench); so
    a padded call is compared exactly with eager at the bucket size (rows are
    independent: the padding does not change the real rows), and loosely
    with eager at the call's size."""
    with torch.no_grad():
        for _ in range(cycles):
            for batch in batches:
                x = torch.randn(batch, 128, device="cuda")
                got = managed(x)
                assert got.shape == (batch, 128)
                if buckets is None:
                    torch.testing.assert_close(got, reference(x), rtol=1e-5, atol=1e-5)
                    continue
                size = min(s for s in buckets if s >= batch)
                padded = torch.cat([x, x.new_zeros(size - batch, 128)])
                torch.testing.assert_close(got, reference(padded)[:batch], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(got, reference(x), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("buckets", [None, {0: [1, 2, 4, 8, 16, 32, 64]}])
def test_batch_sizes_cycling_through_1_to_64_equal_eager(buckets):
    reference = small_decoder()
    managed = graphed.auto(workloads.decode_copy(reference), warmup=2, buckets=buckets)
    assert_equal_to_eager(managed, reference, BATCHES,
                          buckets=None if buckets is None else buckets[0])
    stats = managed.stats()
    assert list(stats["modules"]) == ["blocks.0", "blocks.1", "blocks.2"]
    assert stats["order"] == ["blocks.0", "blocks.1", "blocks.2"]
    assert stats["fallbacks"] == [], stats["fallbacks"]
    assert stats["warmup_calls"] == 3 * 2
    assert stats["replays"] == 3 * (2 * len(BATCHES) - 2)
    # Without buckets one graph per layer and size; with them one per layer and bucket,
    # all captured ahead, largest first, on each layer's first capture.
    assert stats["graphs"] == 3 * (len(BATCHES) if buckets is None else 7)
    assert stats["captures"] == stats["graphs"]
    assert stats["graph_memory_bytes"] > 0
    assert stats["pool_reserved_bytes"] > 0
    assert all(module["state"] == "graphed" for module in stats["modules"].values())


def test_outputs_follow_parameter_updates():
    reference = small_decoder()
    managed = graphed.auto(workloads.decode_copy(reference), warmup=1)
    x = torch.randn(5, 128, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            managed(x)
        for model in (managed, reference):
            model.blocks[1].fc2.weight.mul_(0.5)
        torch.testing.assert_close(managed(x), reference(x), rtol=1e-5, atol=1e-5)
    assert managed.stats()["replays"] == 3 * 3


def test_eviction_under_a_small_budget_keeps_working():
    reference = small_decoder()
    # One graph per size (no picked buckets): what the budget evicts is exact.
    unlimited = graphed.auto(workloads.decode_copy(reference), warmup=1, buckets=None)
    sizes = (1, 7, 19, 33, 64)
    assert_equal_to_eager(unlimited, reference, sizes, cycles=2)
    total = unlimited.stats()["graph_memory_bytes"]
    assert total > 0

    budget = total - 1  # one graph too many: the least recently used one goes
    limited = graphed.auto(workloads.decode_copy(reference), warmup=1, memory_budget=budget,
                           buckets=None)
    assert_equal_to_eager(limited, reference, sizes, cycles=3)
    stats = limited.stats()
    assert stats["evictions"] >= 1
    assert stats["graph_memory_bytes"] <= budget
    assert stats["memory_budget_bytes"] == budget
    assert stats["fallbacks"] == []


def test_budget_smaller_than_one_graph_says_how_to_fix_it():
    managed = graphed.auto(workloads.decode_copy(small_decoder()), warmup=1, memory_budget="1KiB")
    x = torch.randn(4, 128, device="cuda")
    with torch.no_grad():
        managed(x)
        with pytest.raises(graphed.GraphedError, match=r"memory_budget=1.0 KiB is smaller than one "
                                                       r"graph: module `blocks.0` \(DecodeBlock\)"
                                                       r" holds .*Raise memory_budget to at least"):
            managed(x)


def test_uncovered_size_falls_back_and_raise_raises():
    reference = small_decoder()
    managed = graphed.auto(workloads.decode_copy(reference), warmup=1, buckets={0: [8, 16]})
    assert_equal_to_eager(managed, reference, (3, 16, 40), cycles=2)
    fallbacks = managed.stats()["fallbacks"]
    assert [f["module"] for f in fallbacks] == ["blocks.0", "blocks.1", "blocks.2"]
    assert all(f["count"] == 2 for f in fallbacks)
    assert "Add a bucket of at least 40 to buckets[0]" in fallbacks[0]["reason"]

    strict = graphed.auto(workloads.decode_copy(reference), warmup=1, buckets={0: [8, 16]},
                          fallback="raise")
    with torch.no_grad():
        strict(torch.randn(3, 128, device="cuda"))
        with pytest.raises(graphed.GraphedError, match="above the largest bucket 16"):
            strict(torch.randn(40, 128, device="cuda"))


class ItemBlock(nn.Module):
    """A block whose forward reads a value to the host: it cannot be captured."""

    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        scale = x.abs().amax().item() + 1.0
        return x + self.fc(x) / scale


class SyncBlock(nn.Module):
    """Synchronizes the device from Python: auto's warm-up check sees it through the
    host-call shims every check pass runs in (graphed.check's _run_pass)."""

    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        torch.cuda.synchronize()
        return x + self.fc(x)


_synchronize = torch.cuda.synchronize  # bound before any check: the shims cannot see it


class HiddenSyncBlock(nn.Module):
    """Synchronizes through a name bound at import, which graphed.check cannot see
    (its documented limit): the capture fails, and that is the fallback's reason."""

    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        _synchronize()
        return x + self.fc(x)


BAD_BLOCKS = [
    (ItemBlock, "graphed.check found a host read, `aten::item`"),
    (SyncBlock, "graphed.check found an explicit synchronization, `torch.cuda.synchronize`"),
    (HiddenSyncBlock, "capture failed"),
]


class PlainBlock(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.relu(self.fc(x))


class Stack(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("bad, reason", BAD_BLOCKS)
def test_a_block_that_cannot_be_captured_runs_eagerly_and_the_rest_stay_graphed(bad, reason):
    torch.manual_seed(0)
    blocks = [PlainBlock(64), bad(64), PlainBlock(64)]
    # Same class for all, as selection wants repeated blocks: choose them by name.
    reference = Stack(blocks).cuda()
    managed = graphed.auto(copy.deepcopy(reference), modules=["blocks.0", "blocks.1", "blocks.2"],
                           warmup=2)
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        for _ in range(5):
            torch.testing.assert_close(managed(x), reference(x), rtol=1e-5, atol=1e-5)
    stats = managed.stats()
    assert stats["modules"]["blocks.0"]["state"] == "graphed"
    assert stats["modules"]["blocks.2"]["state"] == "graphed"
    assert stats["modules"]["blocks.0"]["replays"] == 3
    assert stats["modules"]["blocks.1"]["state"] == "eager"
    (fallback,) = stats["fallbacks"]
    assert fallback["module"] == "blocks.1"
    assert reason in fallback["reason"], fallback["reason"]
    if bad is ItemBlock:
        assert "test_auto_gpu.py" in fallback["reason"]
    # The failed capture left the process usable: random numbers and allocations work.
    torch.randn(4, device="cuda").sum().item()


def test_training_loop_of_a_small_gpt_equals_eager():
    workloads.configure_numerics()
    torch.backends.cuda.matmul.allow_tf32 = False  # exact comparison of gradients
    try:
        base, tokens, targets = workloads.gpt_train(batch=2, length=32, vocab=256)
        eager_model = copy.deepcopy(base)
        managed = graphed.auto(copy.deepcopy(base), warmup=2)
        eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3)
        managed_opt = torch.optim.AdamW(managed.parameters(), lr=1e-3)
        for _ in range(6):
            for model, optimizer in ((eager_model, eager_opt), (managed, managed_opt)):
                optimizer.zero_grad(set_to_none=False)
                loss = workloads.gpt_loss(model(tokens), targets)
                loss.backward()
                model.last_loss = loss.detach()
            torch.testing.assert_close(managed.last_loss, eager_model.last_loss,
                                       rtol=1e-5, atol=1e-5)
            for p, q in zip(managed.parameters(), eager_model.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
            eager_opt.step()
            managed_opt.step()
        stats = managed.stats()
        assert stats["fallbacks"] == [], stats["fallbacks"]
        assert stats["replays"] == 6 * 4
        # Every layer's graphs were captured together, in the recorded order,
        # into one pool (Note [Training graphs captured together]).
        (group,) = stats["training_groups"]
        layers = len(managed.blocks)
        assert group["modules"] == [f"blocks.{i}" for i in range(layers)]
        assert group["order"] == list(range(1, layers + 1)) + list(range(-layers, 0))
        assert group["failure"] is None and group["left_out"] == []
        assert group["pool_reserved_bytes"] > 0
    finally:
        torch.backends.cuda.matmul.allow_tf32 = True


def train_side_by_side(reference, managed, step, steps=6):
    """Runs `step(model)` (forward and backward) on both models with SGD and
    checks that gradients and parameters stay equal."""
    eager_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    managed_opt = torch.optim.SGD(managed.parameters(), lr=0.1)
    for _ in range(steps):
        for model, optimizer in ((reference, eager_opt), (managed, managed_opt)):
            optimizer.zero_grad(set_to_none=False)
            step(model)
        for p, q in zip(managed.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
        eager_opt.step()
        managed_opt.step()


@pytest.mark.parametrize("bad, reason", BAD_BLOCKS)
def test_training_with_a_block_that_cannot_be_captured_graphs_the_others(bad, reason):
    torch.manual_seed(0)
    reference = Stack([PlainBlock(64), bad(64), PlainBlock(64)]).cuda()
    managed = graphed.auto(copy.deepcopy(reference), modules=["blocks.0", "blocks.1", "blocks.2"],
                           warmup=2)
    x = torch.randn(8, 64, device="cuda")
    train_side_by_side(reference, managed, lambda model: model(x).square().mean().backward())
    stats = managed.stats()
    assert stats["modules"]["blocks.0"]["state"] == "graphed"
    assert stats["modules"]["blocks.2"]["state"] == "graphed"
    assert stats["modules"]["blocks.0"]["replays"] == 4
    assert stats["modules"]["blocks.1"]["state"] == "eager"
    (fallback,) = stats["fallbacks"]
    assert fallback["module"] == "blocks.1" and reason in fallback["reason"], fallback
    (group,) = stats["training_groups"]
    if bad is not HiddenSyncBlock:
        # Found during warm-up: never recorded, the others captured together.
        assert group["modules"] == ["blocks.0", "blocks.2"]
        assert group["order"] == [1, 2, -2, -1]
    else:
        # Found by the group's capture: each is then captured on its own.
        assert "blocks.1" in group["modules"] and group["failure"], group
    torch.randn(4, device="cuda").sum().item()


class TwoHeads(nn.Module):
    """Two branches with losses of their own, backpropagated one after the
    other: branch 0's backward runs before branch 1's."""

    def __init__(self, width):
        super().__init__()
        self.branches = nn.ModuleList([PlainBlock(width), PlainBlock(width)])

    def forward(self, x):
        return [branch(x) for branch in self.branches]


def test_backward_passes_recorded_in_the_order_they_ran():
    torch.manual_seed(0)
    reference = TwoHeads(64).cuda()
    managed = graphed.auto(copy.deepcopy(reference), warmup=2)
    x = torch.randn(8, 64, device="cuda")

    def step(model):
        first, second = model(x)
        first.square().mean().backward()
        second.abs().mean().backward()

    train_side_by_side(reference, managed, step)
    stats = managed.stats()
    assert stats["fallbacks"] == []
    (group,) = stats["training_groups"]
    assert group["modules"] == ["branches.0", "branches.1"]
    assert group["order"] == [1, 2, -1, -2]


class Twice(nn.Module):
    """One block applied twice per step (weight tying)."""

    def __init__(self, width):
        super().__init__()
        self.blocks = nn.ModuleList([PlainBlock(width), PlainBlock(width)])

    def forward(self, x):
        x = self.blocks[0](x)
        return self.blocks[1](self.blocks[1](x))


def test_a_block_called_twice_per_step_replays_once_and_runs_eagerly_once():
    torch.manual_seed(0)
    reference = Twice(64).cuda()
    managed = graphed.auto(copy.deepcopy(reference), warmup=2)
    x = torch.randn(8, 64, device="cuda")
    train_side_by_side(reference, managed, lambda model: model(x).square().mean().backward())
    stats = managed.stats()
    # The second call of a step would overwrite what the first call's pending
    # backward reads: it runs eagerly and says why.
    assert len(stats["fallbacks"]) == 1, stats["fallbacks"]
    (fallback,) = stats["fallbacks"]
    assert fallback["module"] == "blocks.1"
    assert "called out of its graphs' recorded order" in fallback["reason"], fallback
    assert stats["modules"]["blocks.0"]["replays"] == 4  # steps 3 to 6
    assert stats["modules"]["blocks.1"]["replays"] == fallback["count"] == 5


def _hf_entry(name):
    import os
    import sys

    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    import zoo_models

    return zoo_models.build(name, "test")


def _logits(out):
    return out.logits if hasattr(out, "logits") else out[0]


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama", "hf_bert"])
def test_transformers_layers_bucket_with_their_broadcast_inputs(name):
    """transformers hands every layer position ids, rotary tables or masks of
    batch size 1: they pass unpadded (Note [Bucket padding]), so every layer
    replays a bucket's graph at every batch size and matches eager."""
    entry = _hf_entry(name)
    reference = copy.deepcopy(entry.model).eval()
    managed = graphed.auto(copy.deepcopy(entry.model).eval(), buckets={0: [1, 2, 4, 8]})
    sizes = (1, 3, 8, 5, 2, 7, 4, 6)
    with torch.no_grad():
        for _ in range(2):
            for batch in sizes:
                args, kwargs = entry.inference_inputs(batch)
                torch.testing.assert_close(_logits(managed(*args, **kwargs)),
                                           _logits(reference(*args, **kwargs)),
                                           rtol=1e-4, atol=1e-4)
    stats = managed.stats()
    assert stats["fallbacks"] == [], stats["fallbacks"]
    layers = len(stats["modules"])
    assert stats["graphs"] == 4 * layers  # one per bucket and layer, nothing twice
    assert all(m["replays"] > 0 for m in stats["modules"].values())


def test_auto_picks_buckets_when_batch_sizes_vary_and_memory_stays_bounded():
    """Note [Buckets graphed picks itself]: the default (buckets="auto") keeps
    about log2(64) graphs per layer over 64 batch sizes, not 64, and says so."""
    reference = small_decoder()
    managed = graphed.auto(workloads.decode_copy(reference), warmup=2)
    with torch.no_grad():
        for batch in BATCHES:
            x = torch.randn(batch, 128, device="cuda")
            torch.testing.assert_close(managed(x), reference(x), rtol=1e-3, atol=1e-3)
    stats = managed.stats()
    assert stats["fallbacks"] == []
    assert stats["graphs"] <= 3 * 7, stats["graphs"]
    assert any("pads them to power-of-two sizes along dimension 0" in n for n in stats["notes"])
    unbounded = graphed.auto(workloads.decode_copy(reference), warmup=2, buckets=None)
    with torch.no_grad():
        for batch in BATCHES:
            unbounded(torch.randn(batch, 128, device="cuda"))
    assert unbounded.stats()["graphs"] == 3 * (len(BATCHES) - 2)


class BatchNormalized(nn.Module):
    """Rows along dimension 0 depend on each other: padding would change them."""

    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        h = self.fc(x)
        return h - h.mean(0, keepdim=True)


def test_picked_buckets_that_change_results_are_refused():
    torch.manual_seed(0)
    reference = Stack([BatchNormalized(64), BatchNormalized(64)]).cuda().eval()
    managed = graphed.auto(copy.deepcopy(reference), warmup=1)
    with torch.no_grad():
        for batch in (3, 3, 5, 6, 7, 9, 11, 7, 9):
            x = torch.randn(batch, 64, device="cuda")
            torch.testing.assert_close(managed(x), reference(x), rtol=1e-5, atol=1e-5)
    notes = managed.stats()["notes"]
    assert sum("did not match eager" in n for n in notes) == 2, notes


def test_a_block_that_can_never_be_graphed_gets_its_own_forward_back():
    """Note [A fallback costs nothing]: after the call that finds it blocked,
    none of its calls runs graphed code."""
    torch.manual_seed(0)
    reference = Stack([PlainBlock(64), ItemBlock(64), PlainBlock(64)]).cuda()
    managed = graphed.auto(copy.deepcopy(reference), modules=["blocks.0", "blocks.1", "blocks.2"],
                           warmup=2)
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        for _ in range(6):
            torch.testing.assert_close(managed(x), reference(x), rtol=1e-5, atol=1e-5)
    stats = managed.stats()
    assert stats["modules"]["blocks.1"].get("own_forward") is True
    assert "forward" not in managed.blocks[1].__dict__
    assert stats["modules"]["blocks.1"]["calls"] == 3  # two warm-ups, the call that found it
    assert stats["modules"]["blocks.0"]["replays"] == 4
