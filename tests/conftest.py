"""Test targets and fixtures.

Every numerical test runs once per *target* available on this machine:
  cpu-torch     the PyTorch path on CPU tensors (always)
  cpu-interp    the Triton kernels in Triton's interpreter on CPU tensors, at tiny sizes
                (when there is no GPU, TRITON_INTERPRET=1 is set here before triton is imported)
  cuda-triton   the Triton kernels on the GPU, at realistic sizes
Each target has its own shape list (the test modules' dicts keyed by Target.size), so CI stays fast and the GPU sees
real sizes.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test` runs -n 2) each worker takes its share of the cores, not torch's default of all.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _WORKERS))


_KEPT_RESERVE = 4 * 2**30  # bytes of GPU memory (live and cached) past which a worker hands its cache back


@pytest.fixture(autouse=True)
def _poison_and_seed():
    """Uninitialised memory (torch.empty) is filled with NaN, so an output element a kernel
    forgot to write fails the comparison instead of passing as 0. Fresh seed per test; after it, a worker that holds
    more than _KEPT_RESERVE of GPU memory hands its allocator's cache back."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    torch.manual_seed(0)
    yield
    torch.use_deterministic_algorithms(False)
    # GPU runs share one card among pytest-xdist's workers: what one worker's allocator keeps of a large test's
    # memory, the others can run out of
    if torch.cuda.is_available() and torch.cuda.memory_reserved() > _KEPT_RESERVE:
        torch.cuda.empty_cache()


@pytest.fixture
def backend(request, monkeypatch):
    """Select the target's backend through the documented environment variable."""
    target = request.param
    monkeypatch.setenv("FLASHTRITON_BACKEND", target.backend)
    return target
