"""Property-based tests of graphed.capture's call path (issue 13): random
inputs that differ from the sample (shapes, dtypes, devices, nesting,
constants, keyword arguments) and random inputs that do not (non-contiguous,
offset and broadcast views, aliased arguments, another input's static buffer,
keyword order, requires_grad under no_grad). Every call must raise
InputMismatchError (or GraphedError for a tensor requiring grad in grad mode),
or return exactly what eager returns: never crash, never a wrong answer."""

import pytest
import torch

import graphed

hypothesis = pytest.importorskip("hypothesis", reason="needs hypothesis (pip install hypothesis)")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

pytestmark = pytest.mark.gpu

SHAPES = {"a": (4, 8), "b": (8,), "c": (2, 3), "e": (4, 8), "d": (5,)}
# Depth-first order of the sample's tensors: the order of static_inputs.
STATIC_INDEX = {"a": 0, "b": 1, "c": 2, "e": 3, "d": 4}


def function(a, pair, e, *, d, scale):
    b, rest = pair
    (c,) = rest
    return {"y": a * scale + e + b.sum() + c.sum() + d.sum(), "parts": (b * 2, [c - 1])}


def sample_call():
    return {
        "tensors": {name: torch.randn(shape, device="cuda") for name, shape in SHAPES.items()},
        "pair": tuple, "rest": list, "scale": 2.0, "kwarg_order": ("d", "scale"),
        "drop_d": False, "extra_kwarg": False, "extra_rest": False,
    }


def arguments(call):
    t = call["tensors"]
    rest = call["rest"]([t["c"], t["c"]] if call["extra_rest"] else [t["c"]])
    args = (t["a"], call["pair"]((t["b"], rest)), t["e"])
    kwargs = {}
    for key in call["kwarg_order"]:
        if key == "d" and not call["drop_d"]:
            kwargs["d"] = t["d"]
        elif key == "scale":
            kwargs["scale"] = call["scale"]
    if call["extra_kwarg"]:
        kwargs["f"] = torch.ones(2, device="cuda")
    return args, kwargs


_CAPTURED = {}


def captured(input_update):
    """One capture per input_update mode, shared by the examples."""
    if input_update not in _CAPTURED:
        args, kwargs = arguments(sample_call())
        _CAPTURED[input_update] = graphed.capture(function, *args, sample_kwargs=kwargs,
                                                  input_update=input_update)
    return _CAPTURED[input_update]


