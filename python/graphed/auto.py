"""graphed.auto: capture a model's repeated blocks as CUDA graphs, automatically.

The core is ``graphed::GraphManager`` (include/graphed/graph_manager.h); this
module only finds the submodules, routes their ``forward`` through the manager
and formats ``stats()``.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import weakref
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from . import _C, fsdp
from ._compiled import compiled_forward, torch_compile_options
from ._experts import capturable_experts
from ._progress import CaptureProgress
from ._weak_forward import weak_forward

logger = logging.getLogger(__name__)

ModuleChoice = Union[str, type]

_MANAGER_ATTRIBUTE = "_graphed_auto_manager"
_NOTES_ATTRIBUTE = "_graphed_auto_notes"
_UNDO_ATTRIBUTE = "_graphed_auto_undo"
_OWN_FORWARDS_ATTRIBUTE = "_graphed_auto_own_forwards"


def auto(
    model: nn.Module,
    *,
    modules: Optional[Union[ModuleChoice, Sequence[ModuleChoice]]] = None,
    warmup: int = 3,
    buckets: Union[str, Mapping[int, Iterable[int]], None] = "auto",
    memory_budget: Optional[Union[int, str]] = None,
    fallback: str = "eager",
    check: bool = True,
    capture_error_mode: str = "global",
    input_update: str = "copy",
    compile: Any = False,
) -> nn.Module:
    """Graph ``model``'s submodules automatically; returns ``model`` itself.

    The chosen submodules run eagerly for ``warmup`` calls while the order of
    their calls is recorded; then they are captured in that order (for
    inference, each on its next call into one shared pool; for training, all
    together, see below) and replayed afterwards. The
    model keeps its parameters, buffers and ``state_dict``; only the chosen
    submodules' ``forward`` is routed through graphed.

    Args:
        model: the model. Its class is swapped for a subclass that adds
            ``stats()`` (or ``graphed_stats()`` when the model has a
            ``stats`` of its own).
        modules: what to capture: ``None`` for the largest repeated blocks
            (each transformer layer; the whole model if nothing repeats), or
            names from ``model.named_modules()`` and/or classes (every
            outermost instance), alone or in a list.
        warmup: eager calls per module before capture (at least 1).
        buckets: ``{dim: sizes}``: pad every input tensor that has ``dim``
            up to the next size, capturing each size (largest first) on the
            module's first capture; outputs are sliced back. Tensors of size
            1 there are broadcast (transformers' position ids, rotary tables,
            causal masks) and pass unpadded. Only for dimensions whose rows
            are independent (a batch). ``"auto"`` (the default): one graph
            per signature until a module's inference calls come at 4 batch
            sizes, then power-of-two buckets along dimension 0, checked
            against eager on the first padded call (``stats()["notes"]``
            says what was picked, or refused); ``None``: one graph per
            signature, always.
        memory_budget: limit of the graphs' memory: bytes or a size such as
            ``"2GiB"``; least recently used graphs are evicted to stay under
            it. ``None`` for no limit.
        fallback: ``"eager"`` runs what cannot be graphed eagerly and counts
            it, with the reason, in ``stats()["fallbacks"]``; ``"raise"``
            raises ``graphed.GraphedError`` instead.
        check: run each module's last warm-up call under ``graphed.check``, so
            that a module with a capture blocker (``.item()``, a sync...)
            falls back without a failed capture, its reason naming the line.
        capture_error_mode: ``"global"``, ``"thread_local"`` or ``"relaxed"``.
        input_update: ``"copy"`` (the default) copies new inputs into the
            graph's buffers; ``"auto"`` re-points a graph at inputs that keep
            arriving at one address (the previous layer's graph output) or
            are large, instead of copying them; ``"repoint"`` re-points
            wherever possible (see ``graphed.capture``). Re-pointing is
            opt-in: it is right only if graphed finds every kernel argument
            that holds the input's address (Note [Re-pointing a graph]),
            while a copy is right always; bench/decode.py measures both
            (graphed_auto vs graphed_auto_repoint).
        compile: ``True`` (or a dict of torch.compile's arguments) compiles
            each managed module's forward with torch.compile (Inductor's
            default mode: fused kernels, no CUDA graphs of its own) before its
            capture: the warm-up calls compile, the capture records the
            compiled kernels (Note [Compiled blocks in graphed.auto]).
            Repeated blocks share one compiled forward. Modes that record
            CUDA graphs of their own (``reduce-overhead``) are refused.
            ``False`` (the default): the modules' own forwards.

    Outputs of a replay are the graph's buffers, valid until the module's
    next call at any bucket (clone them to keep them longer). The modules'
    inference graphs share one memory pool, in which a graph works in memory
    that graphs captured before it freed (torch's rule for shared pools): a
    module called out of the order the graphs were captured in (an earlier
    layer again at another size) can overwrite the outputs of later modules.
    A model's forward reads every output before that happens; keep a block's
    output across such calls only as a clone.

    A module that can never use a graph (a capture blocker, a failed
    capture) runs its own forward again, and its parts are managed in its
    place: children worth a graph (an attention, a router, a dense MLP; not
    one Linear or norm), each warmed up, checked and captured alone, while
    the code between them runs eagerly; a part that cannot be captured is
    descended into in turn, and a part whose calls change shape (an expert's
    tokens) stays eager. ``stats()["parts"]`` shows, per such module, what
    is graphed and what runs eagerly, with why (Note [Graphing the parts of
    a block] in include/graphed/module_selection.h).

    Training calls (grad mode on and an input or parameter requiring grad)
    replay a forward graph whose outputs carry one autograd node that replays
    the backward graph, as with ``graphed.make_graphed_callables``. The last
    warm-up step records the order of the modules' forwards and backwards;
    the first training call after warm-up captures every recorded module
    together, in that order, into one pool, and replays must then follow it:
    a call out of order (a module called twice before its backward) runs
    eagerly and is counted. ``stats()["training_groups"]`` shows the modules,
    the recorded order and those left out (captured on their own). Training
    calls are not padded to buckets: they run at the sizes they were
    captured at.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"graphed.auto expects a torch.nn.Module, got {type(model).__name__}")
    fsdp.refuse("graphed.auto", model,
                "it graphs submodules one by one, and FSDP2's hooks around each sharded "
                "module's forward and backward unshard and reshard its parameters on the host, "
                "between the graphs.")
    if getattr(model, _MANAGER_ATTRIBUTE, None) is not None:
        raise _C.GraphedError(
            "This model is already managed by graphed.auto; call graphed.auto once per model "
            "(its stats() shows what it does)."
        )
    if not isinstance(warmup, int) or isinstance(warmup, bool):
        raise TypeError(f"warmup must be an int, got {type(warmup).__name__}")
    infos = _module_infos(model)
    names = _C.select_repeated_blocks(infos) if modules is None else _resolve(model, modules)
    _C.validate_module_selection(names, infos)
    pick_buckets = isinstance(buckets, str) and buckets == "auto"
    _, compile_options = torch_compile_options(compile, "block")
    compiled_forwards: Dict[Any, Callable[..., Any]] = {}
    manager = _C.GraphManager(
        warmup=warmup,
        buckets=None if pick_buckets else _buckets(buckets),
        pick_buckets=pick_buckets,
        memory_budget=memory_budget,
        fallback=fallback,
        check_blockers=bool(check),
        capture_warmup=1,
        max_capture_ahead=64,
        capture_error_mode=capture_error_mode,
        input_update=input_update,
        # A module's first capture with buckets captures every size ahead.
        on_capture_ahead=(CaptureProgress("graphed.auto: capturing")
                          if buckets and not pick_buckets else None),
    )
    own_forwards: List[str] = []
    # What undo() puts back: Note [Undoing graphed.auto]. Parts of blocks
    # that cannot be captured join it as they are managed.
    previous_forwards: List[tuple] = []
    previous_model_forward = model.__dict__.get("forward")
    previous_class = type(model)
    managed = set()

    def manage(name: str, part_of: str = "") -> None:
        module = model_ref().get_submodule(name)
        submodules = list(module.modules())
        index = manager.add_module(
            name,
            type(module).__name__,
            (_eager_forward(module) if compile_options is None
             else compiled_forward(module, compile_options, compiled_forwards)),
            list(module.buffers()),
            list(module.parameters()),
            # Read on every call: Note [Modules whose tensors moved].
            [m._parameters for m in submodules],
            [m._buffers for m in submodules],
            part_of=part_of,
        )
        managed.add(name)
        previous_forwards.append((module, module.__dict__.get("forward")))
        module.forward = _managed_forward(manager, index, module, name, own_forwards,
                                          graph_parts)

    def graph_parts(blocked: str) -> None:
        """Note [Graphing the parts of a block] in include/graphed/module_selection.h."""
        tensors = itertools.chain(model_ref().get_submodule(blocked).parameters(),
                                  model_ref().get_submodule(blocked).buffers())
        if not any(t.is_cuda for t in tensors):
            return  # off the GPU nothing is captured: its parts would fail alike
        parts = [p for p in _C.parts_to_graph(blocked, infos) if p not in managed]
        for part in parts:
            manage(part, part_of=blocked)
        if parts:
            logger.info("auto: graphing the parts of %s instead: %s", blocked or "<root>",
                        ", ".join(parts))

    model_ref = weakref.ref(model)  # the model holds undo() and the forwards: no cycle back
    for name in names:
        manage(name)
    object.__setattr__(model, _MANAGER_ATTRIBUTE, manager)
    object.__setattr__(model, _OWN_FORWARDS_ATTRIBUTE, own_forwards)
    experts_before = _experts_implementations(model)
    notes = capturable_experts(model) + _turn_cache_off_in_training(model)
    if compile_options is not None:
        notes.append(f"each managed module's forward runs under torch.compile"
                     f"({_shown(compile_options)}) before its capture; "
                     f"{len(compiled_forwards)} compiled forward(s) for {len(names)} module(s)")
    object.__setattr__(model, _NOTES_ATTRIBUTE, notes)

    def undo() -> None:
        target = model_ref()
        if target is None:
            return
        for module, forward in previous_forwards + [(target, previous_model_forward)]:
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward
        for config, implementation in experts_before:
            config._experts_implementation = implementation
        manager.clear()
        for attribute in (_MANAGER_ATTRIBUTE, _OWN_FORWARDS_ATTRIBUTE, _NOTES_ATTRIBUTE,
                          _UNDO_ATTRIBUTE):
            target.__dict__.pop(attribute, None)
        target.__class__ = previous_class

    object.__setattr__(model, _UNDO_ATTRIBUTE, undo)
    logger.debug("auto: %s graphs %d module(s): %s", type(model).__name__, len(names),
                 ", ".join(name or "<root>" for name in names))
    for note in notes:
        logger.info("auto: %s", note)
    model.__class__ = _graphed_class(type(model))
    return model


# Note [Undoing graphed.auto]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# graphed.optimize tries per-block graphs on the user's own model when the
# whole step cannot be captured, and must leave it as it was when that does
# not pay. auto changes the model in place: the managed modules' forwards,
# the model's forward (use_cache=False in training), its class (for
# stats()), the experts implementation of transformers' mixture-of-experts
# layers. undo(model) puts each back and drops the graphs; the weights were
# never touched.


def undo(model: nn.Module) -> None:
    """Puts ``model`` back as it was before :func:`auto` (Note [Undoing
    graphed.auto]) and releases its graphs. Raises when ``model`` is not
    managed by graphed.auto."""
    restore = model.__dict__.get(_UNDO_ATTRIBUTE)
    if restore is None:
        raise _C.GraphedError("This model is not managed by graphed.auto, so there is nothing to "
                              "undo.")
    restore()


def _experts_implementations(model: nn.Module) -> List[tuple]:
    """(config, experts implementation) of transformers' experts layers."""
    seen = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if hasattr(module, "has_gate") and config is not None and id(config) not in seen:
            seen[id(config)] = (config, getattr(config, "_experts_implementation", None))
    return list(seen.values())


def _turn_cache_off_in_training(model: nn.Module) -> List[str]:
    """Training calls of a forward that takes ``use_cache`` get
    ``use_cache=False`` unless the caller sets it (Note [Batch forms] in
    python/graphed/train.py): transformers would otherwise hand every layer a
    key/value cache that training never reads and no graph can replay.
    Returns the notes for ``stats()``."""
    from .train import takes_use_cache

    if not takes_use_cache(model):
        return []
    forward = _eager_forward(model)

    def training_forward(*args: Any, **kwargs: Any) -> Any:
        if "use_cache" not in kwargs and torch.is_grad_enabled() and model_ref().training:
            kwargs["use_cache"] = False
        return forward(*args, **kwargs)

    model_ref = weakref.ref(model)
    # Frameworks read the forward's parameters (the HF Trainer keeps only the
    # batch keys named there), so the wrapper shows the model's own.
    training_forward.__signature__ = _signature_of(model.forward)  # type: ignore[attr-defined]
    model.forward = training_forward
    return [f"use_cache=False in training calls of {type(model).__name__} (unless the call sets "
            "it): a key/value cache built in every training forward is never read, and layers "
            "handed one cannot replay a graph"]


def stats(model: nn.Module) -> Dict[str, Any]:
    """What graphed.auto did with ``model``: calls, replays, warm-up calls,
    captures, evictions, ``tensor_changes`` (modules whose parameters or
    buffers were moved or replaced, e.g. by ``model.double()``, and which
    were warmed up and captured again), capture time, live graphs and their memory
    (``graph_memory_bytes``; ``pool_reserved_bytes`` for the shared pool),
    the recorded call ``order``, per-module counters, every fallback with
    its reason and count, the ``training_groups`` captured together,
    ``check_false_findings`` (what graphed.check found inside installed
    packages that the capture never met), ``notes`` (what graphed changed:
    ``use_cache=False`` in training calls of a transformers model) and
    ``parts``: per module that cannot be captured, the parts graphed in its
    place (``graphed``), those that run eagerly with why (``eager``), and why
    the module itself could not be (Note [Graphing the parts of a block])."""
    manager = getattr(model, _MANAGER_ATTRIBUTE, None)
    if manager is None:
        raise _C.GraphedError(
            "This model is not managed by graphed.auto; wrap it first: model = graphed.auto(model)."
        )
    result = manager.stats()
    result["notes"] = list(getattr(model, _NOTES_ATTRIBUTE, [])) + result.pop("manager_notes")
    for name in getattr(model, _OWN_FORWARDS_ATTRIBUTE, []):
        result["modules"][name]["own_forward"] = True
    result["parts"] = _parts(result)
    return result


def _parts(result: Dict[str, Any]) -> Dict[str, Any]:
    """Per module that could not be captured and whose parts are managed in
    its place: why it runs eagerly, its parts that replay graphs, and those
    that run eagerly too, each with its reason (the first one counted)."""
    reasons: Dict[str, str] = {}
    for fallback in result["fallbacks"]:
        reasons.setdefault(fallback["module"], fallback["reason"])
    parts: Dict[str, Any] = {}
    for name, module in result["modules"].items():
        block = module.get("part_of")
        if block is None:
            continue
        entry = parts.setdefault(block, {
            "eager_because": reasons.get(block, ""), "graphed": [], "eager": {},
            "outside_parts": "eager: the block's own code between its parts"})
        if module["replays"] > 0 and module["state"] != "eager":
            entry["graphed"].append(name)
        else:
            entry["eager"][name] = reasons.get(name, f"no replay yet ({module['state']})")
    return parts


def _managed_forward(manager: "_C.GraphManager", index: int, module: nn.Module, name: str,
                     own_forwards: List[str], graph_parts: Callable[[str], None]):
    """The forward graphed.auto installs. A call the core sends back
    (``_C.RUN_EAGER``: it fell back, and was counted) runs the module's own
    forward on the objects at hand; once the module can never use a graph,
    its own forward goes back in place, so that its calls run no graphed code
    at all (Note [A fallback costs nothing] in src/graph_manager.cpp), and
    its parts are managed in its place (``graph_parts``)."""
    previous = module.__dict__.get("forward")  # an instance forward of the user's, if any
    own = previous if previous is not None else type(module).forward.__get__(module)
    run_eager, run_own_forward = _C.RUN_EAGER, _C.RUN_OWN_FORWARD

    def forward(*args: Any, **kwargs: Any) -> Any:
        out = manager.call(index, args, kwargs, module.training)
        if out is run_eager:
            return own(*args, **kwargs)
        if out is run_own_forward:
            if module.__dict__.get("forward") is forward:
                if previous is None:
                    del module.forward
                else:
                    module.forward = previous
                own_forwards.append(name)
                logger.info("auto: %s can never use a graph; it runs its own forward again "
                            "(stats()['fallbacks'] has why)", name or "<root>")
                graph_parts(name)
            return own(*args, **kwargs)
        return out

    forward.__signature__ = _signature_of(module.forward)  # type: ignore[attr-defined]
    return forward


def _eager_forward(module: nn.Module):
    """The module's own forward, holding the module weakly: the manager lives
    in the model, and a strong reference back from C++ would keep both alive
    (with their graphs and GPU memory) after the user drops the model."""
    return weak_forward(module, _signature_of(module.forward))


def _shown(options: Dict[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in options.items())


def _signature_of(forward: Callable[..., Any]) -> Optional[inspect.Signature]:
    """The signature callers see (a Signature holds no reference to the module)."""
    try:
        return inspect.signature(forward)
    except (TypeError, ValueError):
        return None


def _module_infos(model: nn.Module) -> List[tuple]:
    """(name, class name, parameters, is_container, base class names nearest
    first) per module, as graphed::ModuleInfo takes them."""
    infos = []
    for name, module in model.named_modules():
        parameters = sum(p.numel() for p in module.parameters())
        container = isinstance(module, (nn.ModuleList, nn.Sequential))
        bases = [c.__name__ for c in type(module).__mro__[1:]
                 if isinstance(c, type) and issubclass(c, nn.Module) and c is not nn.Module]
        infos.append((name, type(module).__name__, parameters, container, bases))
    return infos


def _resolve(model: nn.Module, modules: Union[ModuleChoice, Sequence[ModuleChoice]]) -> List[str]:
    if isinstance(modules, (str, type)):
        choices = [modules]
    elif isinstance(modules, (list, tuple)):
        choices = list(modules)
    else:
        raise TypeError(
            "modules must hold submodule names (str) or nn.Module classes, got "
            f"{type(modules).__name__}"
        )
    names: List[str] = []
    for choice in choices:
        if isinstance(choice, str):
            names.append(choice)
        elif isinstance(choice, type) and issubclass(choice, nn.Module):
            found = [n for n, m in model.named_modules() if isinstance(m, choice)]
            if not found:
                raise _C.GraphedError(
                    f"Expected the model to contain a {choice.__name__}, but it has none. "
                    "Pass a class the model uses, or names from model.named_modules()."
                )
            # Outermost instances only: a graph of one already records those inside it.
            outermost = [n for n in found if not any(n != o and n.startswith(o + ".") for o in found)]
            names.extend(n for n in outermost if n not in names)
        else:
            raise TypeError(
                "modules must hold submodule names (str) or nn.Module classes, got "
                f"{type(choice).__name__}"
            )
    return names


def _buckets(buckets: Union[str, Mapping[int, Iterable[int]], None]
             ) -> Optional[Dict[int, List[int]]]:
    if buckets is None:
        return None
    if isinstance(buckets, str):
        raise TypeError(f'buckets must be "auto", None or a dict {{dim: sizes}}, got {buckets!r}')
    if not isinstance(buckets, Mapping):
        raise TypeError(
            "buckets must be a dict {dim: sizes}, e.g. {0: [1, 2, 4, 8]}, got "
            f"{type(buckets).__name__}"
        )
    out: Dict[int, List[int]] = {}
    for dim, sizes in buckets.items():
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"bucket dimensions must be ints, got {dim!r}")
        if isinstance(sizes, int):
            raise TypeError(
                f"buckets[{dim}] must be a list of sizes, e.g. [1, 2, 4, 8], got the int {sizes}"
            )
        out[dim] = [int(size) for size in sizes]
    return out


_GRAPHED_CLASSES: Dict[type, type] = {}


def _graphed_class(cls: type) -> type:
    """A subclass of ``cls`` adding ``stats()``: the model keeps its type for
    isinstance checks, its parameters and its state_dict."""
    if cls in _GRAPHED_CLASSES:
        return _GRAPHED_CLASSES[cls]

    def graphed_stats(self: nn.Module) -> Dict[str, Any]:
        return stats(self)

    namespace: Dict[str, Any] = {"graphed_stats": graphed_stats, "__module__": cls.__module__}
    if not hasattr(cls, "stats"):
        namespace["stats"] = graphed_stats
    subclass = type(f"Graphed{cls.__name__}", (cls,), namespace)
    _GRAPHED_CLASSES[cls] = subclass
    return subclass
