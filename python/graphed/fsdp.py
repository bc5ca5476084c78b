"""graphed under FSDP2 (``torch.distributed.fsdp.fully_shard``).

A :class:`graphed.TrainStep` over a model sharded with ``fully_shard`` captures
the whole iteration: FSDP2's unshard (all-gather and copy-out) before each
module's forward and backward, the forward and backward themselves, the
gradient reduce-scatters, and the optimizer step on the sharded parameters.
torch's FSDP2 runs as it does eagerly during warm-up and capture; this module
checks that the configuration leaves nothing a replay would skip or a
capture would reject (:func:`check_fsdp2`), brings FSDP2 to the state a
capture needs (:func:`prepare_capture`), and hands the core plain tensors
where FSDP2 has DTensors (:func:`local_tensors`). See Note [FSDP2 inside a
captured step].

Typical use, under ``torchrun --nproc-per-node N``::

    graphed.distributed.init_process_group()
    model = GPT().cuda()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = graphed.TrainStep.from_parts(model, optimizer, loss_fn, sample_batch)
    for batch in data:
        loss = step(batch)
    graphed.distributed.shutdown()
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch
from torch import nn

from ._C import GraphedError

# Note [FSDP2 inside a captured step]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# FSDP2 (torch 2.14, torch/distributed/fsdp/_fully_shard/) keeps each
# parameter sharded, as a DTensor whose local tensor is this rank's shard, and
# around every fully_shard module's forward and backward runs Python hooks
# that unshard (all-gather into a flat buffer, copy out into the unsharded
# parameters), reshard (free that memory) and, after the backward,
# reduce-scatter the gradients into new sharded DTensor gradients. A captured
# step runs that Python once, at capture; replays run only its GPU work. What
# that means, piece by piece:
#
# 1. Storage resizing. The unsharded parameters are views of per-parameter
#    all-gather outputs whose storage FSDP2 allocates with
#    untyped_storage().resize_(n) in every unshard and frees with resize_(0)
#    in every reshard (_fsdp_param.py alloc_storage/free_storage). In a
#    capture both go through the caching allocator into the graph's private
#    pool: the kernels record pool addresses, the Python tensors end the
#    captured step with empty storage, as after an eager step, and nothing
#    outside the graph reads those addresses. This works because every step
#    starts and ends with all parameters sharded: a configuration that keeps
#    unsharded storage across the step boundary (reshard_after_backward=False,
#    a pending explicit unshard()) would have the graph read or write memory
#    allocated outside it, or skip the unshard on later steps. Refused.
# 2. Streams and events. FSDP2 runs copy-in and all-gathers on
#    all_gather_copy_in_stream and all_gather_stream, reduce-scatters on
#    reduce_scatter_stream (all-reduces of HSDP on all_reduce_stream), ordered
#    by events and wait_stream. Every side stream first waits on the current
#    (capture) stream within the step (_root_pre_forward, foreach_reduce), so
#    it joins the capture, and the current stream waits on their last events
#    before the step ends (_root_post_backward_final_callback,
#    finalize_backward). What breaks capture is an event recorded in one step
#    and waited on in the next: a capture cannot depend on work outside it
#    (CUDA_ERROR_STREAM_CAPTURE_ISOLATION). FSDP2 leaves such events behind
#    when the backward is not the last (set_is_last_backward(False): the
#    post-reduce events and reduce-scatter states survive the step), when
#    parameters reshard to a smaller mesh after forward (an int
#    reshard_after_forward: _reshard_after_forward_event), and when the user
#    set a post-optimizer event (set_post_optim_event). All refused.
#    TorchTitan's whole-step graphs (pytorch/torchtitan#3559) found the same
#    isolation error with the root module resharding after forward as well
#    ("always"); graphed refuses that too. FSDP2 uses no record_stream: it
#    keeps the all-gather and reduce-scatter buffers alive through Python
#    references until the consuming stream waited, which capture preserves.
# 3. Lazy initialisation. The root's first forward picks the root, creates
#    the four streams, pads the local shards (reset_sharded_param may replace
#    a DTensor's local tensor), and the first unshard creates the all-gather
#    output tensors and the unsharded Parameters. prepare_capture runs the
#    lazy initialisation before TrainStep collects the tensors it snapshots,
#    and warm-up (eager, on the capture stream) does the rest.
# 4. Gradient accumulators. The unsharded Parameters are autograd leaves that
#    live across steps. A previous eager loss that is still referenced keeps
#    their AccumulateGrad nodes alive on the stream of that step; the captured
#    backward would then make that stream wait on captured work. The C++ core
#    detaches stale accumulators of the tensors it snapshots (Note [Gradient
#    accumulators on the capture stream]), but it never sees these
#    Parameters, so prepare_capture drops FSDP2's unsharded Parameters while
#    everything is sharded; the next unshard makes fresh ones (FSDP2's own
#    first-unshard path), whose accumulators warm-up creates on the capture
#    stream. Parameters with all-gather extensions (fsdp_pre_all_gather, e.g.
#    torchao's float8) keep theirs: their unsharded tensors are the
#    extension's.
# 5. Post-backward callbacks. FSDP2 finishes each backward in a callback
#    queued with Variable._execution_engine.queue_callback, and registers its
#    pre-backward tensor hooks and RegisterPostBackwardFunction nodes anew in
#    every forward. All of it runs inside the captured backward, so the
#    captured graph holds the work they launch.
# 6. CPU state machines. The training states (IDLE, FORWARD, PRE_BACKWARD,
#    POST_BACKWARD), iter_forward_root, post_forward_order and the prefetch
#    bookkeeping are Python and are not replayed; they return to IDLE and
#    empty at the end of each step, so the Python state after capture is that
#    of a finished eager step and stays valid for every replay. Which
#    collectives run is decided in Python too (reduce_grads,
#    is_last_backward, reshard_after_forward): the graph keeps the decision
#    made at capture, so those settings must not change after it.
# 7. Gradients. foreach_reduce assigns a new DTensor .grad when there is
#    none, else adds into its local tensor. The iteration drops the gradients
#    (zero_grad(set_to_none=True)), so at capture FSDP2 creates them in the
#    graph's pool, and every replay writes them there: after construction each
#    parameter's .grad is the graph's buffer, as for a plain model.
# 8. Host syncs. CPU offloading synchronizes on grad_offload_event in
#    finalize_backward and copies the shards to and from the host:
#    CPUOffloadPolicy is refused. _to_kwargs moves inputs to the device; the
#    static batch buffers are already there, so it copies nothing. At world
#    size 1 FSDP2 runs no collective at all (unshard copies the shard,
#    foreach_reduce copies the gradient), so a one-rank test exercises all of
#    the above but no NCCL kernel; the captured all-gathers and
#    reduce-scatters, with NCCL's requirements of Note [Capturing
#    collectives] (thread_local capture mode, the NCCL environment, teardown
#    before the process group), start at two ranks.
# 9. DTensors in the core. The C++ core snapshots, restores and compares
#    (Note [Tensors a graph reads in place]) by storage; DTensor parameters,
#    gradients and optimizer states are wrappers without one. TrainStep hands
#    the core their local tensors (local_tensors), which hold the data the
#    graph reads and writes, and for the per-step check of a module's
#    parameters the local tensors as they were at capture: replacing a
#    sharded parameter object after capture is therefore not detected, moving
#    its local tensor is. The optimizer itself stays on the DTensors: fused
#    AdamW/Adam/SGD dispatch to their local tensors (DTensor's pointwise
#    rules), with graphed's device learning rate and step counters.
# Options FSDP2 offers that capture keeps: reshard_after_forward=True or False
# on the blocks (False keeps the unsharded parameters from forward to
# backward and saves the backward all-gather; both stay inside the step),
# MixedPrecisionPolicy, set_unshard_in_backward, set_gradient_divide_factor
# (set_reduce_scatter_divide_factor), set_force_sum_reduction_for_comms,
# set_reduce_scatter_unused_params, explicit forward and backward prefetching.
# Not supported yet, refused: clip_grad_norm, skip_nonfinite and fp16 loss
# scaling (the gradient guard would take norms of sharded DTensor gradients,
# whose reduction across ranks is not in the core), graphed.fp8 layers,
# symmetric-memory and process-group-allocated communication buffers
# (set_symm_mem_for_comm, set_allocate_memory_from_process_group_for_comm:
# a rendezvous or a foreign memory pool inside the capture),
# set_requires_gradient_sync(False) (the captured step would never reduce).

#: Capture error mode TrainStep uses under FSDP2 (Note [Capturing
#: collectives], point 3: NCCL's watchdog queries events from its own thread).
FSDP2_CAPTURE_ERROR_MODE = "thread_local"

_ISSUER = "FSDP2's all-gathers and reduce-scatters"


def available() -> bool:
    """True when this torch build has FSDP2 (torch.distributed.fsdp.fully_shard)."""
    return _fsdp_module_class() is not None


def _fsdp_module_class() -> Optional[type]:
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def _dtensor_class() -> Optional[type]:
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def find_fsdp2(modules: Iterable[nn.Module]) -> List[nn.Module]:
    """The modules sharded with ``fully_shard`` among ``modules`` and their
    submodules, outermost first."""
    fsdp_class = _fsdp_module_class()
    if fsdp_class is None:
        return []
    found: List[nn.Module] = []
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, fsdp_class) and all(sub is not f for f in found):
                found.append(sub)
    return found


def param_groups(state: Any) -> List[Any]:
    """The FSDP2 parameter groups of one fully_shard state: a list in newer torch
    (2.14: ``_fsdp_param_groups``), at most one in older (2.11: ``_fsdp_param_group``)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def _states(model: nn.Module) -> List[Any]:
    """The FSDP2 states of ``model``'s fully_shard modules, each once."""
    states: List[Any] = []
    for module in find_fsdp2([model]):
        state = module._get_fsdp_state()
        if all(state is not s for s in states):
            states.append(state)
    return states


