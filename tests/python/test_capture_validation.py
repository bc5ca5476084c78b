"""graphed.capture argument validation and messages: no GPU needed."""

import os

import pytest
import torch

import graphed


def double(x):
    return x * 2


def test_error_types_form_a_hierarchy():
    assert issubclass(graphed.GraphedError, RuntimeError)
    assert issubclass(graphed.CaptureError, graphed.GraphedError)
    assert issubclass(graphed.InputMismatchError, graphed.GraphedError)
    assert issubclass(graphed.InputMismatchError, ValueError)
    assert graphed.GraphedError.__module__ == "graphed"


def test_cpu_sample_tensor_is_refused_with_its_path():
    with pytest.raises(graphed.GraphedError, match=r"args\[0\] is \(4, 3\) float32 cpu"):
        graphed.capture(double, torch.ones(4, 3))


def test_cpu_tensor_inside_nested_kwargs_is_named():
    with pytest.raises(graphed.GraphedError, match=r"kwargs\['extra'\]\[1\] is \(2,\) int64 cpu"):
        graphed.capture(lambda **kw: kw, sample_kwargs={"extra": [None, torch.arange(2)]})


def test_zero_warmup_is_refused():
    with pytest.raises(graphed.GraphedError, match="Expected warmup_iters >= 1, got 0"):
        graphed.capture(double, torch.ones(2), warmup=0)


def test_unknown_capture_error_mode_lists_the_valid_ones():
    with pytest.raises(graphed.GraphedError, match='"global", "thread_local" or "relaxed"'):
        graphed.capture(double, torch.ones(2), capture_error_mode="strict")


def test_pool_handles_are_distinct_pairs():
    first = graphed.graph_pool_handle()
    second = graphed.graph_pool_handle()
    assert isinstance(first, tuple) and len(first) == 2
    assert first != second


def test_cmake_prefix_path_holds_the_package_config():
    config = os.path.join(graphed.cmake_prefix_path, "graphed", "graphedConfig.cmake")
    assert os.path.isfile(config), config


def test_capture_needs_a_gpu_when_inputs_allow_it():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the no-GPU message cannot be provoked")
    with pytest.raises(graphed.GraphedError, match="needs an NVIDIA GPU"):
        graphed.capture(lambda: None)


def test_unknown_input_update_lists_the_valid_ones():
    with pytest.raises(graphed.GraphedError, match='"copy", "repoint" or "auto", got "move"'):
        graphed.capture(double, torch.ones(2), input_update="move")


def test_module_tensor_dicts_must_be_dicts():
    # graphed.capture passes a module's _parameters and _buffers dicts (Note [Tensors a
    # graph reads in place]); anything else is refused before any capture work.
    with pytest.raises(graphed.GraphedError, match="Expected a list of dicts of tensors"):
        graphed._C.capture(double, (torch.ones(2),), {}, 1, None, "global", False, [], [],
                           "function `double`", "copy", [1])
