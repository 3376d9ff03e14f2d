"""Which program of the persistent Hopper forward runs which query tiles, under a causal bound.

A causal head's query tiles see 1, 2, ..., n_m key tiles: unequal work. Without a table the kernel pairs
a head's p-th longest tile with its p-th shortest, so that every pair ("unit") costs about the same, and program
i of P runs units i, i + P, ... (kernels/hopper.py's _forward_tile). Units rarely divide evenly: 2048 units over
132 SMs leave 68 programs with 16 and 64 with 15, about 3% of idle SM time at the end (benchmarks/NOTES.md 38).

The table takes the heads in batches of about ``batch_tiles`` tiles (whole heads) and hands each batch's tiles
out longest first, each to the program with the least work so far (greedy longest-processing-time). Batches keep
a head's tiles close in time, as the pairs do, so that its keys are read from memory about once and from L2
after: handing out the last three rounds' tiles across all their heads longest first (every head's longest tile,
then every head's second, ...) made the D=128 forward 21-24% slower at N <= 1k, and batches of four rounds 28% at
N = 512 (NOTES 54; the L2 misses are inferred, not profiled). Greedy batches are not always the better split:
where the pairs divide evenly among the programs, or each program runs only a few tiles, a batch's long tiles can
land late on an already loaded program. ``makespan`` and ``pairs_makespan`` let the caller keep the better one.

Table layout (int32): entries [0, P] are offsets, program i's tiles being entries P + 1 + offsets[i] up to
P + 1 + offsets[i + 1]; each entry is ((head * n_m + p) << 1) | r for query tile p of a head counted longest
first, and r = 1 asks the tile's warpgroups to take their row blocks in reverse (the kernel's _block_of):
consecutive tiles of a program alternate, so that where a tile's warpgroups see unequal numbers of keys each
sees about as many over the program's run. The kernel reads the head and tile as bit fields instead, so that no tile
starts with a division (triton_backend._fields re-encodes the entries; benchmarks/NOTES.md 57).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def causal_forward(heads: int, costs: Sequence[int], programs: int, batch_tiles: int) -> list[int]:
    """The table for ``heads`` heads of ``len(costs)`` query tiles each, tile p (longest first) costing costs[p],
    over ``programs`` programs: ``programs + 1`` offsets, then the entries (module docstring)."""
    n_m = len(costs)
    if heads < 1 or n_m < 1 or programs < 1 or batch_tiles < 1:
        raise ValueError(f"no schedule for {heads} heads of {n_m} tiles over {programs} programs")
    longest_first = sorted(range(n_m), key=lambda p: -costs[p])
    per_batch = max(batch_tiles // n_m, 1)
    lists: list[list[int]] = [[] for _ in range(programs)]
    least = [(0, i) for i in range(programs)]  # (work so far, program): a heap
    for first in range(0, heads, per_batch):
        batch = range(first, min(first + per_batch, heads))
        for p in longest_first:
            for head in batch:
                work, i = heapq.heappop(least)
                lists[i].append(((head * n_m + p) << 1) | (len(lists[i]) & 1))
                heapq.heappush(least, (work + costs[p], i))
    offsets = [0]
    for tiles in lists:
        offsets.append(offsets[-1] + len(tiles))
    return offsets + [e for tiles in lists for e in tiles]


def makespan(table: list[int], costs: Sequence[int], programs: int) -> int:
    """The most work any program of ``table`` (causal_forward's) runs, in ``costs``' units."""
    entries, n_m = table[programs + 1 :], len(costs)
    work = [sum(costs[(e >> 1) % n_m] for e in entries[table[i] : table[i + 1]]) for i in range(programs)]
    return max(work)


def pairs_makespan(heads: int, costs: Sequence[int], programs: int) -> int:
    """The same for the kernel's own order: units of a head's p-th longest and p-th shortest tile, round-robin."""
    n_m = len(costs)
    per_head = (n_m + 1) // 2
    unit = [costs[p] + (costs[n_m - 1 - p] if n_m - 1 - p != p else 0) for p in range(per_head)]
    work = [0] * programs
    for u in range(heads * per_head):
        work[u % programs] += unit[u % per_head]
    return max(work)
