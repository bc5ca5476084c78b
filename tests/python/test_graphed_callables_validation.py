"""make_graphed_callables argument validation: runs without a GPU."""

import pytest
import torch

import graphed


def test_hooks_on_a_module_are_refused_with_the_fix():
    module = torch.nn.Sequential(torch.nn.Linear(4, 4))
    module[0].register_forward_hook(lambda *args: None)
    with pytest.raises(graphed.GraphedError, match="hooks") as error:
        graphed.make_graphed_callables(module, (torch.ones(2, 4),))
    assert "handle.remove()" in str(error.value)


def test_buffers_that_require_grad_are_refused():
    module = torch.nn.Linear(4, 4)
    module.register_buffer("scale", torch.ones(4, requires_grad=True))
    with pytest.raises(graphed.GraphedError, match="buffer\\(s\\) scale"):
        graphed.make_graphed_callables(module, (torch.ones(2, 4),))


def test_cpu_samples_are_refused_with_the_fix():
    with pytest.raises(graphed.GraphedError, match="on a CUDA device") as error:
        graphed.make_graphed_callables(torch.nn.Linear(4, 4), (torch.ones(2, 4),))
    assert ".cuda()" in str(error.value)


def test_autocast_with_its_cache_is_refused():
    with torch.autocast("cpu", cache_enabled=True):
        with pytest.raises(graphed.GraphedError, match="cache_enabled=False"):
            graphed.make_graphed_callables(torch.nn.Linear(4, 4), (torch.ones(2, 4),))


def test_mixed_training_modes_are_refused():
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).eval()
    with pytest.raises(graphed.GraphedError, match="all modules in training mode or all in eval mode"):
        graphed.make_graphed_callables((a, b), ((torch.ones(2, 4),), (torch.ones(2, 4),)))


def test_order_must_fit_the_callables_and_samples():
    layers = tuple(torch.nn.Linear(4, 4) for _ in range(2))
    samples = tuple((torch.ones(2, 4),) for _ in range(3))
    with pytest.raises(graphed.GraphedError, match="Expected 2 sample inputs"):
        graphed.make_graphed_callables(layers, samples, order=[1, 2, -2, -1])
    with pytest.raises(graphed.GraphedError, match="comes before forward"):
        graphed.make_graphed_callables(layers[:1], samples[:1], order=[-1, 1])


def test_sample_counts_and_types_are_checked():
    layers = (torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(graphed.GraphedError, match="one sample input per callable"):
        graphed.make_graphed_callables(layers, ((torch.ones(2, 4),),))
    with pytest.raises(graphed.GraphedError, match="one sample_kwargs entry per sample"):
        graphed.make_graphed_callables(layers, ((torch.ones(2, 4),), (torch.ones(2, 4),)),
                                       sample_kwargs=({},))
    with pytest.raises(graphed.GraphedError, match="nn.Module or a function"):
        graphed.make_graphed_callables((layers[0], 3), ((torch.ones(2, 4),), (torch.ones(2, 4),)))
    with pytest.raises(graphed.GraphedError, match="num_warmup_iters >= 1"):
        graphed.make_graphed_callables(layers[0], (torch.ones(2, 4),), 0)


def test_graph_stats_refuses_what_was_not_graphed():
    with pytest.raises(graphed.GraphedError, match="not graphed"):
        graphed.graph_stats(torch.nn.Linear(2, 2))


def test_the_core_gets_a_forward_that_holds_the_module_weakly():
    """module -> graphed forward -> core -> module would be a cycle through C++
    that Python's collector cannot free (with the graphs' GPU memory)."""
    import gc
    import weakref

    from graphed.graphed_callables import _callable_spec

    module = torch.nn.Linear(4, 4)
    forward = _callable_spec(module, 0)["function"]
    x = torch.ones(2, 4)
    assert torch.equal(forward(x), module(x))
    alive = weakref.ref(module)
    del module
    gc.collect()
    assert alive() is None, "the core's forward kept the module alive"
    with pytest.raises(graphed.GraphedError, match="whose forward was graphed .* was deleted"):
        forward(x)
