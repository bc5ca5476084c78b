"""Progress bars for graphed's steps that take seconds: ``graphed.optimize``'s
stages, capturing many buckets (``graphed.auto`` with buckets,
``graphed.Decoder.capture()``), the CLI and ``bench/run.py``.

tqdm draws the bar when it is installed, else rich, else one plain line per
stage. Nothing is drawn when stderr is not a terminal (logs, CI, pipes), or
with ``GRAPHED_PROGRESS=0`` in the environment; ``GRAPHED_PROGRESS=1`` draws
even then. Neither tqdm nor rich is required (``pip install graphed[progress]``
adds tqdm).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Optional, TextIO

_OFF = {"0", "false", "off", "no"}
_ON = {"1", "true", "on", "yes", "force"}


def enabled(stream: Optional[TextIO] = None) -> bool:
    """Whether progress is shown on ``stream`` (default: stderr):
    ``GRAPHED_PROGRESS`` decides when set (0/false/off/no or 1/true/on/yes),
    else whether ``stream`` is a terminal."""
    setting = os.environ.get("GRAPHED_PROGRESS", "").strip().lower()
    if setting in _OFF:
        return False
    if setting in _ON:
        return True
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except Exception:  # noqa: BLE001 - closed or replaced streams have no terminal
        return False


class Progress:
    """A progress bar over ``total`` steps, on ``file`` (default: stderr),
    shown only where :func:`enabled` says so; otherwise every method does
    nothing. ``delay`` seconds pass before it appears, so that quick work
    shows nothing.

    Two ways to drive it: ``update(n, status=...)`` advances by ``n`` steps;
    calling it, ``progress("verify")``, marks the start of a stage (the
    previous stage is done), the form ``graphed.optimize(progress=...)``
    takes. Use it as a context manager, or call ``close()``.
    """

    def __init__(self, total: Optional[int], desc: str, *, file: Optional[TextIO] = None,
                 unit: str = "step", delay: float = 0.0, show: Optional[bool] = None) -> None:
        self.total = total
        self.desc = desc
        self._file = sys.stderr if file is None else file
        self._delay = delay
        self._started = time.perf_counter()
        self._stages = 0
        self._done = 0
        self._closed = False
        self._bar: Any = None
        self._rich: Any = None
        self._task: Any = None
        self.backend: Optional[str] = None
        """``"tqdm"``, ``"rich"``, ``"text"``, or None when nothing is shown."""
        if enabled(self._file) if show is None else show:
            self._open(unit)

    def _open(self, unit: str) -> None:
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None:
            self._bar = tqdm(total=self.total, desc=self.desc, file=self._file, unit=unit,
                             leave=False, delay=self._delay, dynamic_ncols=True)
            self.backend = "tqdm"
            return
        try:
            from rich.console import Console
            from rich.progress import Progress as RichProgress
        except ImportError:
            self.backend = "text"
            return
        self._rich = RichProgress(console=Console(file=self._file), transient=True)
        self._rich.start()
        self._task = self._rich.add_task(self.desc, total=self.total)
        self.backend = "rich"

    def update(self, n: int = 1, status: Optional[str] = None) -> None:
        """Advances by ``n`` steps; ``status`` is shown next to the bar."""
        self._done += n
        if self.backend is None or self._closed:
            return
        if self.backend == "tqdm":
            if status is not None:
                self._bar.set_postfix_str(status, refresh=False)
            self._bar.update(n)
        elif self.backend == "rich":
            description = f"{self.desc}: {status}" if status else self.desc
            self._rich.update(self._task, advance=n, description=description)
        elif time.perf_counter() - self._started >= self._delay:
            self._line(status)

    def __call__(self, stage: str) -> None:
        """Marks the start of ``stage``: the previous stage is done."""
        advance = 1 if self._stages else 0
        self._stages += 1
        self._done += advance
        if self.backend is None or self._closed:
            return
        if self.backend == "tqdm":
            if advance:
                self._bar.update(advance)
            self._bar.set_postfix_str(stage)
        elif self.backend == "rich":
            self._rich.update(self._task, advance=advance, description=f"{self.desc}: {stage}")
        else:
            self._line(stage)

    @property
    def n(self) -> int:
        """Steps done so far (counted also when nothing is shown)."""
        return self._done

    def _line(self, status: Optional[str]) -> None:
        total = self.total or 0
        filled = int(20 * min(self._done, total) / total) if total else 0
        counter = f" {self._done}/{total}" if total else ""
        print(f"{self.desc} [{'#' * filled}{'.' * (20 - filled)}]{counter}"
              f"{' ' + status if status else ''} ({time.perf_counter() - self._started:.1f}s)",
              file=self._file, flush=True)

    def close(self) -> None:
        """Completes and removes the bar (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.backend == "tqdm":
            if self.total is not None and self._bar.n < self.total:
                self._bar.update(self.total - self._bar.n)
            self._bar.close()
        elif self.backend == "rich":
            self._rich.stop()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class CaptureProgress:
    """The ``on_captured(name, done, total)`` callback the core calls while
    capturing several graphs in one go (``graphed.auto``'s buckets, captured
    ahead): one bar per module, shown after ``delay`` seconds."""

    def __init__(self, desc: str, *, unit: str = "graph", delay: float = 0.5) -> None:
        self._desc = desc
        self._unit = unit
        self._delay = delay
        self._current: Optional[str] = None
        self._bar: Optional[Progress] = None

    def __call__(self, name: str, done: int, total: int) -> None:
        if self._bar is None or name != self._current or done <= 1:
            if self._bar is not None:
                self._bar.close()
            self._current = name
            self._bar = Progress(total, f"{self._desc} {name}", unit=self._unit,
                                 delay=self._delay)
        self._bar.update(max(0, done - self._bar.n))
        if done >= total:
            self._bar.close()
            self._bar = None
