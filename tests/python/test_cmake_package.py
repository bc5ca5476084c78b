"""find_package(graphed) from a LibTorch program: the installed CMake package
configures, links and runs (it captures on a GPU, and says it cannot without one)."""

import os
import shutil
import subprocess

import pytest
import torch.utils

import graphed

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "cpp")


@pytest.fixture(scope="module")
def example_binary(tmp_path_factory):
    if shutil.which("cmake") is None:
        pytest.skip("needs cmake on the PATH")
    build = tmp_path_factory.mktemp("example")
    prefix = f"{graphed.cmake_prefix_path};{torch.utils.cmake_prefix_path}"
    configure = subprocess.run(
        ["cmake", "-S", EXAMPLE, "-B", str(build), f"-DCMAKE_PREFIX_PATH={prefix}",
         "-DCMAKE_BUILD_TYPE=Release"], capture_output=True, text=True, timeout=600)
    assert configure.returncode == 0, configure.stdout + configure.stderr
    compiled = subprocess.run(["cmake", "--build", str(build), "-j", "2"], capture_output=True,
                              text=True, timeout=900)
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    return os.path.join(str(build), "capture_mlp")


def test_example_runs(example_binary):
    result = subprocess.run([example_binary], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    if torch.cuda.is_available():
        assert "outputs match" in result.stdout, result.stdout
    else:
        assert "needs an NVIDIA GPU" in result.stdout, result.stdout
