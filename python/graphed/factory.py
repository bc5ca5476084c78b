"""Workload factories of the command line: ``MODULE:FACTORY`` (or ``path/to/file.py:FACTORY``)
names a callable that builds the workload."""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Tuple

_EXPECTED = (
    "a factory returns (fn, args) or (fn, args, kwargs): fn a callable, args a tuple or list of "
    "its positional arguments, kwargs a dict of its keyword arguments"
)


class FactoryError(Exception):
    """The factory could not be imported, raised, or returned something else than a workload.

    The message names the factory and says what was expected. ``details`` holds
    the traceback of an exception the factory or its import raised, or "".
    """

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


@dataclass
class Workload:
    """A function and the arguments to call it with."""

    fn: Callable[..., Any]
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any] = field(default_factory=dict)


def _describe(value: Any) -> str:
    text = " ".join(repr(value).split())  # one line, also for tensors
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(value).__name__} {text}"


def load_workload(spec: str) -> Workload:
    """Imports ``MODULE:FACTORY`` (e.g. ``my_pkg.workloads:make_step``), calls the factory and
    checks what it returned. The current directory is importable, as with ``python -m``.

    Raises:
        FactoryError: the message names the factory and what was expected.
    """
    result = _call_factory(spec, _EXPECTED)
    return _as_workload(spec, result, _EXPECTED)


def _import_file(path: str, spec: str, attribute: str, expected: str) -> Any:
    """The module of a factory named by its file (``path/to/train.py:make_step``),
    imported as ``python path/to/train.py`` would run it: its directory first on
    sys.path, so that the file's own imports of its neighbours work."""
    import importlib.util

    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise FactoryError(
            f"cannot import factory {spec!r}: there is no file {full!r}. Name an existing "
            f"Python file, or a module (my_pkg.workloads:{attribute}), that defines "
            f"{attribute!r} ({expected}).")
    directory = os.path.dirname(full)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    name = os.path.splitext(os.path.basename(full))[0]
    module_spec = importlib.util.spec_from_file_location(name, full)
    if module_spec is None or module_spec.loader is None:
        raise FactoryError(
            f"cannot import factory {spec!r}: {full!r} is not a Python source file Python can "
            f"load. Name a .py file that defines {attribute!r} ({expected}).")
    module = importlib.util.module_from_spec(module_spec)
    previous = sys.modules.get(name)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - any import failure is the user's to see
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
        raise FactoryError(
            f"cannot import file {full!r} of factory {spec!r}: {type(error).__name__}: {error}. "
            f"It must run as a module and define {attribute!r} ({expected}).",
            traceback.format_exc(),
        ) from error
    return module


def _is_file_spec(module_name: str) -> bool:
    return module_name.endswith(".py") or "/" in module_name or os.sep in module_name


def _call_factory(spec: str, expected: str) -> Any:
    # The last colon: a Windows path's drive letter has one too.
    module_name, colon, attribute = spec.rpartition(":")
    if not colon or not module_name or not attribute:
        raise FactoryError(
            f"expected MODULE:FACTORY or FILE.py:FACTORY, e.g. my_pkg.workloads:make_step or "
            f"path/to/train.py:make_step, got {spec!r}; {expected}"
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    if _is_file_spec(module_name):
        module = _import_file(module_name, spec, attribute, expected)
    else:
        module = _import_module(module_name, spec, attribute, expected)
    factory: Any = module
    for part in attribute.split("."):
        if not hasattr(factory, part):
            raise FactoryError(
                f"module {module_name!r} has no attribute {attribute!r}, so factory {spec!r} does "
                f"not exist; expected a function there that builds the workload ({expected})"
            )
        factory = getattr(factory, part)
    if not callable(factory):
        raise FactoryError(
            f"factory {spec!r} is a {type(factory).__name__}, not a callable; expected a function "
            f"that builds the workload ({expected})"
        )
    try:
        return factory()
    except Exception as error:  # noqa: BLE001 - the user's factory may raise anything
        raise FactoryError(
            f"factory {spec!r} raised {type(error).__name__}: {error}; it should build the "
            f"workload ({expected})",
            traceback.format_exc(),
        ) from error


def _import_module(module_name: str, spec: str, attribute: str, expected: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any import failure is the user's to see
        # A module that is not there needs no traceback; one that fails while importing does.
        missing = isinstance(error, ModuleNotFoundError) and error.name is not None and (
            module_name == error.name or module_name.startswith(error.name + ".")
        )
        raise FactoryError(
            f"cannot import module {module_name!r} of factory {spec!r}: "
            f"{type(error).__name__}: {error}. The module must be importable from the current "
            f"directory or PYTHONPATH, and define {attribute!r} there ({expected}).",
            "" if missing else traceback.format_exc(),
        ) from error


def _as_workload(spec: str, result: Any, expected: str) -> Workload:
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        problem = f"returned {_describe(result)}"
    elif not callable(result[0]):
        problem = f"returned fn (the first element) {_describe(result[0])}, which is not callable"
    elif not isinstance(result[1], (tuple, list)):
        problem = f"returned args (the second element) {_describe(result[1])}"
    elif len(result) == 3 and not isinstance(result[2], dict):
        problem = f"returned kwargs (the third element) {_describe(result[2])}"
    else:
        return Workload(result[0], tuple(result[1]), dict(result[2]) if len(result) == 3 else {})
    raise FactoryError(f"factory {spec!r} {problem}; {expected}")


_EXPECTED_ANY = (
    "a factory returns an inference workload (fn, args) or (fn, args, kwargs): fn a callable, "
    "args a tuple or list of its positional arguments, kwargs a dict; or a training workload "
    "(model, optimizer, loss_fn, batch): an nn.Module, a torch.optim.Optimizer over its "
    "parameters, a callable loss_fn(output, targets) and batch = (inputs, targets)"
)


@dataclass
class TrainingWorkload:
    """A model, its optimizer, a loss function and a sample batch ``(inputs, targets)``."""

    model: Any
    optimizer: Any
    loss_fn: Callable[..., Any]
    batch: Tuple[Any, Any]


def load_any_workload(spec: str) -> "Workload | TrainingWorkload":
    """As load_workload, but the factory may also return a training workload
    ``(model, optimizer, loss_fn, batch)`` (for graphed advise and optimize).

    Raises:
        FactoryError: the message names the factory and what was expected.
    """
    import torch

    result = _call_factory(spec, _EXPECTED_ANY)
    if isinstance(result, (tuple, list)) and len(result) == 4:
        model, optimizer, loss_fn, batch = result
        if not isinstance(model, torch.nn.Module):
            problem = f"returned model (the first of four elements) {_describe(model)}"
        elif not isinstance(optimizer, torch.optim.Optimizer):
            problem = f"returned optimizer (the second of four elements) {_describe(optimizer)}"
        elif not callable(loss_fn):
            problem = f"returned loss_fn (the third of four elements) {_describe(loss_fn)}"
        elif not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            problem = f"returned batch (the fourth of four elements) {_describe(batch)}"
        else:
            return TrainingWorkload(model, optimizer, loss_fn, tuple(batch))
        raise FactoryError(f"factory {spec!r} {problem}; {_EXPECTED_ANY}")
    return _as_workload(spec, result, _EXPECTED_ANY)
