"""graphed.auto on CPU: module selection, argument validation and its messages,
and the fallbacks that need no GPU (training calls, capture blockers)."""

import sys

import pytest
import torch
from torch import nn

import graphed
from graphed import _C, workloads


class Block(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))

    def forward(self, x):
        return x + self.mlp(self.fc(x))


class Net(nn.Module):
    def __init__(self, depth=3):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_default_selection_is_the_repeated_blocks():
    model = graphed.auto(Net())
    stats = model.stats()
    assert list(stats["modules"]) == ["blocks.0", "blocks.1", "blocks.2"]
    assert isinstance(model, Net)
    assert stats["calls"] == 0 and stats["graphs"] == 0


def test_gpt_layers_are_chosen():
    model, _, _ = workloads.gpt_train(device="cpu", batch=1, length=8)
    infos = sys.modules["graphed.auto"]._module_infos(model)
    assert _C.select_repeated_blocks(infos) == [f"blocks.{i}" for i in range(6)]


def test_a_layer_subclassed_for_one_block_is_chosen_with_the_others():
    # Block 3 of gpt_train_blocker is a GPTBlock subclass that calls .item():
    # chosen with its siblings, so that its fallback is counted, not hidden.
    model, _, _ = workloads.gpt_train_blocker(device="cpu", batch=1, length=8)
    infos = sys.modules["graphed.auto"]._module_infos(model)
    assert infos[[i[0] for i in infos].index("blocks.3")][1:2] == ("HostReadGPTBlock",)
    assert _C.select_repeated_blocks(infos) == [f"blocks.{i}" for i in range(6)]


def test_a_model_without_repeats_is_captured_whole():
    model = graphed.auto(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    assert list(model.stats()["modules"]) == [""]


def test_modules_by_type_take_the_outermost_instances():
    model = graphed.auto(Net(), modules=[Block, "head"])
    assert list(model.stats()["modules"]) == ["blocks.0", "blocks.1", "blocks.2", "head"]


def test_state_dict_and_parameters_are_untouched():
    net = Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    model = graphed.auto(net)
    assert model is net
    assert list(model.state_dict()) == list(before)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    model.load_state_dict(before)


def test_unknown_name_is_refused_with_the_names():
    with pytest.raises(graphed.GraphedError, match="got 'blocks.9'. Names are those of "
                                                   r"model.named_modules\(\): '', 'embed'"):
        graphed.auto(Net(), modules=["blocks.9"])


def test_nested_choice_is_refused():
    with pytest.raises(graphed.GraphedError,
                       match="Module 'blocks.0' contains module 'blocks.0.fc', and both are chosen"):
        graphed.auto(Net(), modules=["blocks.0", "blocks.0.fc"])


def test_type_the_model_lacks_is_refused():
    with pytest.raises(graphed.GraphedError, match="contain a Conv2d, but it has none"):
        graphed.auto(Net(), modules=nn.Conv2d)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"warmup": 0}, graphed.GraphedError, "Expected warmup >= 1, got 0"),
        ({"warmup": 1.5}, TypeError, "warmup must be an int"),
        ({"fallback": "ignore"}, graphed.GraphedError, 'Expected fallback to be "eager"'),
        ({"memory_budget": "2 parsecs"}, graphed.GraphedError,
         'Expected a memory size such as "512MB", "2GiB"'),
        ({"memory_budget": 0}, graphed.GraphedError, "at least one byte, got 0"),
        ({"memory_budget": 1.5}, graphed.GraphedError, "Expected memory_budget to be None"),
        ({"buckets": {0: []}}, graphed.GraphedError, "at least one size for bucketed dimension 0"),
        ({"buckets": {0: 8}}, TypeError, r"buckets\[0\] must be a list of sizes"),
        ({"buckets": {-1: [2]}}, graphed.GraphedError, "counted from the front"),
        ({"buckets": [1, 2]}, TypeError, "buckets must be a dict"),
        ({"capture_error_mode": "strict"}, graphed.GraphedError, '"global", "thread_local"'),
        ({"modules": 3}, TypeError, "modules must hold submodule names"),
    ],
)
def test_bad_arguments_say_what_to_pass(kwargs, error, message):
    with pytest.raises(error, match=message):
        graphed.auto(Net(), **kwargs)


def test_a_model_is_managed_once():
    model = graphed.auto(Net())
    with pytest.raises(graphed.GraphedError, match="already managed by graphed.auto"):
        graphed.auto(model)


def test_memory_sizes():
    assert _C.parse_memory_size("2GiB") == 2 * 2**30
    assert _C.parse_memory_size("512MB") == 512 * 10**6


