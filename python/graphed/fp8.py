"""graphed.fp8: float8 training whose scaling state lives on the device.

``convert(model, Recipe())`` swaps ``nn.Linear`` layers for :class:`Float8Linear`:
the forward product in E4M3, the two backward products with E5M2 (or E4M3)
gradients, through ``torch._scaled_mm``, with graphed's fused cast kernels
(Note [Fused FP8 casts] in src/device/fp8_kernels.cu). Scales, amaxes and
their histories are registered buffers (``state_dict`` carries them) and
change only through device operations, so a captured graph advances them like
an eager step (Note [FP8 scales live on the device]).

Delayed scaling needs one call per optimizer step, after every backward:
:func:`update_scales` (one all_reduce of all amaxes under torch.distributed,
then one kernel for every layer). ``graphed.TrainStep.from_parts`` calls it
inside the captured iteration; a hand-written loop, ``TrainStep(step_fn)`` or
``make_graphed_callables`` user calls it after the backward (after the last
backward graph's replay) and before ``optimizer.step()``::

    model = graphed.fp8.convert(model.cuda())
    step = graphed.TrainStep.from_parts(model, optimizer, loss_fn, batch, amp="bf16")

The logic is in the C++ core (include/graphed/fp8_linear.h, fp8_ops.h); this
module adapts ``nn.Module`` objects to it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch
from torch import nn

from . import _C
from ._C import GraphedError

logger = logging.getLogger(__name__)

__all__ = ["Recipe", "Float8Linear", "SkippedLayer", "convert", "update_scales",
           "keep_state_out_of_ddp", "state_buffer_names",
           "skipped_layers", "float8_layers"]

_STATE_BUFFERS = ("fp8_amax_history", "fp8_amax", "fp8_scale", "fp8_scale_inv",
                  "fp8_history_slot")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How float8 layers scale their tensors (validated by the C++ core).

    Args:
        scaling: ``"delayed"`` (scales from the amax history of earlier steps,
            Transformer Engine's recipe; needs :func:`update_scales` once per
            step) or ``"current"`` (each tensor's own amax, one extra reduction
            kernel per cast, no state between steps).
        history_len: steps of amax history (delayed scaling).
        margin: powers of two of headroom below the format's largest value.
        amax_compute: ``"max"`` (the largest amax of the history) or
            ``"most_recent"``.
        grad_format: ``"e5m2"`` or ``"e4m3"`` for the output gradients.
        cache_weights: cast each weight once per optimizer step, not once per
            microbatch (Note [The weight is cast once per step]): in eager
            loops, inside one captured step, and across the microbatches'
            graphs of ``make_graphed_callables(..., order=...)``, whose first
            microbatch's forward graph casts for the later ones.
        fast_accum_backward: ``use_fast_accum`` for the backward products (the
            forward always uses it).
        emulate: emulate the FP8 products with float32 products (any device;
            for tests without a Hopper GPU).
    """

    scaling: str = "delayed"
    history_len: int = 16
    margin: int = 0
    amax_compute: str = "max"
    grad_format: str = "e5m2"
    cache_weights: bool = True
    fast_accum_backward: bool = False
    emulate: bool = False

    def __post_init__(self) -> None:
        core = _C.Float8Recipe(
            scaling=self.scaling, history_len=self.history_len, margin=self.margin,
            amax_compute=self.amax_compute, grad_format=self.grad_format,
            cache_weights=self.cache_weights, fast_accum_forward=True,
            fast_accum_backward=self.fast_accum_backward, emulate=self.emulate)
        object.__setattr__(self, "_core", core)

    def __reduce__(self) -> Any:
        # Copies and pickles rebuild the C++ recipe from the fields.
        return (type(self), tuple(getattr(self, f.name) for f in dataclasses.fields(self)))

    @property
    def core(self) -> Any:
        """The C++ recipe (``_C.Float8Recipe``)."""
        return self._core  # type: ignore[attr-defined]


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` whose three products run in FP8 (see the module doc).

    Its scaling state is in registered buffers: ``fp8_amax_history`` [3,
    history_len], ``fp8_amax``, ``fp8_scale``, ``fp8_scale_inv`` [3] (rows:
    input, weight, output gradient) and ``fp8_history_slot`` [1]; after
    :func:`convert` they are views of one flat buffer per model, which
    :func:`update_scales` updates in one kernel. ``in_features`` and
    ``out_features`` must be multiples of 16."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: Any = None, dtype: Optional[torch.dtype] = None, *,
                 recipe: Optional[Recipe] = None) -> None:
        reason = _unsupported_reason(in_features, out_features)
        if reason is not None:
            raise GraphedError(
                f"Expected in_features and out_features to be multiples of 16 for a "
                f"Float8Linear, got {reason}. Keep this layer an nn.Linear "
                "(graphed.fp8.convert skips it); see "
                "docs/troubleshooting.md#fp8-dims-not-multiple-of-16.")
        super().__init__(in_features, out_features, bias, device, dtype)
        self._init_fp8(recipe or Recipe(), self.weight.device)

    def _init_fp8(self, recipe: Recipe, device: torch.device) -> None:
        self.recipe = recipe
        floats = dict(dtype=torch.float32, device=device)
        grad_max = _C.fp8_format_max(recipe.grad_format)
        self.register_buffer("fp8_amax_history", torch.zeros(3, recipe.history_len, **floats))
        self.register_buffer("fp8_amax", torch.zeros(3, **floats))
        self.register_buffer("fp8_scale", torch.ones(3, **floats))
        self.register_buffer("fp8_scale_inv", torch.ones(3, **floats))
        self.register_buffer("fp8_history_slot",
                             torch.zeros(1, dtype=torch.int64, device=device))
        self.register_buffer("fp8_format_max",
                             torch.tensor([448.0, 448.0, grad_max], **floats), persistent=False)
        self._weight_cache = _C.Float8WeightCache()

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Optional[Recipe] = None) -> "Float8Linear":
        """A Float8Linear that trains ``linear``'s own parameters (the same
        ``nn.Parameter`` objects, so an optimizer built before keeps working)."""
        reason = _unsupported_reason(linear.in_features, linear.out_features)
        if reason is not None:
            raise GraphedError(
                f"Expected in_features and out_features to be multiples of 16 to convert "
                f"this nn.Linear to FP8, got {reason}. Keep it in high precision (convert() "
                "skips such layers); see docs/troubleshooting.md#fp8-dims-not-multiple-of-16.")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features = linear.in_features
        layer.out_features = linear.out_features
        layer.weight = linear.weight
        layer.register_parameter("bias", linear.bias)
        layer.train(linear.training)
        layer._init_fp8(recipe or Recipe(), linear.weight.device)
        return layer

    @property
    def weight_cache(self) -> Any:
        """The weight's FP8 cast kept between microbatches (``casts`` counts
        the casts made eagerly or while capturing)."""
        return self._weight_cache

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _C.float8_linear(input, self.weight, self.bias, self.fp8_amax, self.fp8_scale,
                                self.fp8_scale_inv, self.recipe.core, self._weight_cache)

    def _apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> "Float8Linear":
        # model.to(torch.bfloat16) casts every floating buffer; the scaling
        # state stays float32 (the kernels read float32 scales and amaxes).
        super()._apply(fn, *args, **kwargs)
        for name in _STATE_BUFFERS + ("fp8_format_max",):
            buffer = self._buffers.get(name)
            wanted = torch.int64 if name == "fp8_history_slot" else torch.float32
            if buffer is not None and buffer.dtype != wanted:
                self._buffers[name] = buffer.to(wanted)
        return self

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, *args: Any,
                              **kwargs: Any) -> None:
        # A checkpoint of the high-precision model has no FP8 state: keep the
        # fresh state (scale 1, empty history) instead of failing strict loading.
        for name in _STATE_BUFFERS:
            state_dict.setdefault(prefix + name, getattr(self, name))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, scaling={self.recipe.scaling}, "
                f"grad_format={self.recipe.grad_format}")


class SkippedLayer(NamedTuple):
    """An ``nn.Linear`` that :func:`convert` left in high precision, and why."""
    name: str
    reason: str


def _unsupported_reason(in_features: int, out_features: int) -> Optional[str]:
    if in_features % 16 == 0 and out_features % 16 == 0:
        return None
    return (f"in_features={in_features}, out_features={out_features} (FP8 matrix products "
            "need multiples of 16)")


def convert(model: nn.Module, recipe: Optional[Recipe] = None, *,
            filter: Optional[Callable[[str, nn.Module], bool]] = None) -> nn.Module:
    """Swaps ``model``'s ``nn.Linear`` layers for :class:`Float8Linear` in place
    and returns ``model``.

    Layers whose feature counts are not multiples of 16, and those for which
    ``filter(name, module)`` returns False, stay as they are;
    :func:`skipped_layers` lists them with the reason. The new layers train
    the same parameter objects. Convert after moving the model to its device
    (or call :func:`update_scales` once after moving it, before capturing)."""
    if not hasattr(torch, "_scaled_mm"):
        raise GraphedError(
            f"Expected a torch with torch._scaled_mm (FP8 matrix products), got torch "
            f"{torch.__version__} without it. Install torch 2.4 or newer; see "
            "docs/troubleshooting.md#fp8-needs-scaled-mm.")
    if isinstance(model, Float8Linear):
        return model
    recipe = recipe or Recipe()
    skipped: List[SkippedLayer] = []
    targets = []
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            if type(child) is not nn.Linear:
                continue
            full = f"{name}.{child_name}" if name else child_name
            if filter is not None and not filter(full, child):
                skipped.append(SkippedLayer(full, "excluded by filter"))
                continue
            reason = _unsupported_reason(child.in_features, child.out_features)
            if reason is not None:
                skipped.append(SkippedLayer(full, reason))
                continue
            targets.append((module, child_name, child))
    if isinstance(model, nn.Linear) and type(model) is nn.Linear:
        raise GraphedError(
            "Expected a model that contains nn.Linear layers, got an nn.Linear itself, which "
            "convert() cannot replace in place. Use graphed.fp8.Float8Linear.from_linear(layer).")
    for parent, child_name, child in targets:
        setattr(parent, child_name, Float8Linear.from_linear(child, recipe))
    model.__dict__["_graphed_fp8_skipped"] = skipped
    for layer in skipped:
        logger.info("graphed.fp8.convert: %s stays in high precision: %s", layer.name,
                    layer.reason)
    _scaling_group(model)
    keep_state_out_of_ddp(model)
    return model


def skipped_layers(model: nn.Module) -> List[SkippedLayer]:
    """The ``nn.Linear`` layers the last :func:`convert` of ``model`` left in
    high precision, with the reason for each."""
    return list(model.__dict__.get("_graphed_fp8_skipped", []))


def float8_layers(model: nn.Module) -> List[Float8Linear]:
    """``model``'s Float8Linear layers, in module order."""
    return [m for m in model.modules() if isinstance(m, Float8Linear)]


class _ScalingGroup:
    """The flat delayed-scaling table of a model's Float8Linear layers; each
    layer's buffers are views of its rows (three per layer)."""

    def __init__(self, layers: List[Float8Linear]) -> None:
        first = layers[0].recipe
        for layer in layers[1:]:
            r = layer.recipe
            if (r.history_len, r.margin, r.amax_compute) != (first.history_len, first.margin,
                                                             first.amax_compute):
                raise GraphedError(
                    "Expected every delayed-scaling Float8Linear of a model to share "
                    "history_len, margin and amax_compute (one table updates them all), got "
                    f"{(first.history_len, first.margin, first.amax_compute)} and "
                    f"{(r.history_len, r.margin, r.amax_compute)}. Convert the model with one "
                    "Recipe.")
        self.layers = layers
        self.recipe = first
        with torch.no_grad():
            self.history = torch.cat([l.fp8_amax_history for l in layers]).contiguous()
            self.amax = torch.cat([l.fp8_amax for l in layers]).contiguous()
            self.scale = torch.cat([l.fp8_scale for l in layers]).contiguous()
            self.scale_inv = torch.cat([l.fp8_scale_inv for l in layers]).contiguous()
            self.format_max = torch.cat([l.fp8_format_max for l in layers]).contiguous()
            self.slot = layers[0].fp8_history_slot.clone()
        for i, layer in enumerate(layers):
            rows = slice(3 * i, 3 * i + 3)
            layer._buffers["fp8_amax_history"] = self.history[rows]
            layer._buffers["fp8_amax"] = self.amax[rows]
            layer._buffers["fp8_scale"] = self.scale[rows]
            layer._buffers["fp8_scale_inv"] = self.scale_inv[rows]
            layer._buffers["fp8_format_max"] = self.format_max[rows]
            layer._buffers["fp8_history_slot"] = self.slot
        self._views = [(layer.fp8_amax_history, layer.fp8_amax, layer.fp8_scale,
                        layer.fp8_scale_inv, layer.fp8_format_max, layer.fp8_history_slot)
                       for layer in layers]

    def current(self, layers: List[Float8Linear]) -> bool:
        """Whether ``layers`` are this group's and still hold its views (moving
        a model with .to() replaces every buffer with a separate tensor)."""
        if len(layers) != len(self.layers) or any(a is not b for a, b in zip(layers,
                                                                           self.layers)):
            return False
        return all(all(a is b for a, b in zip(views, (layer.fp8_amax_history, layer.fp8_amax,
                                                       layer.fp8_scale, layer.fp8_scale_inv,
                                                       layer.fp8_format_max,
                                                       layer.fp8_history_slot)))
                   for views, layer in zip(self._views, layers))


def _scaling_group(model: nn.Module) -> Optional[_ScalingGroup]:
    """The model's delayed-scaling group, (re)built when its layers or their
    buffers changed; None without delayed-scaling Float8Linear layers."""
    layers = [l for l in float8_layers(model) if l.recipe.scaling == "delayed"]
    if not layers:
        return None
    group = model.__dict__.get("_graphed_fp8_group")
    if group is None or not group.current(layers):
        group = _ScalingGroup(layers)
        model.__dict__["_graphed_fp8_group"] = group
    return group


def has_delayed_scaling(model: nn.Module) -> bool:
    """Whether ``model`` has Float8Linear layers with delayed scaling (which
    need :func:`update_scales` once per step)."""
    return any(l.recipe.scaling == "delayed" for l in float8_layers(model))


def update_scales(model: nn.Module, process_group: Any = None) -> None:
    """Ends a step of ``model``'s delayed scaling: call once per optimizer step,
    after every backward (and before ``optimizer.step()``).

    Under torch.distributed (initialized, more than one rank) the amaxes of all
    layers are reduced with one ``all_reduce(MAX)`` over ``process_group``
    (default: a DistributedDataParallel ``model``'s group, else the default
    group); then one kernel writes every layer's history and scales. Also
    starts a new step for the weight casts (Note [The weight is cast once per
    step]). Inside a captured step this is captured too. A model without
    delayed-scaling layers: nothing happens."""
    _C.advance_float8_weight_epoch()
    group = _scaling_group(model)
    if group is None:
        return
    if process_group is None:
        process_group = getattr(model, "process_group", None)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size(process_group) > 1:
            torch.distributed.all_reduce(group.amax, op=torch.distributed.ReduceOp.MAX,
                                         group=process_group)
    _C.fp8_update_delayed_scaling(group.history, group.amax, group.scale, group.scale_inv,
                                  group.format_max, group.slot, group.recipe.core)


def prepare(model: nn.Module) -> None:
    """Packs ``model``'s scaling state into its flat buffers now (before a
    capture collects the model's buffers); :func:`convert` and
    :func:`update_scales` do it when needed."""
    _scaling_group(model)


def state_buffer_names(module: nn.Module) -> List[str]:
    """The fully qualified names, within ``module``, of its Float8Linear
    layers' scaling buffers."""
    return [f"{name}.{buffer}" if name else buffer
            for name, layer in module.named_modules() if isinstance(layer, Float8Linear)
            for buffer in _STATE_BUFFERS + ("fp8_format_max",)]


def keep_state_out_of_ddp(module: nn.Module) -> List[str]:
    """Tells DistributedDataParallel to leave the FP8 scaling buffers of
    ``module``'s Float8Linear layers alone; returns their names.

    Note [FP8 state is not DDP's to broadcast]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    DDP (broadcast_buffers=True, its default) copies every buffer from rank 0
    to the other ranks before each forward. The amaxes are buffers, and each
    rank records its own microbatches' amaxes into them during the step: the
    broadcast before the second microbatch's forward would overwrite, on every
    rank but 0, what its first microbatch recorded, and update_scales'
    all_reduce(MAX) would miss it. Nor does the state need a broadcast:
    update_scales makes it equal on every rank once per step, with one
    all_reduce of every layer's amax together. So the buffers are listed in
    ``module._ddp_params_and_buffers_to_ignore`` (what DDP's own
    ``_set_params_and_buffers_to_ignore_for_model`` sets), which DDP reads
    when it is built: :func:`convert` calls this on the model it converts,
    and :func:`graphed.distributed.prepare_ddp` on the module it wraps;
    :func:`graphed.distributed.check_ddp` refuses a DDP that broadcasts them."""
    names = state_buffer_names(module)
    if names:
        ignored = list(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
        module._ddp_params_and_buffers_to_ignore = ignored + [n for n in names
                                                              if n not in ignored]
    return names
