"""Lifetimes and misuse on a GPU (issue 13): objects deleted while their graphs
live, graphed models dropped with their graphs, graphs alive at interpreter
exit, release() twice and steps after it, modules moved to another dtype or
given new parameters after capture (Note [Tensors a graph reads in place]),
inputs that alias other static buffers (Note [Inputs that alias other static
buffers]), and two threads replaying their own graphs at once. Where freed
memory could be read, the cache is emptied first (torch.cuda.empty_cache()),
so that scripts/gpu-check sanitize sees a read of memory returned to the
driver."""

import copy
import gc
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from torch import nn

import graphed

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32")]


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).cuda()


def collect():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# --- objects deleted while their graphs live ---------------------------------------------------


def test_capture_keeps_working_after_the_model_is_deleted():
    model = mlp().eval()
    x = torch.randn(8, 32, device="cuda")
    new_x = torch.randn(8, 32, device="cuda")
    with torch.no_grad():
        fast = graphed.capture(model, x)
        expected = model(new_x)
        del model
        collect()
        torch.testing.assert_close(fast(new_x), expected, rtol=0, atol=0)


def test_capture_of_a_closure_keeps_working_after_its_module_is_deleted():
    model = mlp().eval()
    x = torch.randn(8, 32, device="cuda")
    with torch.no_grad():
        fast = graphed.capture(lambda t: model(t) * 2, x)
        expected = model(x) * 2
        del model
        collect()
        torch.testing.assert_close(fast(x), expected, rtol=0, atol=0)


def test_train_step_keeps_working_after_model_and_optimizer_are_deleted():
    model = mlp()
    eager_model = copy.deepcopy(model)
    data = [(torch.randn(16, 32, device="cuda"), torch.randn(16, 32, device="cuda"))
            for _ in range(3)]
    step = graphed.TrainStep.from_parts(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                        nn.functional.mse_loss, data[0])
    eager_optimizer = graphed.make_capturable(torch.optim.AdamW(eager_model.parameters(),
                                                                lr=1e-2))
    del model
    collect()
    for batch in data:
        eager_optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(eager_model(batch[0]), batch[1])
        loss.backward()
        eager_optimizer.step()
        torch.testing.assert_close(step(batch), loss.detach(), rtol=1e-6, atol=1e-7)
    for p, q in zip(step.modules[0].parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_make_graphed_callables_forward_outlives_every_other_reference():
    model = mlp()
    reference = copy.deepcopy(model)
    sample = torch.randn(8, 32, device="cuda", requires_grad=True)
    layer = graphed.make_graphed_callables(model, (sample,))
    forward = layer.forward  # the graphed forward; holds what it needs
    del layer, model
    collect()
    x = torch.randn(8, 32, device="cuda", requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    out = forward(x)
    expected = reference(x_eager)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(x.grad, x_eager.grad, rtol=1e-6, atol=1e-6)


def graph_and_drop_a_model(api):
    """Graphs a model with ``api``, trains it 3 steps and drops it; returns a
    weak reference to it."""
    import weakref

    model = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.GELU())
                            for _ in range(4))).cuda()
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    if api == "make_graphed_callables":
        graphed.make_graphed_callables(tuple(model), tuple((x,) for _ in model))
    else:
        graphed.auto(model, warmup=1)
    for _ in range(3):
        model(x).sum().backward()
    alive = weakref.ref(model)
    del model, x
    collect()
    return alive


@pytest.mark.parametrize("api", ["make_graphed_callables", "auto"])
def test_a_dropped_graphed_model_frees_its_graphs(api):
    """No reference cycle through the C++ core keeps a graphed model, its
    graphs or their pool alive once the user drops it."""
    # The first round creates what lives for the process (cuBLAS workspaces of
    # the streams involved); the second must give back all it took.
    graph_and_drop_a_model(api)
    before = torch.cuda.memory_allocated()
    alive = graph_and_drop_a_model(api)
    assert alive() is None, f"{api}: the model outlived every reference to it"
    assert torch.cuda.memory_allocated() == before, (
        f"{api}: {torch.cuda.memory_allocated() - before} bytes still allocated")


