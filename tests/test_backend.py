"""FLASHTRITON_BACKEND selects the path; impossible selections fail with the fix."""

import pytest
import torch

from flashtriton import ops, torch_backend, triton_backend


def test_auto_picks_torch_path_on_cpu(monkeypatch):
    monkeypatch.delenv("FLASHTRITON_BACKEND", raising=False)
    assert ops.select_backend(torch.device("cpu"), torch.float16) is torch_backend


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_auto_picks_triton_on_cuda(monkeypatch):
    monkeypatch.delenv("FLASHTRITON_BACKEND", raising=False)
    assert ops.select_backend(torch.device("cuda"), torch.bfloat16) is triton_backend
    # fp32 goes to the PyTorch path: the kernels' approximate exp2 would cost fp32 accuracy
    assert ops.select_backend(torch.device("cuda"), torch.float32) is torch_backend


def test_unknown_backend(monkeypatch):
    monkeypatch.setenv("FLASHTRITON_BACKEND", "cuda")
    with pytest.raises(ValueError, match="one of auto, triton, torch"):
        ops.select_backend(torch.device("cpu"), torch.float32)


def test_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("FLASHTRITON_BACKEND", "triton")
    monkeypatch.setattr(triton_backend, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        ops.select_backend(torch.device("cpu"), torch.float32)