def _class_name(module: nn.Module) -> str:
    """The class a module had before fully_shard made it an FSDP subclass."""
    fsdp_class = _fsdp_module_class()
    if fsdp_class is not None and isinstance(module, fsdp_class):
        return type(module).__mro__[getattr(module, "_orig_cls_mro_index", 2)].__name__
    return type(module).__name__


def _module_name(model: nn.Module, module: nn.Module) -> str:
    for name, sub in model.named_modules():
        if sub is module:
            return name or _class_name(model)
    return _class_name(module)


def _group_name(model: nn.Module, group: Any) -> str:
    """The module (or modules) of an FSDP2 parameter group, by name in ``model``."""
    names = [_module_name(model, m) for m in getattr(group, "modules", ())]
    return f"`{', '.join(names)}`" if names else "a fully_shard module"


def _reshards_to_other_mesh(group: Any) -> bool:
    post = group.post_forward_mesh_info
    return post is not None and post != group.mesh_info


def _root_reshards_after_forward(state: Any) -> bool:
    # Before lazy init a root left at the default (auto) setting has its
    # post-forward mesh still set; _lazy_init clears it (no reshard).
    if state._is_root is None and state._auto_reshard_after_forward:
        return False
    return any(g.post_forward_mesh_info is not None for g in param_groups(state))


