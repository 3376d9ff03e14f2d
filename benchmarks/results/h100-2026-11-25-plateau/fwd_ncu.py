"""One profiled causal N=512 forward each, ours then cuDNN's, D=128 then D=256 (B=32, H*D=2048, bf16), after warm-up
calls, between torch.cuda.profiler.start() and stop()."""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtriton import flash_attn_func

calls = []
for d in (128, 256):
    q, k, v = (torch.randn(32, 512, 2048 // d, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def cudnn(qt=qt, kt=kt, vt=vt):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    calls += [lambda q=q, k=k, v=v: flash_attn_func(q, k, v, causal=True), cudnn]
for f in calls:
    for _ in range(3):
        f()
torch.cuda.synchronize()
torch.cuda.profiler.start()
for f in calls:
    f()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