def test_auto_block_keeps_working_after_the_model_is_deleted():
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3))).cuda()
    model.eval()
    reference = copy.deepcopy(model)
    managed = graphed.auto(model, warmup=1)
    x = torch.randn(4, 32, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(managed(x), reference(x), rtol=1e-6, atol=1e-6)
        block = managed[0]
        del managed, model
        collect()
        # The block alone, out of the recorded order: it replays or runs eagerly, either
        # way with the right values.
        torch.testing.assert_close(block(x), reference[0](x), rtol=1e-6, atol=1e-6)


# --- interpreter exit --------------------------------------------------------------------------

EXIT_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    import graphed

    torch.manual_seed(0)
    x = torch.randn(8, 32, device="cuda")
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).cuda()
    with torch.no_grad():
        fast = graphed.capture(model.eval(), x)
        fast(x)
    layers = graphed.make_graphed_callables(
        nn.Sequential(nn.Linear(32, 32), nn.GELU()).cuda(), (x,))
    layers(x).sum().backward()
    trained = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1)).cuda()
    step = graphed.TrainStep.from_parts(trained, torch.optim.AdamW(trained.parameters()),
                                        nn.functional.mse_loss, (x, x[:, :1]),
                                        skip_nonfinite=True)
    step((x, x[:, :1]))
    auto_model = graphed.auto(
        nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(2))).cuda(),
        warmup=1, buckets={0: [4, 8]})
    with torch.no_grad():
        for _ in range(3):
            auto_model(x)
    cycle = [fast, step]
    cycle.append(cycle)  # graphs in a reference cycle, freed (if ever) by the collector
    for _ in range(50):  # replays still in flight at exit
        step((x, x[:, :1]))
        fast(x)
    pending = layers(x)  # a backward that never runs
    print("ready", flush=True)
    MODE
""")


@pytest.mark.parametrize("mode", ["", "sys.exit(0)", "torch.cuda.synchronize()"],
                         ids=["fall_off_the_end", "sys_exit", "synchronized"])
def test_graphs_alive_at_interpreter_exit_do_not_crash(mode):
    script = EXIT_SCRIPT.replace("MODE", mode)
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                               timeout=240, env=dict(os.environ, PYTHONFAULTHANDLER="1"))
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "ready" in completed.stdout
    # Warnings from destructors that run after CUDA unloaded are fine; crashes are not.
    for sign in ("terminate called", "Segmentation fault", "Fatal Python error", "Aborted",
                 "core dumped"):
        assert sign not in completed.stderr, completed.stderr[-4000:]


# --- release -----------------------------------------------------------------------------------


def test_release_twice_and_use_after_release_raise_clear_errors():
    model = mlp()
    batch = (torch.randn(16, 32, device="cuda"), torch.randn(16, 32, device="cuda"))
    step = graphed.TrainStep.from_parts(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                        nn.functional.mse_loss, batch)
    step.capture_eval(lambda t: model(t), batch[0])
    step(batch)
    step.release()
    assert step.released
    step.release()  # the second time does nothing
    assert step.released
    with pytest.raises(graphed.GraphedError, match="was released.*Create a new TrainStep"):
        step(batch)
    with pytest.raises(graphed.GraphedError, match="was released"):
        step.evaluate(batch[0])
    with pytest.raises(graphed.GraphedError, match="was released"):
        step.capture_eval(lambda t: model(t), batch[0])
    with pytest.raises(graphed.GraphedError, match="was released"):
        step.stats()
    assert step._core.steps == 1
    collect()
    # The model and optimizer are still usable eagerly, and a new step can be built.
    again = graphed.TrainStep.from_parts(model, step.optimizers[0], nn.functional.mse_loss, batch)
    assert torch.isfinite(again(batch)).item()


# --- modules changed after capture: raise, never wrong values ----------------------------------


def changes():
    """Ways to change a module's parameters after capture, each with what it does."""
    def to_double(model):
        model.double()

    def to_half(model):
        model.half()

    def assign_data(model):
        model[0].weight.data = torch.randn_like(model[0].weight)

    def replace_parameter(model):
        model[0].weight = nn.Parameter(torch.randn_like(model[0].weight))

    def replace_buffer(model):
        model[1].running_mean = torch.ones_like(model[1].running_mean)

    return [to_double, to_half, assign_data, replace_parameter, replace_buffer]


