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
  ``report.compiled`` and leaves the graphed candidate in place."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Dict, Iterator, Optional, Tuple

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
