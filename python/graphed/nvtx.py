"""graphed's NVTX ranges, for Nsight Systems.

graphed marks its phases with NVTX ranges, named ``graphed/warmup:<name>``,
``graphed/capture:<name>`` and ``graphed/replay:<name>`` (``<name>`` is the
module's or function's name), so that a profile taken with

    nsys profile --trace=cuda,nvtx --cuda-graph-trace=graph python train.py

shows which graph each replay is, next to your own ``torch.cuda.nvtx`` ranges.
Without a profiler a range costs a few nanoseconds (Note [NVTX ranges cost
nothing without a profiler] in src/nvtx.cpp), so they are on by default;
``GRAPHED_NVTX=0`` in the environment or :func:`set_nvtx` turns them off.
"""

from __future__ import annotations

from . import _C


def set_nvtx(enabled: bool) -> bool:
    """Turns graphed's NVTX ranges on or off for the whole process (all
    threads); returns the previous setting. Ranges already open still end.

    Example::

        previous = graphed.set_nvtx(False)   # e.g. around a timing loop under nsys
        ...
        graphed.set_nvtx(previous)
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"set_nvtx expects True or False, got {type(enabled).__name__}")
    return _C.set_nvtx(enabled)


def nvtx_enabled() -> bool:
    """True when graphed emits NVTX ranges: it was built with the NVTX headers
    (``graphed.build_info()["nvtx"]``) and they are switched on."""
    return _C.nvtx_enabled()
