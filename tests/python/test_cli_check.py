"""`graphed check MODULE:FACTORY`: exit codes 0 (clean), 1 (blockers), 2 (bad input), the
report in text and JSON, and messages that name the factory and what was expected."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

WORKLOADS = textwrap.dedent(
    """\
    import torch


    def blocked():
        def step(x):
            return x.sum().item()

        return step, (torch.ones(3),)


    def clean():
        return (lambda x, scale: x * scale), [torch.ones(3)], {"scale": 2.0}


    def raises():
        raise ValueError("no data here")


    def returns_a_number():
        return 42


    def returns_no_callable():
        return "step", (torch.ones(3),)


    def returns_bad_kwargs():
        return (lambda x: x), (torch.ones(3),), ["scale"]


    NOT_A_FACTORY = 3


    def workload_raises():
        def step(x):
            raise RuntimeError("boom in step")

        return step, (torch.ones(1),)
    """
)

# The line of `x.sum().item()` in WORKLOADS.
ITEM_LINE = 6


@pytest.fixture
def workloads(tmp_path):
    (tmp_path / "my_workloads.py").write_text(WORKLOADS)
    return tmp_path


def run_check(directory, *args, cwd=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(directory), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "graphed", "check", *args], capture_output=True,
                          text=True, timeout=600, env=env, cwd=cwd or os.getcwd())


def test_blockers_found_exit_1_with_the_report(workloads):
    result = run_check(workloads, "my_workloads:blocked")
    assert result.returncode == 1, result.stdout + result.stderr
    path = workloads / "my_workloads.py"
    assert f"1. host read (breaks capture): `aten::item` at {path}:{ITEM_LINE} in step" in result.stdout
    assert "fix:" in result.stdout
    assert result.stderr == ""


def test_clean_workload_exits_0(workloads):
    result = run_check(workloads, "my_workloads:clean")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no capture blockers among" in result.stdout


def test_json_report(workloads):
    result = run_check(workloads, "my_workloads:blocked", "--json")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["factory"] == "my_workloads:blocked"
    assert report["description"] == "function `blocked.<locals>.step`"
    (finding,) = report["findings"]
    assert finding["kind"] == "host_read"
    assert finding["op"] == "aten::item"
    assert finding["line"] == ITEM_LINE
    assert finding["function"] == "step"
    assert finding["count"] == 1


def test_the_current_directory_is_importable(workloads, tmp_path):
    result = run_check(tmp_path / "elsewhere", "my_workloads:clean", cwd=workloads)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_factory_named_by_its_file_imports_its_neighbours(workloads, tmp_path):
    # As `python path/to/train.py` runs it: the file's directory is importable.
    (workloads / "train.py").write_text("from my_workloads import clean, blocked\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = run_check(elsewhere, f"{workloads / 'train.py'}:clean", cwd=elsewhere)
    assert result.returncode == 0, result.stdout + result.stderr
    result = run_check(elsewhere, f"{workloads / 'train.py'}:blocked", cwd=elsewhere)
    assert result.returncode == 1, result.stdout + result.stderr
    relative = os.path.relpath(workloads / "train.py", elsewhere)
    result = run_check(elsewhere, f"{relative}:clean", cwd=elsewhere)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_factory_file_that_is_missing_or_raises_is_named(workloads, tmp_path):
    missing = run_check(tmp_path, f"{tmp_path / 'nope.py'}:make")
    assert missing.returncode == 2
    assert f"there is no file {str(tmp_path / 'nope.py')!r}" in missing.stderr
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom at import')\n")
    broken = run_check(tmp_path, f"{tmp_path / 'broken.py'}:make")
    assert broken.returncode == 2
    assert "cannot import file" in broken.stderr and "boom at import" in broken.stderr


BAD_INPUT = [
    ("my_workloads", "expected MODULE:FACTORY or FILE.py:FACTORY, e.g. my_pkg.workloads:"
                     "make_step or path/to/train.py:make_step, got 'my_workloads'"),
    ("no_such_module:make", "cannot import module 'no_such_module' of factory "
                            "'no_such_module:make': ModuleNotFoundError"),
    ("my_workloads:missing", "module 'my_workloads' has no attribute 'missing', so factory "
                             "'my_workloads:missing' does not exist"),
    ("my_workloads:NOT_A_FACTORY", "factory 'my_workloads:NOT_A_FACTORY' is a int, not a "
                                   "callable"),
    ("my_workloads:raises", "factory 'my_workloads:raises' raised ValueError: no data here"),
    ("my_workloads:returns_a_number", "factory 'my_workloads:returns_a_number' returned int 42; "
                                      "a factory returns (fn, args) or (fn, args, kwargs)"),
    ("my_workloads:returns_no_callable", "returned fn (the first element) str 'step', which is "
                                         "not callable"),
    ("my_workloads:returns_bad_kwargs", "returned kwargs (the third element) list ['scale']"),
    ("my_workloads:workload_raises", "the workload of factory 'my_workloads:workload_raises' "
                                     "raised RuntimeError: boom in step"),
]


@pytest.mark.parametrize("spec, message", BAD_INPUT, ids=[spec for spec, _ in BAD_INPUT])
def test_bad_input_exits_2_naming_the_factory(workloads, spec, message):
    result = run_check(workloads, spec)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr, result.stderr
    assert result.stderr.rstrip().splitlines()[-1].startswith("graphed check: ")
    assert result.stdout == ""


def test_help_describes_the_exit_codes():
    result = subprocess.run([sys.executable, "-m", "graphed", "check", "--help"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0
    assert "MODULE:FACTORY" in result.stdout
    assert "--json" in result.stdout
    assert "0 nothing found, 1 blockers found, 2 bad input" in " ".join(result.stdout.split())
