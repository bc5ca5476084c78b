"""The tools around graphs (issue 15): progress bars, the ``graphed`` logger,
``graphed --version`` and the NVTX switch. CPU only."""

import ast
import io
import logging
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import graphed
from graphed import _progress
from graphed._progress import CaptureProgress, Progress


class _Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self):
        return True


@pytest.fixture
def no_setting(monkeypatch):
    monkeypatch.delenv("GRAPHED_PROGRESS", raising=False)


# --- progress -----------------------------------------------------------------------


@pytest.mark.usefixtures("no_setting")
def test_progress_is_quiet_when_the_stream_is_not_a_terminal():
    out = io.StringIO()
    with Progress(3, "work", file=out) as bar:
        bar("one")
        bar.update(1, status="x")
        bar("two")
    assert bar.backend is None
    assert out.getvalue() == ""
    assert bar.n == 2  # one update and one finished stage, counted though nothing is shown


@pytest.mark.usefixtures("no_setting")
def test_progress_draws_on_a_terminal():
    pytest.importorskip("tqdm")
    out = _Terminal()
    with Progress(2, "graphed.test", file=out) as bar:
        bar("check")
        bar("apply")
    assert bar.backend == "tqdm"
    assert "graphed.test" in out.getvalue()


@pytest.mark.parametrize("value, shown", [("0", False), ("off", False), ("false", False),
                                          ("1", True), ("yes", True), ("", None)])
def test_graphed_progress_decides(monkeypatch, value, shown):
    monkeypatch.setenv("GRAPHED_PROGRESS", value)
    assert _progress.enabled(_Terminal()) is (True if shown is None else shown)
    assert _progress.enabled(io.StringIO()) is (False if shown is None else shown)


def test_graphed_progress_0_silences_a_terminal(monkeypatch):
    monkeypatch.setenv("GRAPHED_PROGRESS", "0")
    out = _Terminal()
    with Progress(2, "work", file=out) as bar:
        bar("one")
    assert bar.backend is None and out.getvalue() == ""


def test_progress_uses_tqdm_when_installed(monkeypatch):
    tqdm = pytest.importorskip("tqdm")
    out = io.StringIO()
    bar = Progress(4, "graphed.optimize", file=out, show=True)
    assert bar.backend == "tqdm" and isinstance(bar._bar, tqdm.tqdm)
    bar("check and advise")
    bar("apply")
    assert bar._bar.n == 1
    bar.close()
    bar.close()  # idempotent
    assert "graphed.optimize" in out.getvalue()


def test_progress_works_without_tqdm_or_rich(monkeypatch):
    # None in sys.modules makes `import tqdm` raise ImportError.
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "rich", None)
    monkeypatch.setitem(sys.modules, "rich.progress", None)
    monkeypatch.setitem(sys.modules, "rich.console", None)
    out = io.StringIO()
    with Progress(2, "graphed.optimize", file=out, show=True) as bar:
        bar("check and advise")
        bar("verify")
    assert bar.backend == "text"
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("graphed.optimize [") and "check and advise" in lines[0]
    assert "verify" in lines[1]


def test_progress_falls_back_to_rich_without_tqdm(monkeypatch):
    pytest.importorskip("rich")
    monkeypatch.setitem(sys.modules, "tqdm", None)
    out = io.StringIO()
    with Progress(2, "graphed.Decoder", file=out, show=True) as bar:
        bar.update(1, status="batch 8")
        bar.update(1, status="batch 4")
    assert bar.backend == "rich"


def test_capture_progress_opens_one_bar_per_module(monkeypatch):
    monkeypatch.setenv("GRAPHED_PROGRESS", "0")
    opened = []
    real = Progress

    def recording(total, desc, **kwargs):
        bar = real(total, desc, **kwargs)
        opened.append((desc, bar))
        return bar

    monkeypatch.setattr(_progress, "Progress", recording)
    callback = CaptureProgress("graphed.auto: capturing")
    for done in (1, 2, 3):
        callback("layers.0", done, 3)
    callback("layers.1", 1, 3)
    callback("layers.1", 3, 3)  # the budget stopped the captures early
    assert [desc for desc, _ in opened] == ["graphed.auto: capturing layers.0",
                                            "graphed.auto: capturing layers.1"]
    assert [bar.n for _, bar in opened] == [3, 3]
    assert all(bar._closed for _, bar in opened)


# --- logging --------------------------------------------------------------------


def test_graphed_logger_is_quiet_by_default():
    logger = logging.getLogger("graphed")
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)


def test_graphed_debug_messages_reach_a_handler(caplog):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with caplog.at_level(logging.DEBUG, logger="graphed"):
        graphed.auto(model)
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("graphed")]
    assert any(m.startswith("auto: Sequential graphs") for m in messages), messages


def test_library_code_does_not_print():
    """print() is for the command line and the demo, whose output is the product.
    Calls are found in the syntax tree, so a docstring's example may print."""
    root = os.path.dirname(graphed.__file__)
    allowed = {"cli.py", "demo.py", "_progress.py", "__init__.py"}
    offenders = []
    for directory, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".py") or name in allowed:
                continue
            with open(os.path.join(directory, name)) as handle:
                tree = ast.parse(handle.read())
            offenders += [f"{name}:{node.lineno}" for node in ast.walk(tree)
                          if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                          and node.func.id == "print"]
    assert offenders == []


# --- --version ------------------------------------------------------------------


@pytest.mark.parametrize("command", [["-m", "graphed"], ["-c", "import sys; from graphed.cli "
                                                           "import main; sys.exit(main())"]])
def test_version_names_graphed_torch_and_cuda(command):
    result = subprocess.run([sys.executable, *command, "--version"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"graphed {graphed.__version__}"
    info = graphed.build_info()
    assert f"built with torch {info['torch']}, CUDA {info['cuda']}" in lines[1]
    assert f"running on torch {torch.__version__}" in lines[2]


def test_build_info():
    info = graphed.build_info()
    assert info["version"] == graphed.__version__
    assert info["torch"].split(".")[:2] == torch.__version__.split("+")[0].split(".")[:2]
    assert info["cuda"][0].isdigit()
    assert isinstance(info["nvtx"], bool)


# --- NVTX -----------------------------------------------------------------------


def test_set_nvtx_switches_and_returns_the_previous_setting():
    previous = graphed.set_nvtx(False)
    try:
        assert graphed.nvtx_enabled() is False
        assert graphed.set_nvtx(True) is False
        assert graphed.nvtx_enabled() is graphed.build_info()["nvtx"]
    finally:
        graphed.set_nvtx(previous)


def test_set_nvtx_wants_a_bool():
    with pytest.raises(TypeError, match="True or False"):
        graphed.set_nvtx(1)


@pytest.mark.parametrize("value, expected", [("0", False), ("off", False), ("1", True),
                                             (None, True)])
def test_graphed_nvtx_environment(value, expected):
    environment = dict(os.environ)
    environment.pop("GRAPHED_NVTX", None)
    if value is not None:
        environment["GRAPHED_NVTX"] = value
    result = subprocess.run([sys.executable, "-c", "import graphed; print(graphed.nvtx_enabled(), "
                             "graphed.build_info()['nvtx'])"], env=environment,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    enabled, available = result.stdout.split()
    assert enabled == str(expected and available == "True")