def bn_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.GELU(),
                         nn.Linear(64, 32)).cuda()


@pytest.mark.parametrize("change", changes(), ids=lambda f: f.__name__)
def test_capture_refuses_a_module_whose_tensors_were_moved_or_replaced(change):
    model = bn_mlp().eval()
    x = torch.randn(8, 32, device="cuda")
    with torch.no_grad():
        fast = graphed.capture(model, x)
        change(model)
        collect()  # the old storage goes back to the driver
        with pytest.raises(graphed.GraphedError,
                           match=r"(parameters and buffers|state).*captured with.*Capture again"):
            fast(x)


def test_capture_follows_values_changed_in_place():
    model = bn_mlp().eval()
    other = bn_mlp()
    x = torch.randn(8, 32, device="cuda")
    with torch.no_grad():
        fast = graphed.capture(model, x)
        for p in other.parameters():
            p.mul_(0.5)
        model.load_state_dict(other.state_dict())
        model[0].weight.data.copy_(torch.randn_like(model[0].weight))
        torch.testing.assert_close(fast(x), model(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("change", changes()[:4], ids=lambda f: f.__name__)
def test_make_graphed_callables_refuses_moved_or_replaced_parameters(change):
    layer = graphed.make_graphed_callables(bn_mlp(), (torch.randn(8, 32, device="cuda"),))
    change(layer)
    collect()
    with pytest.raises(graphed.GraphedError, match="parameters of module .* graphed with"):
        layer(torch.randn(8, 32, device="cuda"))


@pytest.mark.parametrize("change", changes(), ids=lambda f: f.__name__)
def test_train_step_refuses_a_model_whose_tensors_were_moved_or_replaced(change):
    model = bn_mlp()
    batch = (torch.randn(16, 32, device="cuda"), torch.randn(16, 32, device="cuda"))
    step = graphed.TrainStep.from_parts(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                        nn.functional.mse_loss, batch)
    step(batch)
    change(model)
    collect()
    with pytest.raises(graphed.GraphedError,
                       match=r"(state tensor|parameter or buffer) \d+ .*"
                             r"(at another address|was replaced)"):
        step(batch)


@pytest.mark.parametrize("dtype_change", ["double", "half"])
def test_auto_model_moved_to_another_dtype_raises_or_is_right(dtype_change):
    """graphed.auto: after model.double(), a float input must raise (as eager does),
    never replay on the freed float weights; an input of the new dtype may be
    captured anew and must equal eager."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3))).cuda()
    reference = copy.deepcopy(model).eval()
    managed = graphed.auto(model.eval(), warmup=1)
    x = torch.randn(4, 32, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            managed(x)
        getattr(managed, dtype_change)()
        getattr(reference, dtype_change)()
        collect()
        with pytest.raises(Exception):
            reference(x)  # eager refuses float inputs now
        with pytest.raises(Exception):
            managed(x)
        cast = x.to(next(reference.parameters()).dtype)
        torch.testing.assert_close(managed(cast), reference(cast), rtol=1e-3, atol=1e-3)


# --- aliasing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("input_update", ["copy", "repoint", "auto"])
def test_inputs_that_are_other_inputs_static_buffers_are_read_first(input_update):
    """Note [Inputs that alias other static buffers]: a function returning its
    inputs swapped, fed back; and a static buffer passed at another index."""
    def swap(a, b):
        return b, a, a + b

    def combine(a, b):
        return a * 2 + b

    a, b = torch.full((4,), 1.0, device="cuda"), torch.full((4,), 10.0, device="cuda")
    swapped = graphed.capture(swap, a, b, input_update=input_update)
    first, second, _ = swapped(a, b)  # the static buffers of b and a
    again = swapped(first, second)
    torch.testing.assert_close(again[0], a)
    torch.testing.assert_close(again[1], b)
    torch.testing.assert_close(again[2], a + b)

    fast = graphed.capture(combine, a, b, input_update=input_update)
    static_a = fast.static_inputs[0]
    static_a.fill_(3.0)
    fresh = torch.full((4,), 5.0, device="cuda")
    # Eagerly: combine(fresh, static_a) = 5 * 2 + 3.
    torch.testing.assert_close(fast(fresh, static_a), torch.full((4,), 13.0, device="cuda"))


@pytest.mark.parametrize("input_update", ["repoint", "auto"])
def test_an_output_that_is_an_input_follows_the_new_input_when_re_pointing(input_update):
    """An input that an output aliases is copied, never re-pointed: the output is
    that input's static buffer, which a re-pointed graph would leave stale."""
    x = torch.randn(1 << 20, device="cuda")  # large: "auto" would re-point it
    fast = graphed.capture(lambda t: (t * 2, t, t[:8]), x, input_update=input_update)
    for _ in range(3):
        y = torch.randn_like(x)
        doubled, same, head = fast(y)
        torch.testing.assert_close(doubled, y * 2)
        torch.testing.assert_close(same, y)
        torch.testing.assert_close(head, y[:8])
    assert fast.stats()["repointable_inputs"] == 0


# --- threads -----------------------------------------------------------------------------------


@pytest.mark.parametrize("own_streams", [False, True], ids=["one_stream", "own_streams"])
def test_two_threads_replaying_their_own_graphs_get_their_own_results(own_streams):
    models = [mlp(seed).eval() for seed in (0, 1)]
    samples = [torch.randn(8, 32, device="cuda") for _ in models]
    with torch.no_grad():
        graphs = [graphed.capture(m, x) for m, x in zip(models, samples)]
    errors = []
    barrier = threading.Barrier(2)

    def worker(index):
        try:
            stream = torch.cuda.Stream() if own_streams else torch.cuda.current_stream()
            generator = torch.Generator(device="cuda").manual_seed(index)
            with torch.cuda.stream(stream), torch.no_grad():
                barrier.wait()
                worst = 0.0
                for _ in range(300):
                    x = torch.randn(8, 32, device="cuda", generator=generator)
                    got = graphs[index](x)
                    worst = max(worst, (got - models[index](x)).abs().max().item())
                stream.synchronize()
            assert worst <= 1e-5, f"thread {index}: max difference {worst}"
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a replay thread hung"
    assert not errors, errors


def test_auto_recaptures_after_a_parameter_is_replaced():
    """A new nn.Parameter object (not only new storage): auto must train and
    compute with it, not with the object its graphs were captured on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32)).cuda().eval()
    reference = copy.deepcopy(model)
    managed = graphed.auto(model, warmup=1)
    x = torch.randn(4, 32, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            managed(x)
        replacement = torch.randn(32, 32, device="cuda")
        managed[0].weight = nn.Parameter(replacement.clone())
        reference[0].weight = nn.Parameter(replacement.clone())
        collect()
        for _ in range(3):
            torch.testing.assert_close(managed(x), reference(x), rtol=1e-5, atol=1e-5)
    stats = managed.stats()
    assert stats["tensor_changes"] >= 1
    assert stats["replays"] > 0
