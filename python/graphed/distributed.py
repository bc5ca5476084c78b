"""graphed under torch.distributed.

A :class:`graphed.TrainStep` over a DistributedDataParallel (DDP) model captures
the gradient all-reduces with the rest of the iteration; DDP around
:func:`graphed.make_graphed_callables` runs its all-reduces eagerly, from the
gradient hooks the graphed backward triggers. What PyTorch leaves to the user
for the first (Note [Capturing collectives] in include/graphed/train_step.h)
graphed does here and in the C++ core:

* :func:`init_process_group` initialises NCCL with the settings capture wants;
* :func:`prepare_ddp` builds DDP on graphed's capture stream;
* TrainStep recognises DDP, warms up 11 iterations, captures in
  ``thread_local`` mode, and refuses with the fix what it cannot do for you
  (:func:`check_ddp`);
* :func:`shutdown` destroys the graphs before the process group, within a
  time limit, so teardown does not hang (pytorch#115388).

Typical use, under ``torchrun --nproc-per-node N``::

    graphed.distributed.init_process_group()
    model = graphed.distributed.prepare_ddp(GPT().cuda())
    step = graphed.TrainStep.from_parts(model, optimizer, loss_fn, sample_batch)
    for batch in data:
        loss = step(batch)
    graphed.distributed.shutdown()
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import weakref
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import _C, fp8
from ._C import GraphedError
from .capture import _device_index, capture_stream

#: Eager iterations before a DDP iteration is captured (see Note [Capturing
#: collectives], point 2).
COLLECTIVE_WARMUP_ITERS: int = _C.COLLECTIVE_WARMUP_ITERS

#: Capture error mode used for DDP: NCCL's watchdog queries events from its own
#: thread while the capture runs (Note [Capturing collectives], point 3).
COLLECTIVE_CAPTURE_ERROR_MODE = "thread_local"

#: Environment :func:`init_process_group` sets (unless already set) before the
#: process group exists: PyTorch's CUDA-graph notes ask for NCCL's asynchronous
#: error handling to be off when DDP's collectives are captured.
CAPTURE_ENVIRONMENT: Dict[str, str] = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}

#: Environment that keeps NVLink multicast (NVLS) off in NCCL, torch's symmetric
#: memory and NVSHMEM. ``init_process_group(nvlink_multicast=False)`` sets it;
#: graphed's tests, benchmarks and example run with it.
NVLINK_MULTICAST_OFF: Dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# torch reads each NCCL setting from the first of these names that is set.
_ASYNC_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
_BLOCKING_WAIT = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")
_OFF = ("", "0", "false", "no", "n", "off")

# The NCCL environment as it was when init_process_group (ours) created the
# process group; NCCL reads it then, not later.
_environment_at_init: Optional[Dict[str, Optional[str]]] = None

# TrainSteps whose graphs captured collectives: released before the process
# group is destroyed (shutdown, or at exit).
_collective_steps: "weakref.WeakSet[Any]" = weakref.WeakSet()
_atexit_registered = False


def available() -> bool:
    """True when this torch build has torch.distributed."""
    return torch.distributed.is_available()


def _ddp_class() -> Optional[type]:
    if not available():
        return None
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel


def find_ddp(modules: Iterable[nn.Module]) -> List[nn.Module]:
    """The DistributedDataParallel modules among ``modules`` and their submodules."""
    ddp = _ddp_class()
    if ddp is None:
        return []
    found: List[nn.Module] = []
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, ddp) and all(sub is not f for f in found):
                found.append(sub)
    return found


def _first_set(names: Sequence[str]) -> Tuple[str, Optional[str]]:
    environment = _environment_at_init if _environment_at_init is not None else os.environ
    for name in names:
        value = environment.get(name)
        if value is not None:
            return name, value
    return names[0], None


def _nccl_environment_problems(issuer: str = "DDP's") -> List[str]:
    """NCCL settings that stop ``issuer`` collectives from being captured."""
    problems = []
    name, value = _first_set(_ASYNC_ERROR_HANDLING)
    if value is None or value.strip() != "0":
        found = "unset (torch then turns it on)" if value is None else f"{value!r}"
        problems.append(
            f"NCCL's asynchronous error handling is on ({name} is {found}); PyTorch's CUDA-graph "
            f"notes require it off when {issuer} collectives are captured. Set "
            "TORCH_NCCL_ASYNC_ERROR_HANDLING=0 in the environment before the process group is "
            "created, or create it with graphed.distributed.init_process_group(), which does.")
    name, value = _first_set(_BLOCKING_WAIT)
    if value is not None and value.strip().lower() not in _OFF:
        problems.append(
            f"{name}={value} makes every collective's wait() block the host until the GPU is "
            "done, which cannot happen inside a graph capture. Unset it (and "
            "NCCL_BLOCKING_WAIT) before the process group is created.")
    return problems


def check_ddp(model: nn.Module) -> List[str]:
    """What stops the all-reduces of DistributedDataParallel ``model`` from being
    captured in a TrainStep: one sentence per problem, each with its fix; empty
    when there is none. The gradient accumulators' stream, warm-up and capture
    mode are checked by the C++ core (Note [Capturing collectives])."""
    ddp_class = _ddp_class()
    if ddp_class is None or not isinstance(model, ddp_class):
        return [f"Expected a DistributedDataParallel model, got {type(model).__name__}."]
    problems = []
    if getattr(model, "_use_python_reducer", False):
        problems.append(
            "This DistributedDataParallel uses the Python reducer of compiled DDP "
            "(torch._dynamo.config.optimize_ddp='python_reducer'); its all-reduces cannot be "
            "captured by graphed. Turn that setting off.")
    backend = str(torch.distributed.get_backend(model.process_group))
    if backend != "nccl":
        problems.append(
            f"DistributedDataParallel's process group uses the {backend!r} backend; captured "
            "all-reduces need NCCL. Create the process group with backend='nccl' "
            "(graphed.distributed.init_process_group() does).")
    else:
        problems += _nccl_environment_problems()
    if model.find_unused_parameters and not model.static_graph:
        problems.append(
            "DistributedDataParallel was built with find_unused_parameters=True: every iteration "
            "it searches the autograd graph on the host and uploads the used-parameter map, so "
            "a replay would reuse the map of the captured iteration. Build it with "
            "find_unused_parameters=False (every parameter must get a gradient), or with "
            "static_graph=True when the set of unused parameters never changes.")
    broadcast = getattr(model, "broadcast_buffers", False)
    ignored = getattr(model, "parameters_to_ignore", set())
    fp8_state = [n for n in fp8.state_buffer_names(model.module) if n not in ignored]
    if broadcast and fp8_state:
        problems.append(
            f"DistributedDataParallel broadcasts rank 0's buffers before every forward, "
            f"including {len(fp8_state)} FP8 scaling buffers ({fp8_state[0]}, ...): on the "
            "other ranks that overwrites the amaxes earlier microbatches recorded (Note [FP8 "
            "state is not DDP's to broadcast]). Convert the model with graphed.fp8.convert "
            "before wrapping it, or call graphed.fp8.keep_state_out_of_ddp(module) before "
            "DistributedDataParallel(module), or turn DDP's buffer sync off "
            "(broadcast_buffers=False; forward_sync_buffers=False on newer torch).")
    if not model.require_backward_grad_sync:
        problems.append(
            "The TrainStep is being built inside DistributedDataParallel.no_sync(): the captured "
            "iteration would never all-reduce its gradients. Build it outside no_sync().")
    devices = sorted({str(p.device) for p in model.parameters()})
    if any(not d.startswith("cuda") for d in devices) or len(devices) != 1:
        problems.append(
            f"DistributedDataParallel's parameters are on {', '.join(devices) or 'no device'}; a "
            "captured iteration needs them on one GPU. Move the model to its rank's GPU "
            "(model.to(f'cuda:{local_rank}')) before wrapping it.")
    elif torch.device(devices[0]).index != torch.cuda.current_device():
        problems.append(
            f"DistributedDataParallel's parameters are on {devices[0]} but the current device is "
            f"cuda:{torch.cuda.current_device()}. Call torch.cuda.set_device(local_rank) before "
            "building the model and the TrainStep.")
    return problems


def raise_problems(problems: Sequence[str],
                   issuer: str = "DistributedDataParallel's all-reduces") -> None:
    """Raises GraphedError "Cannot capture <issuer>: ..." listing ``problems``
    (one sentence each, with its fix); nothing when there are none."""
    if len(problems) == 1:
        raise GraphedError(f"Cannot capture {issuer}: {problems[0]}")
    if problems:
        listed = "\n".join(f"  {i + 1}. {p}" for i, p in enumerate(problems))
        raise GraphedError(f"Cannot capture {issuer}:\n{listed}")


def collective_capture(modules: Iterable[nn.Module]) -> Optional[List[torch.Tensor]]:
    """For TrainStep: None when no DDP is among ``modules``; else checks each DDP
    (raising GraphedError with every problem and its fix), keeps DDP's runtime
    statistics out of the captured iteration, and returns the parameters whose
    gradient hooks launch the all-reduces."""
    ddps = find_ddp(modules)
    if not ddps:
        return None
    problems: List[str] = []
    for ddp in ddps:
        problems += check_ddp(ddp)
    raise_problems(problems)
    hooked: List[torch.Tensor] = []
    for ddp in ddps:
        # Past iteration 10 DDP times one iteration in every `sample rate` with
        # CUDA events it synchronizes on at the next forward; when that would
        # fall on the captured iteration (after earlier eager iterations) the
        # capture would fail. Statistics are telemetry: sample (almost) never.
        ddp._set_ddp_runtime_logging_sample_rate(2**31 - 1)
        hooked += [p for p in ddp.parameters() if p.requires_grad]
    return hooked


def init_process_group(backend: str = "nccl", *, nvlink_multicast: bool = True,
                       **kwargs: Any) -> Any:
    """torch.distributed.init_process_group with the settings capture needs.

    Sets :data:`CAPTURE_ENVIRONMENT` (overriding torchrun's
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1), and with ``nvlink_multicast=False`` also
    :data:`NVLINK_MULTICAST_OFF`; selects the GPU of ``LOCAL_RANK`` (torchrun)
    when no device is current yet and binds NCCL to it (``device_id``), so the
    communicator exists before any capture. Other arguments go to
    torch.distributed.init_process_group. Returns the default process group."""
    global _environment_at_init
    if not available():
        raise GraphedError("torch.distributed is not available in this torch build.")
    if torch.distributed.is_initialized():
        raise GraphedError(
            "The default process group already exists, so its NCCL settings are fixed. Call "
            "graphed.distributed.init_process_group() instead of "
            "torch.distributed.init_process_group(), or set TORCH_NCCL_ASYNC_ERROR_HANDLING=0 "
            "in the environment before creating it.")
    # Set, not defaulted: torchrun's elastic agent exports
    # TORCH_NCCL_ASYNC_ERROR_HANDLING=1 to every worker, so a default would
    # never apply under the launcher this module is meant for.
    os.environ.update(CAPTURE_ENVIRONMENT)
    if not nvlink_multicast:
        os.environ.update(NVLINK_MULTICAST_OFF)
    if backend == "nccl" and "device_id" not in kwargs:
        if "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    torch.distributed.init_process_group(backend=backend, **kwargs)
    _environment_at_init = {name: os.environ.get(name)
                            for name in _ASYNC_ERROR_HANDLING + _BLOCKING_WAIT}
    return torch.distributed.group.WORLD


@contextlib.contextmanager
def on_capture_stream(device: Optional[Any] = None) -> Iterator[torch.cuda.Stream]:
    """Makes graphed's capture stream (of ``device``, default the current GPU)
    current for the body, after the work already queued on the current
    stream, and makes the current stream wait for it afterwards. A
    DistributedDataParallel constructed inside creates its gradient
    accumulators there, so a TrainStep can capture its all-reduces (Note
    [Capturing collectives], point 1). For code that builds DDP itself (a
    framework's strategy); :func:`prepare_ddp` uses it."""
    index = torch.cuda.current_device() if device is None else _device_index(device)
    stream = capture_stream(index)
    current = torch.cuda.current_stream(index)
    stream.wait_stream(current)
    try:
        with torch.cuda.device(index), torch.cuda.stream(stream):
            yield stream
    finally:
        current.wait_stream(stream)


def build_ddp(module: nn.Module, device: Optional[Any] = None, **ddp_kwargs: Any) -> nn.Module:
    """DistributedDataParallel(module, **ddp_kwargs) built as a captured step
    needs it: on graphed's capture stream (:func:`on_capture_stream`), with the
    FP8 scaling state of graphed.fp8 layers left out of DDP's buffer broadcast.
    Checks nothing: :func:`prepare_ddp` checks and raises; the integrations
    build with this and decide later (:func:`framework_ddp_problems`)."""
    ddp_class = _ddp_class()
    if ddp_class is None:
        raise GraphedError("torch.distributed is not available in this torch build.")
    fp8.keep_state_out_of_ddp(module)
    with on_capture_stream(device):
        return ddp_class(module, **ddp_kwargs)


def prepare_ddp(module: nn.Module, *, device: Optional[Any] = None, **ddp_kwargs: Any) -> nn.Module:
    """Wraps ``module`` (already on its GPU) in DistributedDataParallel so that a
    TrainStep can capture its all-reduces: built on graphed's capture stream
    (Note [Capturing collectives], point 1), with ``device_ids`` set to the
    module's device, and the FP8 scaling state of graphed.fp8 layers left out
    of DDP's buffer broadcast (Note [FP8 state is not DDP's to broadcast]).
    Other keyword arguments go to DistributedDataParallel; problems (backend,
    NCCL environment, find_unused_parameters) are raised here rather than at
    capture."""
    ddp_class = _ddp_class()
    if ddp_class is None or not torch.distributed.is_initialized():
        raise GraphedError(
            "prepare_ddp needs an initialised process group: call "
            "graphed.distributed.init_process_group() first.")
    devices = {p.device for p in module.parameters()}
    found = ", ".join(sorted(str(d) for d in devices)) or "no parameters"
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise GraphedError(
            f"prepare_ddp expected every parameter of {type(module).__name__} on this rank's "
            f"GPU, found {found}. Move the model first: module.to(f'cuda:{{local_rank}}').")
    index = next(iter(devices)).index if device is None else _device_index(device)
    if next(iter(devices)).index != index:
        raise GraphedError(
            f"prepare_ddp expected every parameter of {type(module).__name__} on cuda:{index}, "
            f"found {found}. Move the model first: module.to('cuda:{index}').")
    ddp_kwargs.setdefault("device_ids", [index])
    model = build_ddp(module, index, **ddp_kwargs)
    raise_problems(check_ddp(model))
    return model


# Note [DDP built by a framework]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The Hugging Face Trainer (through accelerate's prepare_model) and
# Lightning's DDPStrategy (_setup_model) construct the
# DistributedDataParallel themselves, and the integrations capture the whole
# optimizer step through that wrapper, so its forward prepares the reducer and
# its gradient hooks launch the all-reduces inside the graph, as for a
# TrainStep over prepare_ddp's model. Four things differ from prepare_ddp:
#  1. The stream. accelerate builds DDP on the current (default) stream,
#     Lightning on a fresh side stream; Note [Capturing collectives] point 1
#     needs graphed's capture stream. The integrations make the framework's
#     construction run under on_capture_stream (Lightning: the strategy's
#     _setup_model replaced for the fit by build_ddp with the strategy's
#     device ids and DDP arguments). A DDP built before graphed could do so
#     is refused by the core at capture, before any warm-up, and the
#     integration falls back.
#  2. The checks. framework_ddp_problems is check_ddp plus what only a
#     framework configures: a communication hook (register_comm_hook; Python
#     code run per bucket that a replay would not run). The integrations turn
#     each problem into a counted fallback with its fix instead of raising.
#  3. Warm-up. The frameworks' own warm-up defaults (3) are below
#     COLLECTIVE_WARMUP_ITERS; collective_warmup raises them under DDP.
#  4. Gradient accumulation. The frameworks run the non-final micro-batches
#     of an optimizer step under no_sync(). The captured iteration (Note [One
#     training iteration]) all-reduces every micro-batch's gradients instead:
#     the sum of the averaged micro-batch gradients equals the average of the
#     summed ones up to rounding (exactly at world size 1), at the cost of
#     one all-reduce per micro-batch instead of one per step. The eager
#     fallback of a step the graph cannot take runs its micro-batches synced
#     too. Every rank must take the same decision each step (a graphed step
#     on one rank against an eager one on another pairs different
#     collectives): the per-step fallbacks depend on batch shapes only, so
#     fixed shapes (drop_last, padding to one length) keep the ranks together.


def framework_ddp_problems(model: nn.Module) -> List[str]:
    """What stops an integration (the HF Trainer's, Lightning's) from capturing
    the all-reduces of the DistributedDataParallel ``model`` its framework
    built: :func:`check_ddp`, and a communication hook registered on it. One
    sentence per problem, each with its fix; empty when there is none (Note
    [DDP built by a framework])."""
    problems = check_ddp(model)
    hooks = getattr(model, "_comm_hooks", None) or []
    if hooks:
        names = ", ".join(getattr(hook, "__qualname__", None) or type(hook).__name__
                          for hook, _ in hooks)
        problems.append(
            f"DistributedDataParallel has a communication hook ({names}, from "
            "register_comm_hook): Python code run for every gradient bucket, which a replayed "
            "graph would not run. graphed captures DDP's built-in all-reduce only; remove the "
            "hook (accelerate: no comm_hook in DistributedDataParallelKwargs; Lightning: "
            "DDPStrategy(ddp_comm_hook=None)).")
    return problems


def describe_problem(problem: str) -> str:
    """One problem of :func:`check_ddp` as a sentence that names what it is
    about, for a fallback reason."""
    return f"Cannot capture DistributedDataParallel's all-reduces: {problem}"


def collective_warmup(modules: Iterable[nn.Module], warmup: int) -> int:
    """``warmup``, raised to :data:`COLLECTIVE_WARMUP_ITERS` when a
    DistributedDataParallel is among ``modules`` (Note [Capturing
    collectives], point 2)."""
    return max(warmup, COLLECTIVE_WARMUP_ITERS) if find_ddp(modules) else warmup


def register(step: Any) -> None:
    """Records a TrainStep whose graph captured collectives, so that
    :func:`shutdown` (or the end of the process) releases it first."""
    global _atexit_registered
    _collective_steps.add(step)
    if not _atexit_registered:
        atexit.register(release_graphs)
        _atexit_registered = True


def release_graphs() -> int:
    """Releases the graphs of every live TrainStep that captured collectives
    (see TrainStep.release); returns how many were released."""
    steps = [s for s in list(_collective_steps) if not s.released]
    for step in steps:
        step.release()
    return len(steps)


def shutdown(timeout: float = 120.0) -> None:
    """Ends distributed training cleanly: releases the graphs that captured
    collectives, waits for the GPU, then destroys the process group. A graph
    that captured NCCL work and is still alive makes destroy_process_group hang
    (pytorch#115388); if it has not returned after ``timeout`` seconds this
    raises GraphedError instead of hanging (the process may then need
    ``os._exit`` to end)."""
    release_graphs()
    if not available() or not torch.distributed.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    failures: List[BaseException] = []

    def destroy() -> None:
        try:
            torch.distributed.destroy_process_group()
        except BaseException as error:  # re-raised in the calling thread
            failures.append(error)

    thread = threading.Thread(target=destroy, name="graphed-destroy-process-group", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise GraphedError(
            f"torch.distributed.destroy_process_group() did not return within {timeout:g} s. "
            "A CUDA graph that captured NCCL work keeps its communicator alive "
            "(pytorch#115388); graphed released its own graphs, so another one is still alive "
            "(a torch.cuda.CUDAGraph, or a TrainStep held elsewhere): delete it before "
            "shutdown(). The process may not exit on its own; os._exit() ends it.")
    if failures:
        raise failures[0]


def split_ddp(callables: Any) -> Tuple[Any, Callable[[Any], Any]]:
    """For graphed.make_graphed_callables: ``callables`` (one callable or a tuple)
    with every DistributedDataParallel replaced by the module it wraps, and a
    function that takes the graphed result back into the DDP wrappers.

    DDP's forward prepares its reducer on the host every iteration, so it must
    stay eager: the wrapped module is graphed, and DDP's hooks all-reduce the
    gradients the graphed backward hands to autograd, as in eager training."""
    ddp_class = _ddp_class()
    single = not isinstance(callables, tuple)
    items = (callables,) if single else tuple(callables)
    wrappers: List[Optional[nn.Module]] = []
    inner = []
    for item in items:
        if ddp_class is not None and isinstance(item, ddp_class):
            wrappers.append(item)
            inner.append(item.module)
        else:
            wrappers.append(None)
            inner.append(item)

    def rewrap(graphed: Any) -> Any:
        results = (graphed,) if single else tuple(graphed)
        out = []
        for wrapper, original, result in zip(wrappers, inner, results):
            if wrapper is None:
                out.append(result)
                continue
            if result is not original:
                if not isinstance(result, nn.Module) or \
                        {id(p) for p in result.parameters()} != {id(p) for p in original.parameters()}:
                    raise GraphedError(
                        f"The graphed {type(original).__name__} does not own the parameters "
                        "DistributedDataParallel all-reduces; it cannot replace the wrapped "
                        "module.")
                wrapper.module = result
            out.append(wrapper)
        return out[0] if single else tuple(out)

    return (inner[0] if single else tuple(inner)), rewrap
