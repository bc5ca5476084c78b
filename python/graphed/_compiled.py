"""torch.compile under graphed's graphs: the arguments, the choice and the time
limit of graphed.optimize's compiled candidate (and graphed.generate's
compiled decode step).

Note [A compiled candidate]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Graphs remove the host's launch cost; Inductor's fusion removes kernels. On a
step whose graphed time is mostly kernels (vision models, state-space scans,
anything with many elementwise ops between its matrix products) the two
compose: ``TrainStep.from_parts(torch.compile(model), ...)`` captures the
compiled model's kernels as it captures eager ones. So
``optimize(..., compile=...)`` may build a second candidate after the
graphed one:

- ``compile=False``: never. ``True`` (or a dict of torch.compile's
  arguments): always, where the strategy is a whole-step capture.
  ``"auto"``: where advise predicts the compiled step at least
  ``AUTO_GAIN`` faster than the graphed one (Note [Predicting a compiled
  step] in src/compile_estimate.cpp), so that a launch-bound step pays no
  compile for nothing.
- Where advise says graphs alone won't help (a GPU-bound step, say) but
  predicts the compiled step as far ahead of eager as graphs must be
  (``AdviceInputs::helps_above``, 1.2x), optimize still builds the whole capture, so that the compiled
  candidate is tried (timm ConvNeXt-T on the H200: graphs alone 1.08x
  predicted, compiled 1.35x). Whichever candidate is kept must beat eager.
- The candidate is built on the same model, optimizer and settings, after
  the graphed candidate is dropped and the state restored: the two cannot
  live at once, as each owns the parameters' ``.grad`` buffers. It is
  verified against the same eager reference (fused kernels round
  differently: the usual rtol/atol and parameter bound apply) and timed
  against eager like the graphed candidate; the faster is kept, and the
  graphed one rebuilt if it wins (a capture, not a compile).
- Compilation happens in TrainStep's warm-up, before its capture; a capture
  never compiles. ``compile_timeout`` bounds the build: past it the
  candidate is dropped (on the main thread a SIGALRM interrupts the compile;
  elsewhere the build finishes and is then refused).
- Random ops (dropout): the candidate compiles with Inductor's
  ``fallback_random=True`` (unless ``compile=``'s ``options`` set it), so
  its random numbers come from eager's generator, and its verify steps
  start from the generator state the eager reference started from. Even so
  the compiled dropout draws other numbers than eager's fused dropout
  kernel (measured on the H200: BERT and GPT-2 losses 2% apart after three
  steps), so where a module in training mode applies dropout the graphs
  are verified against the same compiled iteration run without graphs
  (``report.compiled["verified_against"]`` says so): what graphed adds,
  the capture, is verified; the fused kernels' numerics are torch.compile's.
- Modes that record Inductor's own CUDA graphs (reduce-overhead,
  max-autotune, ``triton.cudagraphs``) are refused: those graphs cannot be
  captured inside graphed's.
- Inference (``optimize(model, sample_batch=x, compile=...)``): the
  compiled capture is built next to the graphed one (inference graphs own
  no gradients, so both live), verified against the eager outputs and timed
  side by side with it and eager; the slower is dropped.
- Whatever fails (compile errors, numerics, the time limit) is reported in
  ``report.compiled`` and leaves the graphed candidate in place.

Note [Compiled blocks in graphed.auto]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``auto(model, compile=True)`` is vLLM's arrangement: compiled pieces,
captured by the caller. What the core calls as a managed module's eager
forward (warm-up, capture, fallbacks of an out-of-order call) becomes the
class's forward under torch.compile, called with the module as its first
argument (held weakly, as any eager forward: _weak_forward.py). So:

- The warm-up calls compile; the capture records the compiled kernels and
  compiles nothing, as the inputs, parameters and global state it runs with
  are those the warm-up met (a guard that failed only under capture would
  recompile inside it, which no capture survives: Note [The mask rules under
  torch.compile] in integrations/transformers_masks.py).
- The calls run with autocast's weight cache off, as graphed's captures
  and checks do (Note [Autocast's cache while graphed.auto captures]):
  Dynamo guards on it, and a warm-up compiled with it on would compile
  again under the capture.
- Repeated blocks share one compiled function per class: Dynamo treats the
  module's parameters as inputs (inlined built-in modules, torch's default
  since 2.5), so twelve layers compile once, as torch's regional compilation
  recipe does with ``layer.compile()``. ``layer.compile()`` itself cannot be
  used: it compiles ``__call__``, which calls the managed forward that
  graphed installs, and Dynamo would trace into the core.
- A module that can never use a graph runs its own, uncompiled forward
  again (its parts are managed in its place, and a compiled forward would
  trace into their managed forwards).
- Training: the compiled forward's backward (AOTAutograd's) is compiled on
  the first warm-up backward and captured in the backward graph like any
  other."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from ._C import GraphedError

#: torch.compile's keyword arguments that a compiled candidate may set.
COMPILE_KEYS = ("fullgraph", "dynamic", "backend", "mode", "options")
#: Inductor modes that record CUDA graphs of their own (cudagraph trees),
#: which cannot run inside a graph graphed captures.
GRAPHING_MODES = ("reduce-overhead", "max-autotune")
#: compile="auto" builds the compiled candidate when its predicted time is
#: below this share of the graphed candidate's predicted time.
AUTO_GAIN = 0.92


def torch_compile_options(compile: Any, what: str, allow_auto: bool = False
                          ) -> Tuple[str, Optional[Dict[str, Any]]]:
    """``(choice, options)``: choice "off", "on" or "auto" (only where
    ``allow_auto``), options torch.compile's keyword arguments (None when
    off). ``what`` names what is compiled in the messages."""
    if compile is None or compile is False:
        return "off", None
    if compile is True:
        return "on", {}
    if compile == "auto" and allow_auto:
        return "auto", {}
    if not isinstance(compile, dict):
        expected = "True, False, \"auto\"" if allow_auto else "True, False"
        raise GraphedError(f"Expected compile={expected} or a dict of torch.compile arguments "
                           f"({', '.join(COMPILE_KEYS)}), got {compile!r}.")
    unknown = sorted(set(compile) - set(COMPILE_KEYS))
    if unknown:
        raise GraphedError(f"compile= takes torch.compile's arguments {', '.join(COMPILE_KEYS)}; "
                           f"got {', '.join(unknown)}. Remove them.")
    options = compile.get("options") or {}
    if compile.get("mode") in GRAPHING_MODES or options.get("triton.cudagraphs"):
        shown = compile.get("mode") or "options={'triton.cudagraphs': True}"
        raise GraphedError(
            f"Expected a torch.compile mode that records no CUDA graphs of its own (None, "
            f"'default' or 'max-autotune-no-cudagraphs'), got {shown!r}: graphed captures the "
            f"{what} itself, and Inductor's graphs cannot be captured inside it. Pass "
            f"compile=True or compile={{'mode': 'max-autotune-no-cudagraphs'}}.")
    return "on", dict(compile)


def worth_compiling(choice: str, advice: Any) -> Tuple[bool, str]:
    """Whether to build the compiled candidate, and why (for the report)."""
    if choice == "off":
        return False, "compile=False"
    if choice == "on":
        return True, "compile requested"
    compiled = advice.to_dict().get("compiled") if advice is not None else None
    if not compiled:
        return False, "no prediction of the compiled step"
    predicted, graphed = compiled["predicted_ms"], advice.predicted_ms
    if predicted < AUTO_GAIN * graphed:
        return True, (f"predicted {predicted:.3f} ms compiled against {graphed:.3f} ms graphed "
                      f"(fusible kernels {compiled['fusible_ms']:.3f} ms)")
    return False, (f"not built: predicted {predicted:.3f} ms compiled against {graphed:.3f} ms "
                   f"graphed, under the {100 * (1 - AUTO_GAIN):.0f}% gain that pays a compile")


def compiled_forward(module: Any, options: Dict[str, Any],
                     shared: Dict[Any, Callable[..., Any]]) -> Callable[..., Any]:
    """``module``'s forward under torch.compile, holding ``module`` weakly
    (Note [Compiled blocks in graphed.auto]); ``shared`` maps a class's
    forward function to its compiled function, so that instances of one
    class share it. A forward set on the instance is compiled on its own."""
    import inspect
    import weakref

    import torch

    original = module.forward
    if not (inspect.ismethod(original) and original.__self__ is module):
        if original not in shared:
            shared[original] = torch.compile(original, **options)
        return shared[original]
    function = original.__func__
    if function not in shared:
        shared[function] = torch.compile(function, **options)
    compiled, module_ref, name = shared[function], weakref.ref(module), type(module).__name__

    def forward(*args: Any, **kwargs: Any) -> Any:
        target = module_ref()
        if target is None:
            raise GraphedError(
                f"Expected the {name} whose forward was compiled and graphed to be alive for a "
                f"call, but it was deleted. Keep the module for as long as you call it; see "
                f"docs/troubleshooting.md#graphed-callables-arguments.")
        # Captures run with autocast's cache off; so does every call here, so
        # that Dynamo's guard on it holds from the warm-up to the capture.
        cached = torch.is_autocast_cache_enabled()
        if cached:
            torch.set_autocast_cache_enabled(False)
        try:
            return compiled(target, *args, **kwargs)
        finally:
            if cached:
                torch.set_autocast_cache_enabled(True)

    try:
        forward.__signature__ = inspect.signature(original)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        pass
    return forward


class CompileTimeout(GraphedError):
    """The compiled candidate took longer than ``compile_timeout`` to build."""


@contextlib.contextmanager
def time_limit(seconds: Optional[float], what: str) -> Iterator[None]:
    """Raises CompileTimeout in the block once ``seconds`` pass (SIGALRM, on
    the main thread of a POSIX process; elsewhere, or for None, no limit is
    enforced here and the caller checks the elapsed time)."""
    usable = (seconds is not None and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise CompileTimeout(f"{what} took longer than compile_timeout={seconds:g} s; raise "
                             "compile_timeout or pass compile=False")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, float(seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0.0)
        signal.signal(signal.SIGALRM, previous)
