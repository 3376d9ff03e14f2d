"""Kernel A/Bs by CUDA-graph replay, for the scripts under benchmarks/results (NOTES.md's measurements).

Each variant's call is captured as one graph of ``reps`` calls, so that host time never shows; the graphs are
replayed in turn, the order rotated every round so that none always runs first, with CUDA events around each
replay and a synchronize only every few rounds.

    graphs = {name: capture(fn) for name, fn in variants.items()}
    times = rotated({name: g for name, (g, _) in graphs.items()})
    print({name: quartiles(t) for name, t in times.items()})
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

REPS = 10


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
