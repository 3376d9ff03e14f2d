"""Linear memory: no seqlen x seqlen buffer anywhere."""

import os
import subprocess
import sys

import pytest
import torch

import flashtriton

CPU_SCRIPT = """
import resource, torch
from flashtriton import flash_attn_func
n = {n}
q, k, v = (torch.randn(1, n, 1, 32, requires_grad=True) for _ in range(3))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = flash_attn_func(q, k, v, causal=True)
out.backward(torch.ones_like(out))
assert torch.isfinite(q.grad).all()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_cpu_path_16k_tokens_without_n_squared_buffer():
    """A 16k-token causal forward+backward on CPU grows by less than 256 MiB; an N x N matrix alone would be 1 GiB in
    fp32, 512 MiB in 16 bits (it grows by about 52 MiB)."""
    n = 16384
    src = os.path.dirname(os.path.dirname(flashtriton.__file__))
    env = {**os.environ, "FLASHTRITON_BACKEND": "torch", "PYTHONPATH": src}
    result = subprocess.run(
        [sys.executable, "-c", CPU_SCRIPT.format(n=n)], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr
    grown = int(result.stdout.split()[-1])
    assert grown < 256 * 2**20, f"peak RSS grew by {grown / 2**20:.0f} MiB"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("n", [16384, 131072], ids=["16k", "128k"])
def test_cuda_peak_memory_is_outputs_only(n):
    """Causal fwd+bwd, B=1, H=16, D=128, bf16: peak extra memory <= 1.25 x (out + lse + dq + dk + dv, and the
    fused backward's dQ accumulator: dq in fp32)."""
    q, k, v = (torch.randn(1, n, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = flashtriton.flash_attn_func(q, k, v, causal=True)
    out.backward(dout)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    needed = 4 * q.numel() * q.element_size() + 16 * n * 4 + q.numel() * 4  # out, dq, dk, dv, fp32 lse and dQ
    assert extra <= 1.25 * needed, f"{extra / 2**20:.0f} MiB extra for {needed / 2**20:.0f} MiB of outputs"
    assert torch.isfinite(q.grad).all() and q.grad.abs().amax() > 0