def _process_group(group: Any) -> Optional[Any]:
    mesh_info = group.mesh_info
    for name in ("shard_process_group", "replicate_process_group"):
        pg = getattr(mesh_info, name, None)
        if pg is not None:
            return pg
    return None


def _world_size(group: Any) -> int:
    mesh = getattr(group.mesh_info, "mesh", None)
    return int(mesh.size()) if mesh is not None else 1


def world_size(model: nn.Module) -> int:
    """The largest data-parallel world over which ``model``'s FSDP2 groups
    shard or replicate (1: FSDP2 runs no collective)."""
    return max((_world_size(g) for s in _states(model) for g in param_groups(s)), default=1)


def check_fsdp2(model: nn.Module, *, error_mode: Optional[str] = None) -> List[str]:
    """What stops a TrainStep from capturing a step of ``model``, sharded with
    ``fully_shard``: one sentence per problem, each with its fix; empty when
    there is none. ``error_mode`` is the capture error mode the step will use,
    when known. Reads FSDP2's state only (no lazy initialisation)."""
    fsdp_class = _fsdp_module_class()
    if fsdp_class is None or not isinstance(model, fsdp_class):
        sharded = find_fsdp2([model])
        if sharded:
            names = ", ".join(_module_name(model, m) for m in sharded[:3])
            return [
                f"Expected fully_shard on the whole {type(model).__name__} too, found it only on "
                f"submodules ({names}{', ...' if len(sharded) > 3 else ''}): without a root "
                "module FSDP2 has no per-step start and end that order its streams. Call "
                "fully_shard(model) after sharding the blocks, as FSDP2's documentation does."]
        return [f"Expected a model sharded with fully_shard (an FSDPModule), got "
                f"{type(model).__name__}."]
    problems: List[str] = []
    root_state = model._get_fsdp_state()
    if root_state._is_root is False:
        problems.append(
            f"{_class_name(model)} is not FSDP2's root: its forward already ran inside an "
            "outer fully_shard module. Build the TrainStep over the outermost fully_shard "
            "module.")
    if _root_reshards_after_forward(root_state):
        problems.append(
            f"The root {_class_name(model)} reshards its parameters after forward "
            "(reshard_after_forward=True or set_reshard_after_forward(True) on the root); its "
            "backward all-gather then waits on FSDP2 stream work outside the capture "
            "(CUDA_ERROR_STREAM_CAPTURE_ISOLATION, as TorchTitan found). Leave the root at the "
            "default, or call model.set_reshard_after_forward(False, recurse=False).")
    ctx = root_state._state_ctx
    if ctx.post_optim_event is not None:
        problems.append(
            "A post-optimizer event is set (set_post_optim_event): FSDP2's next forward waits on "
            "an event recorded outside the capture. Do not call set_post_optim_event on a model "
            "a TrainStep trains; the captured step orders the optimizer itself.")
    if not ctx.is_last_backward:
        problems.append(
            "set_is_last_backward(False) is in effect: FSDP2 would carry reduce-scatter events "
            "from one step into the next, which a capture cannot wait on. Call "
            "model.set_is_last_backward(True), and use TrainStep.from_parts(..., microbatches=n) "
            "for gradient accumulation.")
    devices = set()
    for state in _states(model):
        for group in param_groups(state):
            name = _group_name(model, group)
            offload = type(getattr(group, "offload_policy", None)).__name__
            if offload == "CPUOffloadPolicy":
                problems.append(
                    f"FSDP2 offloads {name}'s parameters to the CPU (CPUOffloadPolicy): it copies "
                    "shards to and from the host and synchronizes the host on their copies, "
                    "which a graph cannot. Shard without offload_policy.")
            if _reshards_to_other_mesh(group):
                problems.append(
                    f"{name} reshards to a smaller mesh after forward (an int "
                    "reshard_after_forward); the event of that reshard can outlive the step. "
                    "Use reshard_after_forward=True or False.")
            if not group.reduce_grads:
                problems.append(
                    f"Gradient reduction is off for {name} (set_requires_gradient_sync(False)): "
                    "the captured step would never reduce-scatter its gradients. Call "
                    "model.set_requires_gradient_sync(True) before building the TrainStep, and "
                    "use microbatches=n for accumulation.")
            elif not group.all_reduce_grads:
                problems.append(
                    f"HSDP all-reduce is off for {name} (set_requires_all_reduce(False)): partial "
                    "gradients would accumulate across replays outside the optimizer's view. Call "
                    "model.set_requires_all_reduce(True).")
            if not group.reshard_after_backward:
                problems.append(
                    f"{name} keeps its parameters unsharded after backward "
                    "(set_reshard_after_backward(False)): the next step would skip the unshard "
                    "and train on stale parameters, and the graph would read memory allocated "
                    "outside it. Call model.set_reshard_after_backward(True).")
            comms = {type(group._all_gather_comm).__name__,
                     type(group._reduce_scatter_comm).__name__}
            special = sorted(c for c in comms if c.startswith(("SymmMem", "ProcessGroupAlloc")))
            if special:
                problems.append(
                    f"{name} communicates through {' and '.join(special)} "
                    "(set_symm_mem_for_comm or set_allocate_memory_from_process_group_for_comm): "
                    "their buffers come from another memory pool or a rendezvous, neither of "
                    "which a capture can record. Keep FSDP2's default communication buffers.")
            if not group.is_sharded or group._all_gather_result is not None:
                problems.append(
                    f"{name}'s parameters are unsharded (an explicit unshard(), or a forward "
                    "without backward, left them so): a captured step must start with every "
                    "parameter sharded. Call reshard() on each fully_shard module, or finish the "
                    "step, before building the TrainStep.")
            for fsdp_param in group.fsdp_params:
                devices.add(fsdp_param.sharded_param.device)
            ranks = _world_size(group)
            pg = _process_group(group)
            if ranks > 1 and pg is not None:
                backend = str(torch.distributed.get_backend(pg))
                if backend != "nccl":
                    problems.append(
                        f"{name} shards over a process group with the {backend!r} backend; "
                        "captured all-gathers and reduce-scatters need NCCL. Create the process "
                        "group with backend='nccl' (graphed.distributed.init_process_group() "
                        "does).")
    if world_size(model) > 1:
        from . import distributed
        problems += distributed._nccl_environment_problems("FSDP2's")
        if error_mode == "global":
            problems.append(
                "The capture error mode is \"global\": NCCL's watchdog thread queries CUDA events "
                "while the capture runs, and in that mode the query invalidates the capture. Use "
                "capture_error_mode=\"thread_local\" (the default under FSDP2).")
    found = ", ".join(sorted(str(d) for d in devices)) or "no device"
    if any(d.type != "cuda" for d in devices) or len(devices) > 1:
        problems.append(
            f"FSDP2's parameters are on {found}; a captured step needs them on one GPU. Shard a "
            "model that is on its rank's GPU, or pass mesh=init_device_mesh('cuda', ...).")
    elif devices and torch.cuda.is_available() and \
            next(iter(devices)).index not in (None, torch.cuda.current_device()):
        problems.append(
            f"FSDP2's parameters are on {found} but the current device is "
            f"cuda:{torch.cuda.current_device()}. Call torch.cuda.set_device(local_rank) before "
            "sharding the model and building the TrainStep.")
    return problems


