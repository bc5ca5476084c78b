"""The graphed command line: exit codes and messages."""

import subprocess
import sys

import pytest
import torch


def run_graphed(*args):
    return subprocess.run([sys.executable, "-m", "graphed", *args], capture_output=True,
                          text=True, timeout=600)


def test_help_lists_the_commands():
    result = run_graphed("--help")
    assert result.returncode == 0
    assert "demo" in result.stdout


def test_unknown_command_exits_2():
    result = run_graphed("frobnicate")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU; see test_demo_on_gpu")
def test_demo_without_gpu_explains_and_exits_0():
    result = run_graphed("demo")
    assert result.returncode == 0, result.stderr
    assert "needs an NVIDIA GPU" in result.stdout
    assert "mlp_inference: 16 blocks" in result.stdout


@pytest.mark.gpu
@pytest.mark.exclusive
def test_demo_on_gpu():
    result = run_graphed("demo")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "outputs        match" in result.stdout
    assert "speedup" in result.stdout
    assert "kernel floor" in result.stdout
