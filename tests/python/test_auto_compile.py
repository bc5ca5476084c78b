"""graphed.auto(model, compile=...): each managed block's forward under
torch.compile before its capture (Note [Compiled blocks in graphed.auto] in
python/graphed/_compiled.py). The CPU tests check the arguments and that the
compiled forward is what the core calls (a counting backend); the GPU tests
check numerics against eager, replays, and that nothing compiles once the
graphs are captured, for inference and training, on our blocks and on a
transformers Llama."""

import copy

import pytest
import torch
from torch import nn

import graphed


class Block(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def blocks(layers: int = 4, width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(layers)])


class CountingBackend:
    """A torch.compile backend that counts the graphs it is given and runs
    them as Dynamo traced them (or through Inductor, ``inductor=True``)."""

    def __init__(self, inductor: bool = False):
        self.graphs = 0
        self.inductor = inductor

    def __call__(self, graph, example_inputs):
        self.graphs += 1
        if self.inductor:
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(graph, example_inputs)
        return graph.forward


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("compile", [{"mode": "reduce-overhead"}, {"options": {
    "triton.cudagraphs": True}}, "auto", 3, {"fullgraph": True, "mood": "fast"}])
def test_settings_that_cannot_work_are_refused_before_anything_changes(compile):
    model = blocks()
    forwards = [m.__dict__.get("forward") for m in model.modules()]
    with pytest.raises(graphed.GraphedError, match="compile"):
        graphed.auto(model, compile=compile)
    assert [m.__dict__.get("forward") for m in model.modules()] == forwards
    assert not hasattr(model, "stats")


def test_repeated_blocks_share_one_compiled_forward():
    model = blocks(layers=4)
    backend = CountingBackend()
    expected = model(torch.ones(2, 32))
    graphed.auto(model, compile={"backend": backend})
    with torch.no_grad():
        for _ in range(4):
            out = model(torch.ones(2, 32))
    torch.testing.assert_close(out, expected)
    # One class, one graph: four layers did not compile four times.
    assert backend.graphs == 1
    assert any("torch.compile" in note and "1 compiled forward(s) for 4 module(s)" in note
               for note in model.stats()["notes"])


def test_autocast_cache_changes_do_not_recompile():
    """Captures run with autocast's cache off (Note [Autocast's cache while
    graphed.auto captures]); the compiled forward runs so always, so a
    warm-up with the cache on and a check with it off share a graph."""
    model = blocks(layers=2)
    backend = CountingBackend()
    graphed.auto(model, compile={"backend": backend})
    with torch.no_grad():
        model(torch.ones(2, 32))
        before = backend.graphs
        torch.set_autocast_cache_enabled(False)
        try:
            model(torch.ones(2, 32))
        finally:
            torch.set_autocast_cache_enabled(True)
    assert backend.graphs == before
    assert torch.is_autocast_cache_enabled()


def test_undo_puts_the_uncompiled_forwards_back():
    model = blocks(layers=2)
    graphed.auto(model, compile={"backend": CountingBackend()})
    graphed.auto_undo(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def _train(model, steps, batch):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        loss = model(batch).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        losses.append(loss.detach().clone())
    return torch.stack(losses)


@pytest.mark.gpu
@pytest.mark.usefixtures("exact_fp32")
def test_inference_replays_compiled_graphs_and_matches_eager():
    model = blocks(layers=4, width=64).cuda().eval()
    reference = copy.deepcopy(model)
    backend = CountingBackend(inductor=True)
    graphed.auto(model, compile={"backend": backend}, buckets=None)
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        for _ in range(4):
            out = model(x).clone()
        compiled_before_replays = backend.graphs
        for _ in range(3):
            out = model(x).clone()
        expected = reference(x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    stats = model.stats()
    assert stats["replays"] > 0 and not stats["fallbacks"], stats["fallbacks"]
    assert backend.graphs == compiled_before_replays, "compiled again after the capture"


@pytest.mark.gpu
@pytest.mark.usefixtures("exact_fp32")
def test_training_replays_compiled_graphs_and_matches_eager():
    model = blocks(layers=4, width=64).cuda().train()
    reference = copy.deepcopy(model)
    backend = CountingBackend(inductor=True)
    graphed.auto(model, compile={"backend": backend})
    batch = torch.randn(8, 64, device="cuda")
    losses = _train(model, 8, batch)
    expected = _train(reference, 8, batch)
    torch.testing.assert_close(losses, expected, rtol=1e-4, atol=1e-5)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
    stats = model.stats()
    assert stats["replays"] > 0 and not stats["fallbacks"], stats["fallbacks"]
    compiled = backend.graphs
    _train(model, 3, batch)
    assert backend.graphs == compiled, "compiled again after the capture"


@pytest.mark.gpu
@pytest.mark.usefixtures("exact_fp32")
def test_transformers_llama_trains_on_compiled_layers():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).cuda().train()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 256, (4, 32), device="cuda")
    graphed.auto(model, compile=True)

    def run(m, steps):
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-3)
        losses = []
        for _ in range(steps):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach().clone())
        return torch.stack(losses)

    losses = run(model, 6)
    expected = run(reference, 6)
    torch.testing.assert_close(losses, expected, rtol=1e-3, atol=1e-4)
    stats = model.stats()
    assert stats["replays"] > 0 and not stats["fallbacks"], stats["fallbacks"]
