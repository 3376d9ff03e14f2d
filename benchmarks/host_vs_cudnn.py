"""Host microseconds per eager call, flashtriton against cuDNN SDPA (given contiguous (B, H, N, D)) in turn, 5 rounds:
wall clock over many calls with one synchronize, at B1 N128 H1 D64 (the GPU idles: host time), B32 N512 H16 D128 and
B32 N512 H32 D64 (the users suite's short N), dense and causal, in four modes:

  fwd            an inference call (inputs need no gradient)
  fwd-grad       the forward of a training step (inputs need gradients: an autograd node, the LSE written)
  fwd+bwd        forward and fresh gradients by torch.autograd.grad, the backward on autograd's device thread
                 (PyTorch's default for CUDA tensors)
  fwd+bwd-caller the same with torch.autograd.set_multithreading_enabled(False): the backward on the calling thread

and, for fwd+bwd at the short-N shapes, the GPU time of a CUDA-graph replay (the kernels alone, no host).

    PYTHONPATH=src python benchmarks/host_vs_cudnn.py      # on a GPU machine; writes $OUT/host_vs_cudnn.json
"""

import contextlib
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtriton

SHAPES = (((1, 128, 1, 64), 2000), ((32, 512, 16, 128), 300), ((32, 512, 32, 64), 300))  # (B, N, H, D), calls
MODES = ("fwd", "fwd-grad", "fwd+bwd", "fwd+bwd-caller")
ROUNDS, WARMUP, REPLAYS = 5, 30, 50


def make(b, n, h, d, causal, which, mode):
    """One eager call of ``which`` (ours or cudnn) in ``mode``."""
    grad = mode != "fwd"
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad) for _ in range(3))
    dout = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
    if which == "ours":
        leaves = (q, k, v)

        def forward():
            return flashtriton.flash_attn_func(q, k, v, causal=causal)

    else:
        leaves = tuple(x.detach().transpose(1, 2).contiguous().requires_grad_(grad) for x in (q, k, v))
        dout = dout.transpose(1, 2).contiguous()

        def forward():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(*leaves, is_causal=causal)

    if mode in ("fwd", "fwd-grad"):
        return forward
    return lambda: torch.autograd.grad(forward(), leaves, dout)


def wall(call, calls, mode):
    """Microseconds per call over ``calls`` calls and one synchronize, after a warm-up."""
    caller = torch.autograd.set_multithreading_enabled(False) if mode == "fwd+bwd-caller" else contextlib.nullcontext()
    with caller:
        for _ in range(WARMUP):
            call()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def replay_us(call):
    """GPU microseconds per replay of a CUDA graph of one call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / REPLAYS * 1e3


def main() -> None:
    rows = []
    for shape, calls in SHAPES:
        for causal in (False, True):
            for mode in MODES:
                fns = {w: make(*shape, causal, w, mode) for w in ("ours", "cudnn")}
                times = {w: [] for w in fns}
                for r in range(ROUNDS):  # in turn, the first alternating
                    for w, f in fns.items() if r % 2 == 0 else list(fns.items())[::-1]:
                        times[w].append(wall(f, calls, mode))
                ours, cudnn = (statistics.median(times[w]) for w in ("ours", "cudnn"))
                row = dict(shape=shape, causal=causal, mode=mode, ours_us=round(ours, 1), cudnn_us=round(cudnn, 1),
                           cudnn_over_ours=round(cudnn / ours, 3))  # fmt: skip
                if mode == "fwd+bwd" and shape[0] > 1:
                    row.update({f"{w}_replay_us": round(replay_us(f), 1) for w, f in fns.items()})
                rows.append(row)
                print(row, flush=True)
    with open(os.environ.get("OUT", ".") + "/host_vs_cudnn.json", "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
