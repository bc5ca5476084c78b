"""Python containers of other types (named tuples, transformers' ModelOutput,
OrderedDict...) on their way through the C++ core; see Note [Structured
Python containers] in src/bindings/python_values.cpp. The core calls
``flatten`` and ``unflatten``; nothing here is public."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch.utils._pytree as pytree


class Structure:
    """One container type with its context (a ModelOutput's keys, a named
    tuple's class), as torch.utils._pytree describes it. Interned: equal
    structures are one object, so that a graph's signature, which compares
    host objects by identity, matches on every call."""

    __slots__ = ("spec",)

    def __init__(self, spec: pytree.TreeSpec) -> None:
        self.spec = spec

    def __repr__(self) -> str:
        return f"<{self.spec.type.__name__} {self.spec.context!r}>"


_INTERNED: Dict[pytree.TreeSpec, Structure] = {}


def flatten(value: Any) -> Optional[Tuple[Structure, List[Any]]]:
    """``(structure, children)`` of one level of ``value``, or None when
    torch's pytree does not know the type (the core then keeps the object
    opaque)."""
    children, spec = pytree.tree_flatten(value, is_leaf=lambda item: item is not value)
    if spec.is_leaf():
        return None
    structure = _INTERNED.get(spec)
    if structure is None:
        structure = _INTERNED.setdefault(spec, Structure(spec))
    return structure, children


def unflatten(structure: Structure, children: List[Any]) -> Any:
    """The container ``flatten`` took apart, holding ``children``."""
    return pytree.tree_unflatten(list(children), structure.spec)


def _is_cache(value: Any) -> bool:
    # transformers' key/value caches (DynamicCache, StaticCache...) derive from
    # transformers.cache_utils.Cache; checked by name so that transformers is
    # never imported here.
    return any(cls.__name__ == "Cache" and cls.__module__.startswith("transformers")
               for cls in type(value).__mro__)


def stateful_tensors(value: Any, depth: int = 3) -> Tuple[List[Any], bool]:
    """The tensors a host object holds in its attributes (``depth`` levels
    of attributes, lists, tuples and dicts), and whether it is a key/value
    cache, which holds state even while empty; see Note [Host objects holding
    tensors] in src/signature.cpp. Modules, classes and functions hold none
    that a graph must track."""
    import types

    import torch

    found: List[Any] = []
    skipped = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
               types.MethodType, torch.nn.Module, torch.dtype, torch.device)

    def visit(item: Any, left: int) -> None:
        if isinstance(item, torch.Tensor):
            found.append(item)
            return
        if left == 0 or isinstance(item, skipped) or item is None:
            return
        if isinstance(item, (list, tuple)):
            children = list(item)
        elif isinstance(item, dict):
            children = list(item.values())
        else:
            children = list(getattr(item, "__dict__", {}).values())
        for child in children:
            visit(child, left - 1)

    visit(value, depth)
    return found, _is_cache(value)
