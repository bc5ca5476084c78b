"""graphed.check: run a function once and name everything in it that would break CUDA graph capture."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Any, Callable, Iterator, List, Tuple

import torch

from . import _C
from .capture import _describe


def check(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> _C.SafetyReport:
    """Run ``fn(*args, **kwargs)`` once, eagerly, and report what would break capture.

    Every operation that breaks or spoils CUDA graph capture is reported with
    its kind, the operator, its tensor inputs, why it breaks capture, the fix
    and the line of your code that called it: host reads (``.item()``,
    ``bool(t)``, ``.tolist()``), data-dependent shapes (``nonzero``,
    ``masked_select``, ``unique``, ``x[mask]``), explicit syncs
    (``torch.cuda.synchronize``, event and stream ``synchronize``),
    host-device copies (``.cpu()``, ``.to("cpu")``, CUDA tensors built from
    Python lists or NumPy arrays), CPU tensors in GPU work, random numbers
    from non-default generators, and autocast with its cache on.

    It works on CPU tensors too: then it reports what would break once the
    tensors live on the GPU (``report.ran_on_gpu`` is False), so it runs in CI
    and on laptops. ``fn`` runs as you would run it (grad mode as it is); a
    module's buffers and the default random generators are restored
    afterwards, also when ``fn`` raises, and its exception propagates.

    Returns a :class:`graphed.SafetyReport`: true when anything was found,
    ``str()`` is the report for people, ``.findings`` the findings (``kind``,
    ``op``, ``inputs``, ``why``, ``fix``, ``file``, ``line``, ``function``,
    ``count``), ``.to_dict()`` the JSON form.

    Operations found through Python (the syncs, ``tolist``, ``.cpu()``,
    ``torch.tensor``) are found when called through ``torch``'s attributes
    (``torch.cuda.synchronize()``, ``x.tolist()``), not through a name bound
    before the check (``from torch.cuda import synchronize``).

    The pass walks the path a capture walks: code outside torch that asks
    ``torch.cuda.is_current_stream_capturing()`` (transformers does, to skip
    host reads while capturing) is told True, so what is reported is what a
    capture would meet (Note [Checking the path taken under capture] in
    src/safety_check.cpp). Each finding has a ``severity``:
    ``"breaks_capture"`` (CUDA refuses it), ``"spoils_replay"`` (a value is
    frozen into the graph; a capture succeeds and replays compute with stale
    data) or ``"harmless"``; harmless ones (copies of zero bytes) are kept
    apart in ``report.harmless`` and do not make the report true.
    ``report.verdict`` says what graphed's own APIs do with the findings:
    ``"clean"``, ``"try_capture"`` (every finding inside installed packages
    such as transformers: a trial capture decides) or ``"blocked"``.
    """
    state: List[torch.Tensor] = []
    if isinstance(fn, torch.nn.Module):
        state = list(fn.buffers())
    return _C.check_safety(lambda: fn(*args, **kwargs), state, _describe(fn))


def _run_pass(run: Callable[[], None]) -> None:
    """Every check pass, from Python or from the core (graphed.auto's warm-up),
    runs inside the host-call shims; see _C.set_check_pass_wrapper."""
    with _host_call_shims():
        run()


# Host calls that never reach ATen's dispatcher are recorded by wrapping them
# for the duration of the pass; see Note [How the safety check observes] in
# src/safety_check.cpp. Each wrapper records the call, then runs it with the
# check ignoring its operators (one finding per call).


def _sync_shim(call: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def synchronize(*args: Any, **kwargs: Any) -> Any:
        _C.record_host_blocker("explicit_sync", call, [])
        if not torch.cuda.is_available():
            return None  # Nothing to wait for, and torch would raise without a GPU.
        with _C.quiet_operators():
            return original(*args, **kwargs)

    return synchronize


def _tensor_method_shim(kind: str, call: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        _C.record_host_blocker(kind, call, [self])
        with _C.quiet_operators():
            return original(self, *args, **kwargs)

    return method


def _to_shim(original: Callable[..., Any]) -> Callable[..., Any]:
    # Only a device spelled "cpu" is an explicit move to the host; a device
    # object may be the tensor's own (x.to(y.device)), a no-op anywhere.
    @functools.wraps(original)
    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, str) and (target == "cpu" or target.startswith("cpu:")):
            _C.record_host_blocker("host_device_copy", "Tensor.to('cpu')", [self])
            with _C.quiet_operators():
                return original(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    return to


def _element_count(data: Any) -> int:
    """Elements of a tensor built from ``data`` (-1 when unknown)."""
    if isinstance(data, (list, tuple)):
        counts = [_element_count(item) for item in data]
        return -1 if any(c < 0 for c in counts) else sum(counts)
    size = getattr(data, "size", None)  # a NumPy array
    if isinstance(size, int):
        return size
    return 1 if isinstance(data, (bool, int, float, complex)) else -1


def _from_host_data(call: str, data: Any, device: Any, build: Callable[[Any], Any]) -> Any:
    if isinstance(data, torch.Tensor):
        return build(device)
    target = torch.device(device) if device is not None else torch.get_default_device()
    if not _C.record_tensor_from_host_data(call, target, _element_count(data)):
        return build(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        # Recorded; build it on the CPU so that the rest of the function can be checked.
        device = "cpu"
    with _C.quiet_operators():
        return build(device)


def _tensor_shim(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def tensor(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> Any:
        return _from_host_data("torch.tensor", data, device,
                               lambda target: original(data, *args, device=target, **kwargs))

    return tensor


def _as_tensor_shim(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def as_tensor(data: Any, dtype: Any = None, device: Any = None) -> Any:
        return _from_host_data("torch.as_tensor", data, device,
                               lambda target: original(data, dtype=dtype, device=target))

    return as_tensor


_TORCH_DIRECTORY = os.path.dirname(torch.__file__) + os.sep


def _capturing_shim(original: Callable[[], bool]) -> Callable[[], bool]:
    # See Note [Checking the path taken under capture] in src/safety_check.cpp:
    # torch's own callers (an optimizer's capture health check) see the truth.
    @functools.wraps(original)
    def is_current_stream_capturing() -> bool:
        caller = sys._getframe(1).f_code.co_filename
        if caller.startswith(_TORCH_DIRECTORY):
            return original()
        return True

    return is_current_stream_capturing


def _shims() -> List[Tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]]:
    return [
        (torch.cuda, "is_current_stream_capturing", _capturing_shim),
        (torch.cuda, "synchronize", functools.partial(_sync_shim, "torch.cuda.synchronize")),
        (torch.cuda.Event, "synchronize",
         functools.partial(_sync_shim, "torch.cuda.Event.synchronize")),
        (torch.cuda.Stream, "synchronize",
         functools.partial(_sync_shim, "torch.cuda.Stream.synchronize")),
        (torch.Tensor, "tolist", functools.partial(_tensor_method_shim, "host_read", "Tensor.tolist")),
        (torch.Tensor, "cpu",
         functools.partial(_tensor_method_shim, "host_device_copy", "Tensor.cpu")),
        (torch.Tensor, "to", _to_shim),
        (torch, "tensor", _tensor_shim),
        (torch, "as_tensor", _as_tensor_shim),
    ]


@contextlib.contextmanager
def _host_call_shims() -> Iterator[None]:
    """Wraps the host calls of _shims() while the block runs; restores them all afterwards."""
    restore: List[Tuple[Any, str, bool, Any]] = []
    try:
        for owner, name, make in _shims():
            own = name in vars(owner)  # else inherited, e.g. Tensor.tolist from TensorBase
            original = vars(owner).get(name)
            setattr(owner, name, make(getattr(owner, name)))
            restore.append((owner, name, own, original))
        yield
    finally:
        for owner, name, own, original in reversed(restore):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


_C.set_check_pass_wrapper(_run_pass)
