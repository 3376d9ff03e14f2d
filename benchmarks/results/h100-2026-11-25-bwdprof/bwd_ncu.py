"""One D=128 causal 16k fwd+bwd of ours and of SDPA-cuDNN between cudaProfilerStart/Stop (for ncu)."""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtriton import flash_attn_func

N, H, D = 16384, 16, 128
q, k, v = (torch.randn(1, N, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn(1, N, H, D, device="cuda", dtype=torch.bfloat16)
qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
gt = g.transpose(1, 2)


def ours():
    flash_attn_func(q, k, v, causal=True).backward(g)


def cudnn():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).backward(gt)


for _ in range(3):
    ours()
    cudnn()
torch.cuda.synchronize()
torch.cuda.profiler.start()
ours()
cudnn()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
print("done")
