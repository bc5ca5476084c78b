"""The GPU tier's reporting, on stored outputs (no GPU needed): the
compute-sanitizer phase's parsing and tables (scripts/gpu_sanitize.py), the
soak workload's rows in bench/run.py's markdown and in
scripts/gpu_check_summary.py."""

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load(relative, name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relative))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sanitize():
    return load("scripts/gpu_sanitize.py", "gpu_sanitize")


@pytest.fixture(scope="module")
def summary():
    return load("scripts/gpu_check_summary.py", "gpu_check_summary")


@pytest.fixture(scope="module")
def bench_run():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        return load("bench/run.py", "bench_run")
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))


SANITIZER_OUTPUT = """\
========= COMPUTE-SANITIZER
........                                                                 [100%]
========= Invalid __global__ read of size 4 bytes
=========     at void kernel()+0x10
========= ERROR SUMMARY: 2 errors
========= COMPUTE-SANITIZER
========= ERROR SUMMARY: 0 errors
========= RACECHECK SUMMARY: 3 hazards displayed (1 errors, 2 warnings)
================= 8 passed, 1 skipped in 93.20s (0:01:33) =================
"""


def test_error_summaries_of_every_traced_process_are_added(sanitize):
    assert sanitize.summary_counts(SANITIZER_OUTPUT) == [2, 0, 1]
    assert sanitize.PYTEST_TAIL.findall(SANITIZER_OUTPUT)[-1] == "8 passed, 1 skipped"


def test_a_run_under_a_fake_sanitizer_is_parsed_and_logged(sanitize, tmp_path):
    fake = tmp_path / "compute-sanitizer"
    fake.write_text("#!/bin/sh\ncat <<'EOF'\n" + SANITIZER_OUTPUT + "EOF\nexit 0\n")
    fake.chmod(0o755)
    log = tmp_path / "sanitize.log"
    entry = sanitize.run_one(str(fake), "memcheck", "python tests", ["true"], str(log), 30)
    assert entry["errors"] == 3 and entry["processes"] == 3
    assert entry["exit_status"] == 0 and not entry["timed_out"]
    assert entry["outcome"] == "8 passed, 1 skipped"
    assert "--tool memcheck" in log.read_text()


def test_a_run_cut_off_by_its_limit_is_incomplete(sanitize, tmp_path):
    slow = tmp_path / "compute-sanitizer"
    slow.write_text("#!/bin/sh\necho started\nsleep 5\n")
    slow.chmod(0o755)
    entry = sanitize.run_one(str(slow), "racecheck", "slow", ["true"],
                             str(tmp_path / "log"), 0.5)
    assert entry["timed_out"] and entry["errors"] is None
    lines = sanitize.markdown({"runs": [entry], "tools": {}})
    assert "TIMED OUT" in "\n".join(lines)


def test_the_plan_covers_memcheck_racecheck_and_synccheck(sanitize):
    runs = sanitize.plan("no-such-build-dir", sys.executable)
    tools = {tool for tool, *_ in runs}
    assert tools == {"memcheck", "racecheck", "synccheck"}
    python_run = next(command for tool, name, command, _ in runs if name == "python tests")
    for node in ("test_capture_gpu.py::test_capture_failure_names_the_operation_line_and_fix",
                 "test_auto_gpu.py::test_eviction_under_a_small_budget_keeps_working",
                 "test_capture_gpu.py::test_repointed_inputs_compute_on_the_new_tensor"):
        assert any(arg.endswith(node) for arg in python_run), node
    for arg in python_run:
        if arg.startswith("tests/python/"):
            assert os.path.exists(os.path.join(ROOT, arg.split("::")[0])), arg


def test_without_a_sanitizer_the_json_says_why(sanitize, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sanitize, "find_sanitizer", lambda: None)
    monkeypatch.setattr(sys, "argv", ["gpu_sanitize.py", str(tmp_path)])
    assert sanitize.main() == 1
    result = json.loads((tmp_path / "sanitize.json").read_text())
    assert "compute-sanitizer not found" in result["error"]
    assert "not run" in capsys.readouterr().out


SOAK = {
    "description": "soak",
    "replays_per_api": 100000,
    "growth_limit_mb": 1.0,
    "diff_limit": 1e-4,
    "ok": False,
    "apis": {
        "capture": {"replays": 100000, "us_per_replay": 11.5, "allocated_growth_mb": 0.0,
                    "reserved_growth_mb": 0.0, "max_abs_diff_vs_eager": 0.0, "ok": True},
        "auto": {"replays": 100000, "us_per_replay": 20.1, "allocated_growth_mb": 0.5,
                 "reserved_growth_mb": 2.0, "max_abs_diff_vs_eager": 1e-6, "ok": False,
                 "evictions": 12, "graphs_max": 11, "within_budget": True},
        "train_step": {"error": "Traceback...\nRuntimeError: boom", "ok": False},
    },
}


def test_bench_markdown_has_a_soak_table(bench_run):
    text = bench_run.markdown({"workloads": {"soak": SOAK}})
    assert "### soak (100000 replays per API: FAILED checks)" in text
    assert "| capture | 100000 | 11.50 | 0.000 | 0.000 | 0.00e+00 | yes |" in text
    assert "evictions 12" in text and "| NO |" in text
    assert "FAILED: RuntimeError: boom" in text


def test_soak_is_registered_but_runs_only_when_named(bench_run):
    assert "soak" in bench_run.WORKLOADS and "soak" in bench_run.OPT_IN


def test_summary_shows_soak_and_sanitize(summary, tmp_path, capsys):
    (tmp_path / "soak.json").write_text(json.dumps({"workloads": {"soak": SOAK}}))
    (tmp_path / "sanitize.json").write_text(json.dumps({
        "runs": [],
        "tools": {"memcheck": {"tool": "memcheck", "tests": ["python tests", "C++ test_capture"],
                               "errors": 0, "complete": True},
                  "racecheck": {"tool": "racecheck", "tests": ["python tests (small)"],
                                "errors": 0, "complete": False}}}))
    summary.main(str(tmp_path))
    out = capsys.readouterr().out
    assert "| memcheck | python tests; C++ test_capture | 0 |" in out
    assert "0 (INCOMPLETE)" in out
    assert "soak: 100000 replays per API, CHECKS FAILED" in out
    assert "| capture | 100000 | 11.5 |" in out
    assert "benchmarks: not run" in out


def test_a_gpu_the_sanitizer_cannot_instrument_stops_the_phase_with_the_fix(
        sanitize, tmp_path, monkeypatch, capsys):
    fake = tmp_path / "compute-sanitizer"
    fake.write_text("#!/bin/sh\necho '========= Device not supported'\n"
                    "echo '========= ERROR SUMMARY: 1 error'\nexit 999\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sanitize, "find_sanitizer", lambda: str(fake))
    monkeypatch.setattr(sys, "argv", ["gpu_sanitize.py", str(tmp_path / "out"), "--budget", "60"])
    assert sanitize.main() == 1
    result = json.loads((tmp_path / "out" / "sanitize.json").read_text())
    assert "Firecracker" in result["error"] and result["runs"] == []
    assert result["probe"]["unsupported"]
