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


def test_tma_view_only_for_layouts_the_copy_engine_can_read():
    x = torch.zeros(2, 10, 3, 16, dtype=torch.bfloat16)
    desc = triton_backend._tma_view(x, 8, 16, enabled=True)
    assert desc.shape == [20, 48] and desc.strides == [48, 1] and desc.block_shape == [8, 16]
    # a packed qkv slice: rows 3x wider than the heads, base 96 bytes in (16-byte aligned)
    qkv = torch.zeros(2, 10, 3, 3, 16, dtype=torch.bfloat16)
    assert triton_backend._tma_view(qkv[:, :, 1], 8, 16, enabled=True).strides == [144, 1]
    assert triton_backend._tma_view(x, 8, 16, enabled=False) is None
    assert triton_backend._tma_view(x[..., :12], 8, 16, enabled=True) is None  # head dim padded to 16
    assert triton_backend._tma_view(x[:, :5], 8, 16, enabled=True) is None  # batches not back to back
    odd = torch.zeros(2 * 10 * 3 * 16 + 1, dtype=torch.bfloat16)[1:].view(2, 10, 3, 16)
    assert triton_backend._tma_view(odd, 8, 16, enabled=True) is None  # base not 16-byte aligned
    spread = torch.zeros(2, 10, 3, 32, dtype=torch.bfloat16)[..., :16]
    assert triton_backend._tma_view(spread, 8, 16, enabled=True) is None  # heads not packed
    narrow = torch.zeros(2, 10, 3 * 16 + 4, dtype=torch.bfloat16)[..., :48].view(2, 10, 3, 16)
    assert triton_backend._tma_view(narrow, 8, 16, enabled=True) is None  # row stride 104 bytes
    assert triton_backend._tma_view(x[:, :1], 8, 16, enabled=True) is None  # N=1 batches 480 apart
    assert triton_backend._tma_view(x[:1, :1], 8, 16, enabled=True).shape == [1, 48]