def raise_problems(problems: Sequence[str]) -> None:
    """Raises GraphedError listing ``problems`` (nothing when empty), worded
    as graphed.distributed's refusals of DDP."""
    from . import distributed

    distributed.raise_problems(problems, _ISSUER)


def check_step_settings(*, clip_grad_norm: Optional[float], skip_nonfinite: bool,
                        amp: Optional[str], loss_scaling: Any, float8: bool) -> List[str]:
    """The settings of TrainStep.from_parts that graphed does not support under
    FSDP2 yet (Note [FSDP2 inside a captured step]), one sentence each."""
    problems = []
    guarded = [name for name, on in (("clip_grad_norm", clip_grad_norm is not None),
                                     ("skip_nonfinite", skip_nonfinite),
                                     ('amp="fp16"', amp == "fp16" or loss_scaling is not None))
               if on]
    if guarded:
        problems.append(
            f"{', '.join(guarded)} under FSDP2 is not supported yet: the gradient guard would "
            "take norms and non-finite checks of sharded DTensor gradients, whose reduction "
            "across ranks graphed does not do. Train without them, or with amp=\"bf16\".")
    if float8:
        problems.append(
            "graphed.fp8 layers under FSDP2 are not supported yet: their scaling state is "
            "reduced over DistributedDataParallel's group, not FSDP2's mesh. Train the FP8 "
            "model under DDP (graphed.distributed.prepare_ddp).")
    return problems


