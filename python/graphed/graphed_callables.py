"""graphed.make_graphed_callables: modules and functions graphed for training.

A drop-in for ``torch.cuda.make_graphed_callables`` whose replay path is C++
(one autograd node per call, no Python in the backward), plus keyword
arguments, pipeline orders, shared static buffers and gradients that are
never aliases of the graphs' memory.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from . import _C, distributed
from ._experts import capturable_experts
from ._weak_forward import weak_forward

PoolHandle = Tuple[int, int]

logger = logging.getLogger(__name__)


def _describe(fn: Callable[..., Any]) -> str:
    if isinstance(fn, torch.nn.Module):
        return f"module `{type(fn).__name__}`"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return f"function `{name}`" if name else "the callable"


def _check_module(module: torch.nn.Module, index: int) -> None:
    hooked = [
        name or type(module).__name__
        for name, sub in module.named_modules()
        if sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks
        or getattr(sub, "_backward_pre_hooks", None)
    ]
    if hooked:
        raise _C.GraphedError(
            f"Expected callable {index} ({_describe(module)}) to have no hooks while it is "
            f"graphed, but {', '.join(hooked[:4])} {'has' if len(hooked) == 1 else 'have'} "
            "forward or backward hooks. A hook runs Python at capture only, never at replay. "
            "Remove the hooks (handle.remove()) before graphing; hooks registered afterwards on "
            "the module itself run around the graphed call."
        )
    trainable_buffers = [name for name, b in module.named_buffers() if b.requires_grad]
    if trainable_buffers:
        raise _C.GraphedError(
            f"Expected only parameters of {_describe(module)} to require grad, but buffer(s) "
            f"{', '.join(trainable_buffers[:4])} do. Gradients flow to parameters and inputs "
            "only: register them as nn.Parameter, or set requires_grad=False."
        )


def _callable_spec(fn: Callable[..., Any], index: int) -> dict:
    if isinstance(fn, torch.nn.Module):
        _check_module(fn, index)
        return {
            # Held weakly: module -> graphed forward -> core -> module would be
            # a cycle through C++ that keeps the graphs' memory forever.
            "function": weak_forward(fn),
            "parameters": list(fn.parameters()),
            "state": list(fn.buffers()),
            "training": fn.training,
            "parameter_dicts": [m._parameters for m in fn.modules()],
            "description": _describe(fn),
        }
    if not callable(fn):
        raise _C.GraphedError(
            f"Expected callable {index} to be an nn.Module or a function, got "
            f"{type(fn).__name__}. Pass modules or functions."
        )
    return {
        "function": fn,
        "parameters": [],
        "state": [],
        "training": None,
        "parameter_dicts": None,
        "description": _describe(fn),
    }


def _as_args(sample: Any, index: int) -> tuple:
    if isinstance(sample, torch.Tensor):
        return (sample,)
    if isinstance(sample, (tuple, list)):
        return tuple(sample)
    raise _C.GraphedError(
        f"Expected sample_args[{index}] to be a tuple of arguments, got {type(sample).__name__}. "
        "Pass one tuple of sample arguments per callable, e.g. ((x,), (h,))."
    )


def _install_forward(module: torch.nn.Module, graphed: _C.GraphedCallable) -> None:
    call = graphed.call

    @functools.wraps(type(module).forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return call(module.training, args, kwargs)

    forward.graphed = graphed  # type: ignore[attr-defined]
    module.forward = forward  # instance attribute: parameters and state_dict are untouched


def _graphed_function(fn: Callable[..., Any], graphed: _C.GraphedCallable) -> Callable[..., Any]:
    call = graphed.call

    @functools.wraps(fn)
    def replay(*args: Any, **kwargs: Any) -> Any:
        return call(None, args, kwargs)

    replay.graphed = graphed  # type: ignore[attr-defined]
    return replay


def make_graphed_callables(
    callables: Union[Callable[..., Any], Sequence[Callable[..., Any]]],
    sample_args: Any,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Optional[PoolHandle] = None,
    *,
    sample_kwargs: Optional[Any] = None,
    order: Optional[List[int]] = None,
    capture_error_mode: str = "global",
) -> Any:
    """Graph modules or functions for training: forward and backward CUDA graphs.

    Called like ``torch.cuda.make_graphed_callables``: one callable and a tuple
    of sample arguments, or a tuple of callables and a tuple of such tuples.
    Each callable gets a forward graph and a backward graph, all in one memory
    pool, captured in the order they will run (forwards first to last,
    backwards last to first). A module is returned with its ``forward``
    replaced (parameters, buffers and ``state_dict`` stay as they are); a
    function is returned as a graphed function. Calls copy new input tensors
    into static buffers and replay the forward graph; autograd replays the
    backward graph, from C++.

    Beyond PyTorch's version:
        sample_kwargs: keyword arguments of each sample (tensors and constants).
        order: a pipeline schedule in Transformer Engine's convention (1-based
            chunk ids, ``+c`` forward, ``-c`` backward). Callables are split
            into ``max(order)`` chunks, ``sample_args`` holds one sample per
            callable and microbatch (chunk-major, then microbatch, then layer),
            each pair gets its own graphs, and a callable's calls cycle through
            its microbatches. Static inputs are shared between microbatches
            whose lifetimes do not overlap. Every step must call all
            microbatches in that order: graphed.fp8 layers cast each
            weight in the first microbatch's forward graph only, and the
            later microbatches' graphs read that cast (Note [Weight casts
            shared by the graphs of a scope]); a later microbatch replayed
            after the weights changed without the first one raises.
        Gradients returned to autograd are never aliases of the graphs'
        memory, so accumulation over microbatches is correct (pytorch#181723).
        A module whose ``training`` flag differs from capture runs eagerly and
        ``graphed.graph_stats(module)`` counts it. Replays out of the captured
        order raise instead of silently corrupting gradients.

    Outputs are the graphs' static tensors: overwritten by the next call of the
    same callable (and microbatch). Clone what you keep.

    Raises:
        graphed.GraphedError: hooks on a module, autocast with its cache on,
            CPU sample tensors, inconsistent ``order``, parameters that change
            after graphing, ...
        graphed.CaptureError: a callable cannot be captured; every module, its
            gradients and buffers and the random generators are as they were,
            and the pool is released.
        graphed.InputMismatchError: a later call differs from the sample.
    """
    # DistributedDataParallel stays eager around the graphed module: its forward
    # prepares the reducer on the host each call, and its hooks all-reduce the
    # gradients the graphed backward hands to autograd.
    if isinstance(callables, list):
        callables = tuple(callables)
    callables, rewrap = distributed.split_ddp(callables)
    just_one = not isinstance(callables, (tuple, list))
    if just_one:
        callables = (callables,)
        sample_args = (sample_args,)
        sample_kwargs = (sample_kwargs or {},)
    callables = tuple(callables)
    for callable_ in callables:
        for note in capturable_experts(callable_):
            logger.info("make_graphed_callables: %s", note)
    if not isinstance(sample_args, (tuple, list)):
        raise _C.GraphedError(
            f"Expected sample_args to be a tuple with one tuple of arguments per callable, got "
            f"{type(sample_args).__name__}."
        )
    samples_args = [_as_args(sample, i) for i, sample in enumerate(sample_args)]
    if sample_kwargs is None:
        samples_kwargs = [{} for _ in samples_args]
    else:
        samples_kwargs = [dict(kwargs or {}) for kwargs in sample_kwargs]
        if len(samples_kwargs) != len(samples_args):
            raise _C.GraphedError(
                f"Expected one sample_kwargs entry per sample ({len(samples_args)}), got "
                f"{len(samples_kwargs)}. Pass a dict (or None) for each sample."
            )
    if isinstance(num_warmup_iters, bool) or not isinstance(num_warmup_iters, int):
        raise _C.GraphedError(
            f"Expected num_warmup_iters to be an int >= 1, got {num_warmup_iters!r}."
        )
    specs = [_callable_spec(fn, i) for i, fn in enumerate(callables)]
    trainings = {spec["training"] for spec in specs if spec["training"] is not None}
    if len(trainings) > 1:
        raise _C.GraphedError(
            "Expected all modules in training mode or all in eval mode, but they are mixed. "
            "Graphs are captured for one mode; call .train() or .eval() on all of them first."
        )
    graphed = _C.make_graphed_callables(
        specs,
        [(args, kwargs) for args, kwargs in zip(samples_args, samples_kwargs)],
        num_warmup_iters,
        bool(allow_unused_input),
        None if pool is None else tuple(pool),
        [int(entry) for entry in (order or [])],
        capture_error_mode,
    )
    logger.debug("make_graphed_callables: captured %d callable(s) (%s), %d microbatch sample(s)",
                 len(callables), ", ".join(_describe(fn) for fn in callables), len(samples_args))
    results = []
    for fn, core in zip(callables, graphed):
        if isinstance(fn, torch.nn.Module):
            _install_forward(fn, core)
            results.append(fn)
        else:
            results.append(_graphed_function(fn, core))
    return rewrap(results[0] if just_one else tuple(results))


def graphed_core(fn: Any) -> _C.GraphedCallable:
    """The ``GraphedCallable`` behind a module or function from make_graphed_callables."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    core = getattr(target, "graphed", None)
    if core is None:
        raise _C.GraphedError(
            f"Expected a module or function returned by graphed.make_graphed_callables, got "
            f"{_describe(fn)}, which is not graphed."
        )
    return core


def graph_stats(fn: Any) -> dict:
    """Replays, copies, eager calls with their reasons, and each graph's nodes and memory
    (forward graphs also count the FP8 weight casts they make, ``fp8_weight_casts``, and the
    casts of an earlier microbatch's graph they read, ``fp8_weight_cast_reads``)."""
    return graphed_core(fn).stats()
