"""graphed.capture: record a function or module once as a CUDA graph, replay it on every call."""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Optional, Tuple

import torch

from . import _C
from ._experts import capturable_experts

PoolHandle = Tuple[int, int]

logger = logging.getLogger(__name__)


def graph_pool_handle() -> PoolHandle:
    """A memory pool handle that several captures can share.

    Graphs in one pool must replay in the order they were captured; sharing
    then costs no more memory than the largest of them.
    """
    return _C.graph_pool_handle()


def _device_index(device: Optional[Any]) -> int:
    if isinstance(device, int):
        return device
    index = None if device is None else torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def capture_stream(device: Optional[Any] = None) -> torch.cuda.Stream:
    """The stream graphed warms up and captures on, for ``device`` (the current
    CUDA device when omitted). One per device, alive for the whole process.

    Work that later captures must see on this stream belongs here; e.g. a
    DistributedDataParallel model whose all-reduces a TrainStep captures must
    be constructed under it (graphed.distributed.prepare_ddp does so)."""
    index = _device_index(device)
    return torch.cuda.ExternalStream(_C.capture_stream_handle(index), device=index)


def _describe(fn: Callable[..., Any]) -> str:
    if isinstance(fn, torch.nn.Module):
        return f"module `{type(fn).__name__}`"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return f"function `{name}`" if name else "the function"


def capture(
    fn: Callable[..., Any],
    *sample_args: Any,
    sample_kwargs: Optional[Mapping[str, Any]] = None,
    warmup: int = 3,
    pool: Optional[PoolHandle] = None,
    capture_error_mode: str = "global",
    clone_outputs: bool = False,
    input_update: str = "copy",
) -> _C.CapturedFunction:
    """Capture ``fn(*sample_args, **sample_kwargs)`` as a CUDA graph.

    ``fn`` is warmed up ``warmup`` times on graphed's capture stream, then
    captured without autograd (this is the inference path; see
    ``graphed.make_graphed_callables`` for training). The result is called like
    ``fn``: each call checks its inputs against the sample (nested tuples,
    lists and dicts of CUDA tensors; non-tensor values must be equal), copies
    new input tensors into static buffers and replays the graph on the current
    stream.

    Args:
        fn: a function or ``torch.nn.Module``. A module's buffers are restored
            after warm-up, and calls fail if its ``training`` flag changes or
            its parameters or buffers were replaced or moved (``.double()``,
            ``.to()``, ``.data =``): the graph would read stale or freed memory.
        sample_args, sample_kwargs: inputs of the shapes future calls will use.
        warmup: eager runs before capture (at least 1).
        pool: a handle from :func:`graph_pool_handle` or another capture's
            ``.pool`` to share memory with (replay in capture order).
        capture_error_mode: ``"global"``, ``"thread_local"`` or ``"relaxed"``
            (``cudaStreamCaptureMode``).
        clone_outputs: return clones instead of the graph's static outputs.
            Without it, outputs are overwritten by the next call.
        input_update: how a call's input tensors reach the graph: ``"copy"``
            into the static buffers; ``"repoint"`` the graph's kernels at the
            tensors (cudaGraphExecUpdate of kernel parameters, no copy) where
            the graph allows it; ``"auto"`` re-points large inputs and inputs
            that keep arriving at one address, and copies the rest.

    Raises:
        graphed.CaptureError: the function cannot be captured; the message
            names the operation, its source line and the fix. Nothing is
            changed: buffers and random generators are restored, the pool is
            released.
        graphed.GraphedError: bad arguments (CPU tensors, ``warmup < 1``...).
    """
    state = []
    guards = []
    tensor_dicts = None
    if isinstance(fn, torch.nn.Module):
        module = fn
        for note in capturable_experts(module):
            logger.info("capture: %s", note)
        state = [buffer for buffer in module.buffers()]
        guards = [("module.training", lambda: module.training)]
        # Each call checks that the graph's parameters and buffers were not
        # replaced or moved (Note [Tensors a graph reads in place]).
        submodules = list(module.modules())
        tensor_dicts = [m._parameters for m in submodules] + [m._buffers for m in submodules]
    captured = _C.capture(
        fn,
        tuple(sample_args),
        dict(sample_kwargs or {}),
        warmup,
        None if pool is None else tuple(pool),
        capture_error_mode,
        clone_outputs,
        state,
        guards,
        _describe(fn),
        input_update,
        tensor_dicts,
    )
    if logger.isEnabledFor(logging.DEBUG):
        stats = captured.stats()
        logger.debug("captured %s: %d kernels, warm-up %.1f ms, capture %.1f ms",
                     _describe(fn), stats["kernels"], stats["warmup_ms"], stats["capture_ms"])
    return captured
