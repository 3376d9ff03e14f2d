"""The ring under a causal sliding window: ranks trade only the K/V rows the band reaches, not whole shards.

A window's steps (steps.window_steps) meet few of another rank's key rows: with a window shorter than a chunk, the
last ``window`` rows of the chunk just before each of a rank's chunks, held by the ranks next to it. Passing whole
shards around the ring moves world - 1 shards per rank and waits for steps that compute nothing. Here every rank
knows every rank's plan, so for each ring distance s at which some rank needs rows of the rank s before it, rank r
sends rank r + s just the rows that rank's pieces read (one message of their intervals) and receives from r - s the
rows its own pieces read, the next distance's transfer travelling while this one computes. Its pieces then run on
the received rows, their key slices moved onto them.

The backward trades the same rows again, and sends each piece's dK/dV share (fp32) back to the rank that holds its
keys, which adds the shares in the ring's order (its own, then rank + 1's, ...) and the pieces' order: the same
additions as the ring's travelling accumulator, so the results are the ring's bit for bit (tests compare them with
steps.simulate_*, which computes as the ring does).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from . import steps as S
from .comm import Ring

Intervals = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Halo:
    """One rank's trades: ``wants[r][src]`` the rows of src's shard that rank r's pieces read (merged intervals, by
    rank r's plan); ``distances`` the ring distances at which some rank wants any."""

    world: int
    rank: int
    plans: tuple  # every rank's Steps by source rank
    wants: tuple[tuple[Intervals, ...], ...]
    distances: tuple[int, ...]

    @classmethod
    def of(cls, plans: list[tuple], rank: int) -> Halo:
        world = len(plans)
        wants = tuple(
            tuple(() if src == r else _union(plans[r][src]) for src in range(world)) for r in range(world)
        )  # fmt: skip
        distances = tuple(s for s in range(1, world) if any(wants[r][(r - s) % world] for r in range(world)))
        return cls(world, rank, tuple(plans), wants, distances)

    def pieces_on_received(self, src: int) -> tuple[S.Step, ...]:
        """This rank's pieces against src's shard, their key slices moved onto the received rows."""
        starts, at = {}, 0
        for a, b in self.wants[self.rank][src]:
            starts[a, b], at = at, at + b - a
        moved = []
        for step in self.plans[self.rank][src]:
            (a, b), offset = next(((a, b), o) for (a, b), o in starts.items() if a <= step.keys.start < b)
            keys = slice(offset + step.keys.start - a, offset + step.keys.stop - a)
            moved.append(replace(step, keys=keys))
        return tuple(moved)


def _union(pieces: tuple[S.Step, ...]) -> Intervals:
    """The key rows the pieces read, as sorted disjoint intervals."""
    merged: list[list[int]] = []
    for a, b in sorted((p.keys.start, p.keys.stop) for p in pieces):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return tuple((a, b) for a, b in merged)


def _rows(kv: torch.Tensor, intervals: Intervals) -> torch.Tensor | None:
    """The stacked (2, batch, seqlen, heads, dim) K/V's rows in these intervals, as one tensor (None: no rows)."""
    if not intervals:
        return None
    return torch.cat([kv[:, :, a:b] for a, b in intervals], dim=2)


def _shape(kv: torch.Tensor, intervals: Intervals) -> tuple[int, ...] | None:
    return None if not intervals else (*kv.shape[:2], sum(b - a for a, b in intervals), *kv.shape[3:])


def _received(ring: Ring, halo: Halo, kv: torch.Tensor) -> Iterator[tuple[int, torch.Tensor | None]]:
    """(s, the rows of rank - s's K/V that this rank wants, or None) per distance; the next distance's transfer is
    posted before this one's rows are handed over. Every rank takes part in the first trade, as NCCL asks of a
    group's first batch_isend_irecv: a window of at least one row makes each rank but the first want rows of the
    rank before it (distance 1), which the first sends."""
    world, rank = halo.world, halo.rank

    def post(s: int):
        sent = _rows(kv, halo.wants[(rank + s) % world][rank])
        return ring.trade(sent, s, _shape(kv, halo.wants[rank][(rank - s) % world]), kv)

    pending = post(halo.distances[0]) if halo.distances else None
    for i, s in enumerate(halo.distances):
        rows = pending.wait()
        if i + 1 < len(halo.distances):
            pending = post(halo.distances[i + 1])
        yield s, rows


def forward(ring: Ring, halo: Halo, q: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = S.first_forward(halo.plans[halo.rank][halo.rank], q, kv)
    for s, rows in _received(ring, halo, kv):
        if rows is not None:
            S.forward_step(halo.pieces_on_received((halo.rank - s) % halo.world), q, rows, out, lse)
    return S.finish_forward(out, lse, q.dtype)


def backward(ring: Ring, halo: Halo, dout, dlse, q, kv, out, lse) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients; each distance's dK/dV shares travel home while the next distance computes, and are added in
    the distances' order."""
    world, rank = halo.world, halo.rank
    dq, dkv = S.first_backward(halo.plans[rank][rank], dout, dlse, q, kv, out, lse)
    coming = None  # (rank + s's pieces against this shard, the transfer of their shares)
    for s, rows in _received(ring, halo, kv):
        shares = []
        if rows is not None:
            shares = S.backward_step(halo.pieces_on_received((rank - s) % world), dout, dlse, q, rows, out, lse, dq)
        _add_returned(dkv, coming, kv.dtype)
        sent = torch.cat([torch.stack((dk, dv)) for _, dk, dv in shares], dim=2) if shares else None
        theirs = halo.plans[(rank + s) % world][rank]
        coming = theirs, ring.trade(sent, -s, _shape(dkv, tuple((p.keys.start, p.keys.stop) for p in theirs)), dkv)
    _add_returned(dkv, coming, kv.dtype)
    return dq.to(q.dtype), dkv


def _add_returned(dkv: torch.Tensor, coming: tuple | None, dtype: torch.dtype) -> None:
    """Adds the shares a trade brought back (if any) into this shard's fp32 dK/dV, piece by piece."""
    if coming is None:
        return
    pieces, pending = coming
    back = pending.wait()
    if back is not None:
        S.add_kv_grads(dkv, list(_split(pieces, back)), dtype)


def _split(pieces: tuple[S.Step, ...], back: torch.Tensor) -> Iterator[tuple[S.Step, torch.Tensor, torch.Tensor]]:
    """(piece, its dK share, its dV share) from the stacked shares of a message, in the pieces' order."""
    at = 0
    for piece in pieces:
        n = piece.keys.stop - piece.keys.start
        yield piece, back[0][:, at : at + n], back[1][:, at : at + n]
        at += n
