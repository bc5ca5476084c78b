"""Helpers for tests that check the source lines graphed reports."""

import inspect


def line_of(fn, text):
    """The line number of the first line of fn's source containing text."""
    lines, start = inspect.getsourcelines(fn)
    for offset, line in enumerate(lines):
        if text in line:
            return start + offset
    raise AssertionError(f"{text!r} not in {fn.__name__}")