@dataclass
class FSDP2Capture:
    """What TrainStep needs from :func:`prepare_capture`."""

    #: The outermost fully_shard modules (each an FSDP2 root).
    roots: List[nn.Module] = field(default_factory=list)
    #: The largest data-parallel world size of their groups.
    world_size: int = 1


def _drop_unsharded_parameters(states: Sequence[Any]) -> None:
    """Note [FSDP2 inside a captured step], point 4."""
    for state in states:
        for group in param_groups(state):
            if not group.is_sharded:
                continue
            for fsdp_param in group.fsdp_params:
                if hasattr(fsdp_param, "_unsharded_param") and \
                        not hasattr(fsdp_param._sharded_local_tensor, "fsdp_post_all_gather"):
                    del fsdp_param._unsharded_param


def prepare_capture(modules: Iterable[nn.Module], *,
                    error_mode: Optional[str] = None) -> Optional[FSDP2Capture]:
    """For TrainStep: None when no fully_shard module is among ``modules``; else
    checks each root (raising GraphedError with every problem and its fix),
    runs FSDP2's lazy initialisation and drops its unsharded Parameters so
    that warm-up makes fresh ones (Note [FSDP2 inside a captured step],
    points 3 and 4)."""
    sharded = find_fsdp2(modules)
    if not sharded:
        return None
    modules = list(modules)
    # An eager forward without backward (evaluation) leaves parameters
    # unsharded; resharding them is what FSDP2's next backward would do.
    for module in sharded:
        for group in param_groups(module._get_fsdp_state()):
            if not group.is_sharded and group._all_gather_result is None and \
                    group._training_state.name == "IDLE":
                group.reshard()
    problems: List[str] = []
    for module in modules:
        if find_fsdp2([module]):
            problems += check_fsdp2(module, error_mode=error_mode)
    raise_problems(problems)
    roots = [m for m in modules if find_fsdp2([m])]
    for root in roots:
        state = root._get_fsdp_state()
        state._lazy_init()
        _drop_unsharded_parameters(state._state_ctx.all_states)
    return FSDP2Capture(roots=roots, world_size=max(world_size(r) for r in roots))


