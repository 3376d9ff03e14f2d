"""Which program of the persistent Hopper forward runs which query tiles, under a causal bound.

A causal head's query tiles see 1, 2, ..., n_m key tiles: unequal work. Without a table the kernel pairs
a head's p-th longest tile with its p-th shortest, so that every pair ("unit") costs about the same, and program
i of P runs units i, i + P, ... (kernels/hopper/forward.py's _forward_tile). Units rarely divide evenly: 2048 units over
132 SMs leave 68 programs with 16 and 64 with 15, about 3% of idle SM time at the end.

The table takes the heads in batches of about ``batch_tiles`` tiles (whole heads) and hands each batch's tiles
out longest first, each to the program with the least work so far (greedy longest-processing-time). Batches keep
a head's tiles close in time, as the pairs do, so that its keys are read from memory about once and from L2
after: handing out the last three rounds' tiles across all their heads longest first (every head's longest tile,
then every head's second, ...) made the D=128 forward 21-24% slower at N <= 1k, and batches of four rounds 28% at
N = 512 (the L2 misses are inferred, not profiled). Greedy batches are not always the better split:
where the pairs divide evenly among the programs, or each program runs only a few tiles, a batch's long tiles can
land late on an already loaded program. ``makespan`` and ``pairs_makespan`` let the caller keep the better one.

Greedy hands out whole tiles, so its end lies up to a tile's cost past the mean work: 3% at N=512, where a program
runs 8-31 tiles. A local search then trades tiles between the most loaded program and others, within a batch or
the next either side (_balance): forward kernel time 0.3-2.8% lower where it narrows the end (H100).

Table layout (int32): entries [0, P] are offsets, program i's tiles being entries P + 1 + offsets[i] up to
P + 1 + offsets[i + 1]; each entry is ((head * n_m + p) << 1) | r for query tile p of a head counted longest
first, and r = 1 asks the tile's warpgroups to take their row blocks in reverse (the kernel's _block_of):
consecutive tiles of a program alternate, so that where a tile's warpgroups see unequal numbers of keys each
sees about as many over the program's run. The kernel reads the head and tile as bit fields instead, so that no tile
starts with a division (triton_backend._fields re-encodes the entries).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def causal_forward(
    heads: int, costs: Sequence[int], programs: int, batch_tiles: int, balance: bool = True
) -> list[int]:
    """The table for ``heads`` heads of ``len(costs)`` query tiles each, tile p (longest first) costing costs[p],
    over ``programs`` programs: ``programs + 1`` offsets, then the entries (module docstring). ``balance``: then,
    where programs have few tiles each, _balance's trades lower the greedy split's end."""
    n_m = len(costs)
    if heads < 1 or n_m < 1 or programs < 1 or batch_tiles < 1:
        raise ValueError(f"no schedule for {heads} heads of {n_m} tiles over {programs} programs")
    longest_first = sorted(range(n_m), key=lambda p: -costs[p])
    rank = {p: i for i, p in enumerate(longest_first)}
    per_batch = max(batch_tiles // n_m, 1)
    owner: dict[int, int] = {}  # tile (head * n_m + p) -> program
    least = [(0, i) for i in range(programs)]  # (work so far, program): a heap
    for first in range(0, heads, per_batch):
        batch = range(first, min(first + per_batch, heads))
        for p in longest_first:
            for head in batch:
                work, i = heapq.heappop(least)
                owner[head * n_m + p] = i
                heapq.heappush(least, (work + costs[p], i))
    if balance and heads * n_m <= BALANCED_TILES * programs:
        tiles = range(heads * n_m)
        _balance(owner, [costs[t % n_m] for t in tiles], [t // n_m // per_batch for t in tiles], programs)
    lists: list[list[int]] = [[] for _ in range(programs)]
    # each program's tiles batch by batch, a batch's longest first (the greedy's own order, which _balance keeps)
    for t in sorted(owner, key=lambda t: (t // n_m // per_batch, rank[t % n_m], t // n_m)):
        tiles = lists[owner[t]]
        tiles.append((t << 1) | (len(tiles) & 1))
    offsets = [0]
    for tiles in lists:
        offsets.append(offsets[-1] + len(tiles))
    return offsets + [e for tiles in lists for e in tiles]


def _balance(owner: dict[int, int], cost: list[int], batch: list[int], programs: int) -> None:
    """Lowers the most loaded program's work, step by step, while one step can: by handing one of its tiles to the
    least loaded program, or by swapping one for a cheaper tile of another program from the same batch or the next
    one either side (so that a head's tiles still run about together). ``owner`` maps tile -> program and is
    changed in place. Trading two tiles for one as well narrowed the D=256 causal N=512 split's end from 104 to
    103 x 32 keys, and its forward ran 7% slower: more tiles cost more than the count says there."""
    work = [0] * programs
    mine: list[set[int]] = [set() for _ in range(programs)]
    for t, i in owner.items():
        work[i] += cost[t]
        mine[i].add(t)
    by_batch: dict[int, list[int]] = {}
    for t in sorted(owner):
        by_batch.setdefault(batch[t], []).append(t)
    for _ in range(4 * programs):  # a bound on the host time; the bench's shapes settle within about 130 steps
        x = max(range(programs), key=work.__getitem__)
        low = min(range(programs), key=work.__getitem__)
        best, step = work[x], None
        for t in mine[x]:
            end = max(work[x] - cost[t], work[low] + cost[t])
            if end < best:
                best, step = end, (t, low, None)
        for t in mine[x]:
            for b in (batch[t] - 1, batch[t], batch[t] + 1):
                for u in by_batch.get(b, ()):
                    y = owner[u]
                    if cost[u] < cost[t] and y != x:
                        end = max(work[x] - cost[t] + cost[u], work[y] + cost[t] - cost[u])
                        if end < best:
                            best, step = end, (t, y, u)
        if step is None:
            return
        t, y, u = step
        owner[t] = y
        mine[x].remove(t)
        mine[y].add(t)
        work[x] -= cost[t]
        work[y] += cost[t]
        if u is not None:
            owner[u] = x
            mine[y].remove(u)
            mine[x].add(u)
            work[y] -= cost[u]
            work[x] += cost[u]


# _balance runs where programs have at most this many tiles each: up to about 0.3 s of Python, once per shape (under
# 0.1 s at the bench's 8-31). With more, the greedy's end lies within 1-2% of the mean, and a search takes longer.
BALANCED_TILES = 64


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
