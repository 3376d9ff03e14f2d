"""Host microseconds per eager call, flashtriton against cuDNN SDPA (given contiguous (B, H, N, D)) in turn, 5 rounds:
wall clock over many calls with one synchronize, forward (an inference call) and fwd+bwd (fresh gradients by
torch.autograd.grad; autograd's device thread on, the default), at B1 N128 H1 D64 (the GPU idles: host time) and
B32 N512 H16 D128, dense and causal.

    PYTHONPATH=src python benchmarks/host_vs_cudnn.py      # on a GPU machine; writes $OUT/host_vs_cudnn.json
"""

import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtriton

SHAPES = (((1, 128, 1, 64), 2000), ((32, 512, 16, 128), 300))  # (B, N, H, D), calls per timing
ROUNDS, WARMUP = 5, 30


def make(b, n, h, d, causal, which, grad):
    """One eager call of ``which`` (ours or cudnn): a forward, or with ``grad`` a forward and its gradients."""
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad) for _ in range(3))
    dout = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
    if which == "ours":
        if not grad:
            return lambda: flashtriton.flash_attn_func(q, k, v, causal=causal)
        return lambda: torch.autograd.grad(flashtriton.flash_attn_func(q, k, v, causal=causal), (q, k, v), dout)
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(grad) for x in (q, k, v))
    dt = dout.transpose(1, 2).contiguous()

    def call():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            return torch.autograd.grad(out, (qt, kt, vt), dt) if grad else out

    return call


def wall(call, calls):
    """Microseconds per call over ``calls`` calls and one synchronize, after a warm-up."""
    for _ in range(WARMUP):
        call()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def main() -> None:
    rows = []
    for shape, calls in SHAPES:
        for causal in (False, True):
            for grad in (False, True):
                fns = {w: make(*shape, causal, w, grad) for w in ("ours", "cudnn")}
                times = {w: [] for w in fns}
                for r in range(ROUNDS):  # in turn, the first alternating
                    for w, f in fns.items() if r % 2 == 0 else list(fns.items())[::-1]:
                        times[w].append(wall(f, calls))
                ours, cudnn = (statistics.median(times[w]) for w in ("ours", "cudnn"))
                row = dict(shape=shape, causal=causal, mode="fwd+bwd" if grad else "fwd", ours_us=round(ours, 1),
                           cudnn_us=round(cudnn, 1), cudnn_over_ours=round(cudnn / ours, 3))  # fmt: skip
                rows.append(row)
                print(row, flush=True)
    with open(os.environ.get("OUT", ".") + "/host_vs_cudnn.json", "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
