"""Test tiers: tests marked ``gpu`` need an NVIDIA GPU and are skipped, with the
reason, where there is none."""

import pytest
import torch

_NO_GPU_REASON = "needs an NVIDIA GPU: torch.cuda.is_available() is False on this machine"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=_NO_GPU_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _settle_gpu(request):
    """Each GPU test starts and ends with the device idle, so a failure in one
    test cannot leak asynchronous errors into the next."""
    gpu = "gpu" in request.keywords and torch.cuda.is_available()
    if gpu:
        torch.cuda.synchronize()
    yield
    if gpu:
        torch.cuda.synchronize()


@pytest.fixture
def exact_fp32():
    """TF32 off for matmuls and convolutions while a test runs, so graphed and
    eager results compare at fp32 tolerances. Use with
    ``pytest.mark.usefixtures("exact_fp32")``."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
