"""A/B timing on one GPU: variants (two builds, two configs) timed call for call in turn.

A GPU at its power cap drifts in clock under load, and a variant timed in a block of its own was decided by its
place in the round (benchmarks/DECISIONS.md, "Measurement method"). So ``in_turn`` takes the variants' calls one of
each in turn, the first of them rotated from pass to pass, with CUDA events around every call, and returns each
variant's median per round:

    eager = in_turn(calls, rounds=7, passes=passes_for(calls, 150, flush=True), flush=True)
    graphs = {name: capture(fn)[0] for name, fn in calls.items()}
    replays = {name: g.replay for name, g in graphs.items()}
    replayed = in_turn(replays, rounds=7, passes=passes_for(replays, 150, per_call=REPS), per_call=REPS)

Eager calls after an L2 flush are what ``flashtriton bench`` times (host time included); CUDA-graph replays of
``REPS`` calls leave the host out. ``paper_case`` makes inputs of the bench's sweep; ``save`` writes a script's rows.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable

import torch

DEVICE = "cuda"
TOKENS, HIDDEN = 16384, 2048  # the bench's sweep (the FlashAttention-2 paper's): batch * seqlen, heads * head_dim
REPS = 10  # calls captured per graph, so that a short call's replay is not all launch
FLUSH_BYTES = 256 * 2**20  # written before each eager call: more than any Hopper L2 holds
MAX_PASSES = 2000  # events pending per round stay bounded for calls of a few microseconds


def paper_case(head_dim: int, seqlen: int, count: int = 3, requires_grad: bool = True) -> list[torch.Tensor]:
    """count bf16 (B, N, H, D) tensors of the bench's sweep (B * N = 16k tokens, H * D = 2048), seeded, on the GPU."""
    torch.manual_seed(0)
    shape = (max(1, TOKENS // seqlen), seqlen, HIDDEN // head_dim, head_dim)
    return [torch.randn(shape, device=DEVICE, dtype=torch.bfloat16, requires_grad=requires_grad) for _ in range(count)]


def capture(fn: Callable[[], object], reps: int = REPS) -> tuple[torch.cuda.CUDAGraph, object]:
    """(a graph of ``reps`` calls of fn after two warm-up calls, the last call's result, which each replay rewrites).
    The warm-up calls compile and record whatever a capture does not allow."""
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


def in_turn(
    runs: dict[str, Callable[[], object]], rounds: int, passes: int, per_call: int = 1, flush: bool = False
) -> dict[str, list[float]]:
    """Each name's median ms per call in each of ``rounds`` rounds. A round is ``passes`` passes; a pass runs every
    name once, in turn, the first name rotated from pass to pass; CUDA events around each run (which makes
    ``per_call`` calls); with ``flush``, L2 is overwritten before each run. One synchronize per round."""
    names = list(runs)
    buffer = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=DEVICE) if flush else None
    medians: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        pending: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {name: [] for name in names}
        for p in range(passes):
            shift = (r + p) % len(names)
            for name in names[shift:] + names[:shift]:
                if buffer is not None:
                    buffer.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                runs[name]()
                end.record()
                pending[name].append((start, end))
        torch.cuda.synchronize()
        for name, events in pending.items():
            medians[name].append(statistics.median(s.elapsed_time(e) for s, e in events) / per_call)
    return medians


def passes_for(
    runs: dict[str, Callable[[], object]], round_ms: float, per_call: int = 1, flush: bool = False, least: int = 5
) -> int:
    """Passes per round that give each name about ``round_ms`` of its own runs (at least ``least``), from one timed
    pass after one untimed."""
    in_turn(runs, rounds=1, passes=1, per_call=per_call, flush=flush)
    one = in_turn(runs, rounds=1, passes=1, per_call=per_call, flush=flush)
    longest = max(times[0] * per_call for times in one.values())
    return max(least, min(MAX_PASSES, round(round_ms / max(longest, 1e-3))))


def save(path: str, rows: list[dict], **header) -> None:
    """The rows so far as JSON under the GPU's name and header's fields (scripts save after every case)."""
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), **header, "rows": rows}, f, indent=1)
