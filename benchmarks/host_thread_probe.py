"""Where autograd's device thread puts host time into an eager tiny fwd+bwd (B1 N128 H1 D64 bf16): per step, wall
clock over 3000 steps (one synchronize), the step's distribution, the time inside torch.autograd.grad and inside
ops.backward; ours, an autograd.Function that does nothing, and cuDNN SDPA; the backward on the calling thread
(torch.autograd.set_multithreading_enabled(False)) and on the device thread (PyTorch's default for CUDA), two rounds;
then ours with a 1 us GIL switch interval, and with the garbage collector off.

    PYTHONPATH=src python benchmarks/host_thread_probe.py        # on a GPU machine
"""

import contextlib
import gc
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtriton
from flashtriton import ops

B, N, H, D = 1, 128, 1, 64
q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dout = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
lq, lk, lv = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
ldout = dout.transpose(1, 2).contiguous()
marks = []  # (entered, left) of each backward, ns
_backward = ops.backward


def timed_backward(*args):
    entered = time.perf_counter_ns()
    grads = _backward(*args)
    marks.append((entered, time.perf_counter_ns()))
    return grads


class Empty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, g):
        entered = time.perf_counter_ns()
        grads = torch.empty_like(g), torch.empty_like(g), torch.empty_like(g)
        marks.append((entered, time.perf_counter_ns()))
        return grads


def ours():
    out = flashtriton.flash_attn_func(q, k, v)
    start = time.perf_counter_ns()
    torch.autograd.grad(out, (q, k, v), dout)
    return start


def empty():
    out = Empty.apply(q, k, v)
    start = time.perf_counter_ns()
    torch.autograd.grad(out, (q, k, v), dout)
    return start


def cudnn():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(lq, lk, lv)
    start = time.perf_counter_ns()
    torch.autograd.grad(out, (lq, lk, lv), ldout)
    return start


def quantile(xs, f):
    return sorted(xs)[int(f * (len(xs) - 1))]


def run(name, step, threaded, n=3000):
    caller = contextlib.nullcontext() if threaded else torch.autograd.set_multithreading_enabled(False)
    with caller:
        for _ in range(100):
            step()
        torch.cuda.synchronize()
        marks.clear()
        steps, grads = [], []
        start = time.perf_counter_ns()
        for _ in range(n):
            a = time.perf_counter_ns()
            grad_start = step()
            b = time.perf_counter_ns()
            steps.append((b - a) / 1e3)
            grads.append((b - grad_start) / 1e3)
        torch.cuda.synchronize()
        total = (time.perf_counter_ns() - start) / 1e3 / n
    line = (
        f"{name:28s} {'device' if threaded else 'caller'}: wall/call {total:6.1f}  step mean "
        f"{statistics.mean(steps):6.1f} med {statistics.median(steps):6.1f} p90 {quantile(steps, 0.9):6.1f} p99 "
        f"{quantile(steps, 0.99):7.1f} max {max(steps):7.1f}; grad() med {statistics.median(grads):6.1f} mean "
        f"{statistics.mean(grads):6.1f}"
    )
    if marks:
        inside = [(m[1] - m[0]) / 1e3 for m in marks]
        line += f"; inside med {statistics.median(inside):6.1f} mean {statistics.mean(inside):6.1f}"
    print(line, flush=True)


def main() -> None:
    ops.backward = timed_backward
    for _ in range(2):
        for threaded in (False, True):
            run("ours", ours, threaded)
            run("empty", empty, threaded)
            run("cudnn", cudnn, threaded)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    run("ours switchinterval 1us", ours, True)
    sys.setswitchinterval(interval)
    gc.disable()
    run("ours gc off", ours, True)
    gc.enable()


if __name__ == "__main__":
    main()
