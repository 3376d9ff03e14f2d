"""Test targets and fixtures.

Every numerical test runs once per *target* available on this machine:
  cpu-torch     the PyTorch path on CPU tensors (always)
  cpu-interp    the Triton kernels in Triton's interpreter on CPU tensors, at tiny sizes
                (when there is no GPU, TRITON_INTERPRET=1 is set here before triton is imported)
  cuda-triton   the Triton kernels on the GPU, at realistic sizes
Each target has its own shape list (helpers.SHAPES), so CI stays fast and the GPU sees real sizes.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


@pytest.fixture(autouse=True)
def _poison_and_seed():
    """Uninitialised memory (torch.empty) is filled with NaN, so an output element a kernel
    forgot to write fails the comparison instead of passing as 0. Fresh seed per test."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    torch.manual_seed(0)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture
def backend(request, monkeypatch):
    """Select the target's backend through the documented environment variable."""
    target = request.param
    monkeypatch.setenv("FLASHTRITON_BACKEND", target.backend)
    return target