def reset_after_failure(capture: FSDP2Capture) -> None:
    """Puts FSDP2's Python state back to that of a finished step after a
    warm-up or capture raised mid-step: every group IDLE and sharded, no
    pending all-gather, reduce-scatter or event. This is FSDP2's own
    reset_iter_state without its waits on the failed step's events, which may
    have been recorded inside the failed capture and cannot be waited on
    outside it (Note [FSDP2 inside a captured step], points 2 and 6)."""
    for root in capture.roots:
        root_state = root._get_fsdp_state()
        comm = root_state._comm_ctx
        comm.all_gather_state = None
        if hasattr(comm, "reduce_scatter_states"):  # newer torch (2.14); 2.11 keeps one
            comm.reduce_scatter_states.clear()
            comm._last_post_reduce_events.clear()
        else:
            comm.reduce_scatter_state = None
        comm.post_forward_order.clear()
        ctx = root_state._state_ctx
        ctx.iter_forward_root = None
        ctx.post_backward_final_callback_queued = False
        for state in ctx.all_states or [root_state]:
            state._modules_to_run_forward.clear()
            state._training_state = type(state._training_state).IDLE
            for group in param_groups(state):
                group._all_gather_result = None
                group._post_reduce_event = None
                group._all_reduce_state = None
                group._reshard_after_forward_event = None
                group._partial_reduce_output = None
                group._post_forward_indices.clear()
                group._training_state = type(group._training_state).IDLE
                group._to_sharded()


def local_tensors(tensors: Iterable[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
    """``tensors`` with each DTensor replaced by its local tensor (the data the
    graph reads and writes), each once (Note [FSDP2 inside a captured step],
    point 9)."""
    dtensor = _dtensor_class()
    result: List[Optional[torch.Tensor]] = []
    seen = set()
    for tensor in tensors:
        if dtensor is not None and isinstance(tensor, dtensor):
            tensor = tensor._local_tensor
        if tensor is None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        result.append(tensor)
    return result


def tensor_dicts(submodules: Iterable[nn.Module]) -> List[Dict[str, Any]]:
    """The dicts whose tensors each step compares with capture (Note [Tensors a
    graph reads in place]): each module's ``_parameters`` and ``_buffers``,
    with a dict of local tensors, taken now, in place of ``_parameters`` that
    hold DTensors (Note [FSDP2 inside a captured step], point 9)."""
    dtensor = _dtensor_class()
    dicts: List[Dict[str, Any]] = []
    submodules = list(submodules)
    for module in submodules:
        parameters = module._parameters
        if dtensor is not None and any(isinstance(v, dtensor) for v in parameters.values()):
            parameters = {name: (v._local_tensor if isinstance(v, dtensor) else v)
                          for name, v in parameters.items()}
        dicts.append(parameters)
    dicts += [m._buffers for m in submodules]
    return dicts


def refuse(api: str, model: Any, why: str) -> None:
    """Raises GraphedError when ``model`` holds fully_shard modules: ``api``
    (graphed.optimize, graphed.auto) does not take them, for ``why``."""
    if isinstance(model, nn.Module) and find_fsdp2([model]):
        raise GraphedError(
            f"{api} does not take a model sharded with fully_shard (FSDP2): {why} Build the "
            "step with graphed.TrainStep.from_parts(model, optimizer, loss_fn, sample_batch), "
            "which captures FSDP2's step whole.")
