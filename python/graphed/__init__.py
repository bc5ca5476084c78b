"""graphed: CUDA Graphs for PyTorch, with a C++ core.

A launch-bound PyTorch program leaves the GPU idle between hundreds of small
kernels; a captured CUDA graph replays them with one launch. graphed checks that
code can be captured, captures it, and verifies the result.

    import graphed
    print(graphed.check(model, x))     # what would break capture, with source lines
    fast = graphed.capture(model, x)   # warm up, capture
    y = fast(x)                        # replay on the current stream

graphed logs to the ``graphed`` logger (quiet by default: it has a
NullHandler); ``logging.getLogger("graphed").setLevel(logging.DEBUG)`` with a
handler (``logging.basicConfig()``) shows what it captures and decides.
"""

import logging as _logging
import os as _os
import sysconfig as _sysconfig

import torch as _torch  # loads libtorch before the extension that links it

# A library stays quiet unless the application configures logging.
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

from . import _C
from ._C import (
    CapturedFunction,
    GraphedCallable,
    CaptureError,
    GraphedError,
    InputMismatchError,
    LossScaling,
    SafetyFinding,
    SafetyReport,
)
from .capture import capture, capture_stream, graph_pool_handle
from .auto import auto, stats as auto_stats, undo as auto_undo
from .check import check
from .generate import Decoder, generate
from .serving import generate_batch
from .graphed_callables import graph_stats, graphed_core, make_graphed_callables
from .train import TrainStep, make_capturable
from . import distributed
from . import fsdp
from . import fp8
from . import moe
from .nvtx import nvtx_enabled, set_nvtx

__version__ = "0.1.0"


def build_info() -> dict:
    """What this installation of graphed is: ``version``, the ``torch`` and
    ``cuda`` (toolkit) versions its C++ core was built with, whether it emits
    NVTX ranges (``nvtx``), and the torch found at run time
    (``runtime_torch``, ``runtime_cuda``: torch.version.cuda)."""
    info = dict(_C.build_info())
    info["runtime_torch"] = _torch.__version__
    info["runtime_cuda"] = _torch.version.cuda
    return info


#: Pass to CMake (CMAKE_PREFIX_PATH) so that find_package(graphed) finds the
#: C++ library installed with this package.
cmake_prefix_path = _os.path.join(_os.path.dirname(__file__), "share", "cmake")

# Capture failures point at the innermost frame outside these directories.
_C.install_source_locator(
    [
        _os.path.dirname(_torch.__file__) + _os.sep,
        _os.path.dirname(__file__) + _os.sep,
        _sysconfig.get_paths()["stdlib"] + _os.sep,
    ]
)

__all__ = [
    "Decoder",
    "CaptureError",
    "CapturedFunction",
    "GraphedCallable",
    "GraphedError",
    "InputMismatchError",
    "LossScaling",
    "TrainStep",
    "auto",
    "auto_stats",
    "auto_undo",
    "SafetyFinding",
    "SafetyReport",
    "capture",
    "capture_stream",
    "check",
    "generate",
    "generate_batch",
    "graph_stats",
    "graphed_core",
    "make_graphed_callables",
    "cmake_prefix_path",
    "distributed",
    "fsdp",
    "graph_pool_handle",
    "make_capturable",
    "build_info",
    "nvtx_enabled",
    "set_nvtx",
]

# graphed.advise and graphed.optimize (issue 5).
from .advise import Advice, ProfileSettings, advise, advise_training  # noqa: E402
from .optimize import OptimizeReport, optimize  # noqa: E402

__all__ += ["Advice", "OptimizeReport", "ProfileSettings", "advise", "advise_training",
            "optimize"]
