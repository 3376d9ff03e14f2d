"""Kernel A/Bs by CUDA-graph replay, for the scripts under benchmarks/results (NOTES.md's measurements).

Each variant's call is captured as one graph of ``reps`` calls, so that host time never shows; the graphs are
replayed in turn, the order rotated every round so that none always runs first, with CUDA events around each
replay and a synchronize only every few rounds.

    graphs = {name: capture(fn) for name, fn in variants.items()}
    times = rotated({name: g for name, (g, _) in graphs.items()})
    print({name: quartiles(t) for name, t in times.items()})

paper_case and cudnn make a case of the bench's sweep and SDPA's cuDNN call on it; save writes a script's rows.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtriton.params import NO_BOUND, AttentionParams

REPS = 10


def paper_case(head_dim: int, seqlen: int, causal: bool, count: int = 3) -> tuple[list[torch.Tensor], AttentionParams]:
    """count bf16 (B, N, H, D) tensors of the bench's sweep (B * N = 16k tokens, H * D = 2048), seeded, on the GPU,
    and the params of a plain or causal call on them."""
    torch.manual_seed(0)
    shape = (16384 // seqlen, seqlen, 2048 // head_dim, head_dim)
    tensors = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
    return tensors, AttentionParams(head_dim**-0.5, window_right=0 if causal else NO_BOUND)


def cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Callable[[], torch.Tensor]:
    """SDPA pinned to its cuDNN backend on (B, N, H, D) inputs, as a call (its output is (B, H, N, D))."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def call() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    return call


def save(path: str, rows: list[dict], **header) -> None:
    """The rows so far as JSON under the GPU's name and header's fields (scripts save after every case)."""
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), **header, "rows": rows}, f, indent=1)


def capture(fn: Callable[[], torch.Tensor], reps: int = REPS) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """(a graph of ``reps`` calls of fn after two warm-up calls, the last call's result, which each replay rewrites)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            result = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, result


def rotated(graphs: dict[str, torch.cuda.CUDAGraph], rounds: int = 40, reps: int = REPS) -> dict[str, list[float]]:
    """ms per call of each graph's calls (captured ``reps`` to a graph), one replay per round each."""
    names = list(graphs)
    times: dict[str, list[float]] = {name: [] for name in names}
    pending = []
    for i in range(rounds):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[name].replay()
            end.record()
            pending.append((name, start, end))
        if i % 8 == 7 or i == rounds - 1:
            torch.cuda.synchronize()
            for name, start, end in pending:
                times[name].append(start.elapsed_time(end) / reps)
            pending = []
    return times


def quartiles(times: list[float]) -> list[float]:
    """[first quartile, median, third quartile]."""
    ordered = sorted(times)
    return [ordered[len(ordered) // 4], statistics.median(ordered), ordered[3 * len(ordered) // 4]]
