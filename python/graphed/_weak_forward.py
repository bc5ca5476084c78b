"""A module's own forward for the C++ core to call eagerly (warm-up, capture,
fallbacks) without keeping the module alive.

The graphed forward installed on a module holds the core, and the core holds
the eager forward: were that a bound method, module -> graphed forward ->
core -> module would be a cycle through C++, which Python's collector cannot
see, and a dropped model would keep its graphs and their GPU memory for the
life of the process. So the core gets the class's function and a weak
reference to the module. Nothing here is public."""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Callable, Optional

from torch import nn

from . import _C


def weak_forward(module: nn.Module,
                 signature: Optional[inspect.Signature] = None) -> Callable[..., Any]:
    """``module.forward`` holding ``module`` weakly; a forward set on the
    instance (not a bound method of ``module``) is returned as it is."""
    original = module.forward
    if not (inspect.ismethod(original) and original.__self__ is module):
        return original
    function = original.__func__
    module_ref = weakref.ref(module)
    name = type(module).__name__

    def forward(*args: Any, **kwargs: Any) -> Any:
        target = module_ref()
        if target is None:
            raise _C.GraphedError(
                f"Expected the {name} whose forward was graphed to be alive for an eager call, "
                f"but it was deleted. Keep the module (or its graphed forward, which keeps it) "
                f"for as long as you call it; see "
                f"docs/troubleshooting.md#graphed-callables-arguments.")
        return function(target, *args, **kwargs)

    if signature is not None:
        forward.__signature__ = signature  # type: ignore[attr-defined]
    return forward