def test_training_calls_run_eagerly_and_are_counted():
    torch.manual_seed(0)
    net = Net()
    reference = Net()
    reference.load_state_dict(net.state_dict())
    model = graphed.auto(net, warmup=1, check=False)
    x = torch.randn(4, 8)
    for _ in range(3):
        out = model(x)
        out.sum().backward()
        expected = reference(x)
        expected.sum().backward()
        torch.testing.assert_close(out, expected)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    stats = model.stats()
    assert stats["warmup_calls"] == 3
    # Without a GPU the training graphs cannot be captured: each module falls back
    # with the capture's reason.
    assert stats["fallbacks"], "training calls on CPU tensors must fall back"
    assert all("GPU" in f["reason"] for f in stats["fallbacks"]), stats["fallbacks"]
    assert stats["replays"] == 0


def test_inference_calls_on_the_cpu_fall_back_with_the_reason():
    torch.manual_seed(0)
    net = Net().eval()
    reference = Net().eval()
    reference.load_state_dict(net.state_dict())
    model = graphed.auto(net, warmup=1, check=False, buckets=None)
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(model(x), reference(x))
    stats = model.stats()
    assert stats["fallbacks"] and stats["replays"] == 0
    assert all("for inference: an input is" in f["reason"] and "Move the model" in f["reason"]
               for f in stats["fallbacks"]), stats["fallbacks"]


class ItemBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        scale = x.abs().max().item()  # a host read: breaks capture
        return self.fc(x) / scale


def test_a_blocker_is_found_at_warmup_and_reported(tmp_path):
    net = nn.Sequential(nn.Linear(8, 8), ItemBlock(), nn.Linear(8, 8))
    model = graphed.auto(net, modules=["1"], warmup=2)
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(4):
            torch.testing.assert_close(model(x), net[2](net[1].fc(net[0](x)) /
                                                        net[0](x).abs().max()))
    stats = model.stats()
    assert stats["modules"]["1"]["state"] == "eager"
    (fallback,) = stats["fallbacks"]
    # Note [A fallback costs nothing]: the first call after the warm-up that
    # found the blocker is counted; it put the module's own forward back.
    assert fallback["count"] == 1
    assert stats["modules"]["1"]["own_forward"] is True
    assert "forward" not in net[1].__dict__
    assert "graphed.check found a host read, `aten::item`" in fallback["reason"]
    assert "test_auto_validation.py" in fallback["reason"]
    calls = stats["calls"]
    with torch.no_grad():
        model(x)
    assert model.stats()["calls"] == calls  # no graphed code on its path any more


def test_a_module_the_user_gave_a_forward_of_its_own_gets_that_one_back():
    net = nn.Sequential(nn.Linear(8, 8), ItemBlock())
    block = net[1]
    seen = []

    def instance_forward(x):
        seen.append(x.shape[0])
        return type(block).forward(block, x)

    block.forward = instance_forward
    model = graphed.auto(net, modules=["1"], warmup=1)
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(2, 8))
    assert block.forward is instance_forward
    assert seen == [2, 2, 2]


def test_fallback_raise_raises_with_the_reason():
    net = nn.Sequential(ItemBlock())
    model = graphed.auto(net, modules=["0"], warmup=1, fallback="raise")
    with pytest.raises(graphed.GraphedError, match="cannot be captured: graphed.check found a "
                                                   "host read"):
        with torch.no_grad():
            model(torch.randn(2, 8))


def test_stats_of_an_unmanaged_model_says_how_to_manage_it():
    with pytest.raises(graphed.GraphedError, match=r"wrap it first: model = graphed.auto\(model\)"):
        graphed.auto_stats(Net())


def test_undo_puts_the_model_back_as_it_was():
    # Note [Undoing graphed.auto]: optimize tries per-block graphs on the
    # user's model and must leave it as it was when they are not kept.
    model = Net()
    own_class, x = type(model), torch.randn(4, 8)
    expected = model(x)
    managed = graphed.auto(model)
    assert managed is model and type(model) is not own_class
    assert "forward" in vars(model.blocks[0])
    graphed.auto_undo(model)
    assert type(model) is own_class
    assert all("forward" not in vars(m) for m in model.modules())
    assert not any(name.startswith("_graphed_auto") for name in vars(model))
    torch.testing.assert_close(model(x), expected)
    graphed.auto(model)  # and it can be managed again
    with pytest.raises(_C.GraphedError, match="nothing to undo"):
        graphed.auto_undo(Net())