def spec(value):
    """What a call's signature depends on, as graphed.capture documents it: the
    nesting (tuple, list, dict keys in any order), each tensor's shape, dtype and
    device, and each constant's type and value. The test's oracle."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, str(value.device))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__,) + tuple(spec(v) for v in value)
    if isinstance(value, dict):
        return ("dict",) + tuple(sorted((k, spec(v)) for k, v in value.items()))
    return ("constant", type(value).__name__, value)


def tensors_of(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_of(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_of(v)]
    return []


# Mutations: each changes `call` in place. Some keep the signature (views,
# aliases, static buffers, keyword order, requires_grad), most break it; the
# oracle (spec) decides from the final call which outcome is right.
def is_tensor(call, leaf):
    return isinstance(call["tensors"][leaf], torch.Tensor)


def shape(call, leaf, data):
    sizes = list(SHAPES[leaf])
    sizes[data.draw(st.integers(0, len(sizes) - 1))] += data.draw(st.integers(1, 3))
    call["tensors"][leaf] = torch.randn(sizes, device="cuda")


def dtype(call, leaf, data):
    if is_tensor(call, leaf):
        target = data.draw(st.sampled_from([torch.float64, torch.float16, torch.bfloat16,
                                            torch.int32]))
        call["tensors"][leaf] = call["tensors"][leaf].to(target)


def device(call, leaf, data):
    if is_tensor(call, leaf):
        call["tensors"][leaf] = call["tensors"][leaf].cpu()


def not_a_tensor(call, leaf, data):
    call["tensors"][leaf] = data.draw(st.sampled_from([None, 1.0, [1.0, 2.0]]))


def nesting(call, leaf, data):
    change = data.draw(st.sampled_from(["pair_list", "rest_tuple", "extra_rest"]))
    if change == "pair_list":
        call["pair"] = list
    elif change == "rest_tuple":
        call["rest"] = tuple
    else:
        call["extra_rest"] = True


def constant(call, leaf, data):
    call["scale"] = data.draw(st.sampled_from([3.0, 2, True, "2.0", None, 2.0]))


def kwargs_set(call, leaf, data):
    if data.draw(st.booleans()):
        call["drop_d"] = True
    else:
        call["extra_kwarg"] = True


def kwarg_order(call, leaf, data):
    call["kwarg_order"] = ("scale", "d")


def non_contiguous(call, leaf, data):
    sizes = SHAPES[leaf]
    kind = data.draw(st.sampled_from(["transposed", "strided", "offset", "broadcast"]))
    if kind == "transposed" and len(sizes) == 2:
        value = torch.randn(sizes[::-1], device="cuda").t()
    elif kind == "strided":
        value = torch.randn((*sizes[:-1], sizes[-1] * 2), device="cuda")[..., ::2]
    elif kind == "offset":
        value = torch.randn((sizes[0] + 3, *sizes[1:]), device="cuda")[3:]
    else:
        value = torch.randn(1, device="cuda").expand(sizes)
    assert tuple(value.shape) == sizes
    call["tensors"][leaf] = value


def aliased(call, leaf, data):
    call["tensors"]["e"] = call["tensors"]["a"]  # the same tensor twice


def static_buffer(call, leaf, data):
    """Another input's static buffer (or this input's own) in this position; the
    test puts the buffer in once the capture is known."""
    call.setdefault("static_buffers", []).append(leaf)


def requires_grad(call, leaf, data):
    if is_tensor(call, leaf) and call["tensors"][leaf].is_floating_point():
        call["tensors"][leaf] = call["tensors"][leaf].detach().clone().requires_grad_()


MUTATIONS = [shape, dtype, device, not_a_tensor, nesting, constant, kwargs_set, kwarg_order,
             non_contiguous, aliased, static_buffer, requires_grad]


@pytest.mark.parametrize("input_update", ["copy", "repoint", "auto"])
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=True)
@given(data=st.data())
def test_random_calls_raise_input_mismatch_or_equal_eager(input_update, data):
    fast = captured(input_update)
    call = sample_call()
    expected_spec = spec(arguments(call))
    chosen = data.draw(st.lists(st.sampled_from(MUTATIONS), max_size=3), label="mutations")
    for mutation in chosen:
        leaf = data.draw(st.sampled_from(sorted(SHAPES)), label=f"{mutation.__name__} leaf")
        mutation(call, leaf, data)
    for leaf in call.get("static_buffers", []):
        # a takes e's buffer and e takes a's (same shape); other leaves their own.
        owner = {"a": "e", "e": "a"}.get(leaf, leaf)
        buffer = fast.static_inputs[STATIC_INDEX[owner]]
        if spec(buffer) == spec(call["tensors"][leaf]):
            call["tensors"][leaf] = buffer
    grad_mode = data.draw(st.booleans(), label="grad mode")
    args, kwargs = arguments(call)
    matches = spec((args, kwargs)) == expected_spec

    with torch.set_grad_enabled(grad_mode):
        if not matches:
            with pytest.raises(graphed.InputMismatchError):
                fast(*args, **kwargs)
            return
        if grad_mode and any(t.requires_grad for t in tensors_of((args, kwargs))):
            with pytest.raises(graphed.GraphedError, match="captured for inference"):
                fast(*args, **kwargs)
            return
        with torch.no_grad():
            expected = function(*args, **kwargs)  # before the call: buffers may be inputs
            expected = {"y": expected["y"].clone(),
                        "parts": (expected["parts"][0].clone(), [expected["parts"][1][0].clone()])}
        got = fast(*args, **kwargs)
    torch.testing.assert_close(got["y"], expected["y"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got["parts"][0], expected["parts"][0], rtol=0, atol=0)
    torch.testing.assert_close(got["parts"][1][0], expected["parts"][1][0], rtol=0, atol=0)
    assert isinstance(got["parts"], tuple) and isinstance(got["parts"][1], list)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=True)
@given(batch=st.integers(1, 12), width=st.integers(1, 9),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16]))
def test_captured_module_refuses_every_other_shape_and_dtype(batch, width, dtype):
    fast = captured_module()
    x = torch.randn(batch, width, device="cuda", dtype=dtype)
    with torch.no_grad():
        if (batch, width, dtype) == (6, 5, torch.float32):
            torch.testing.assert_close(fast(x), _MODULE[0](x), rtol=1e-6, atol=1e-6)
        else:
            with pytest.raises(graphed.InputMismatchError, match=r"args\[0\]: expected \(6, 5\) "
                                                                 r"float32 cuda:0, got"):
                fast(x)


_MODULE = []


def captured_module():
    if not _MODULE:
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.GELU()).cuda().eval()
        with torch.no_grad():
            _MODULE.extend([module, graphed.capture(module, torch.randn(6, 5, device="cuda"))])
    return _MODULE[1]
