"""Ring attention's arithmetic, without communication: which query rows of a rank meet which key rows of another
rank's K/V shard, each such step's kernel call, and the fp32 log-sum-exp merge of the steps' partial results.

In step s of a ring of ``world`` ranks, rank r holds the K/V shard of rank src = (r - s) mod world. Under a causal
mask and the zigzag layout (layout.py: rank r holds chunks r and 2 * world - 1 - r of the sequence, each of c rows):

  src == r   the local queries against the local keys under the ordinary causal mask: both halves are in
             sequence order, so "local key j <= local query i" is exactly the global rule
  src < r    every local query against the first half of the shard (chunk src, before both of r's chunks); its
             second half (chunk 2w-1-src) comes after both, so nothing of it is seen
  src > r    the second half of the local queries (chunk 2w-1-r, after both of src's chunks) against the whole
             shard; the first half (chunk r, before both) sees nothing

so every step but the first is unmasked work of c * 2c (half the dense work), and each rank does the same; it runs
as two square c * c calls (pieces), which the Hopper kernels serve (their fp32 partial results only where
seqlen_q == seqlen_k: route.hopper_fits).
Contiguous layout: src == r causal, src < r unmasked, src > r nothing. Without a mask every step is unmasked.
A rank's plan is, per source rank, a tuple of such calls (Steps): none when the step computes nothing.

A packed varlen batch follows the same rule document by document, with square pieces too: a step that takes the
first half of each document's keys runs as one varlen call of two sequences per document (its first and second half
of queries), each against a copy of the document's first-half keys; a step that takes the second half of the queries
runs its copies against the first and the second half of the keys. Queries and keys then share cu_seqlens, which
the Hopper varlen kernels take. The copies are gathered (Gather) and their results merged or added back in one pass
that reads both copies of a row (merge.py), so every local row is written once (deterministic without atomics).

Every partial result comes with its LSE (empty rows: -inf, so they weigh nothing) and is merged into fp32
accumulators. The backward of a step is the kernel's backward given the *merged* out and LSE: then exp(S - LSE)
is the step's share of the softmax and rowsum(dO * O) the whole row's, so the step's dQ, dK, dV are exactly its
share of the gradients (and dLSE passes through the same way). dQ adds up in fp32 on its rank; dK, dV add up in
fp32 accumulators that follow their K/V shard around the ring. The calls return their results in fp32
(AttentionParams.fp32_results), so out, dQ, dK and dV are rounded to the inputs' dtype once, after the last step,
not once per step.

The same functions serve a real ring (ring.py) and ``simulate_forward`` / ``simulate_backward``, which run every
rank's steps in one process in the order a ring runs them, so both give the same bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial
from itertools import accumulate

import torch

from .. import ops
from ..params import NO_BOUND, AttentionParams, lse_shape
from .layout import ZIGZAG, rank_chunks
from .merge import add, merge

ALL = slice(None)


@dataclass(frozen=True)
class Gather:
    """A call's rows gathered from a shard's packed rows: the call's row i is the shard's row order[i]. Each shard
    row of ``targets`` appears once in every copy: at call rows sources[0][i], sources[1][i] (merge.py)."""

    order: torch.Tensor
    targets: torch.Tensor
    sources: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Step:
    """One kernel call of a ring step: query rows ``rows`` of the local shard against key rows ``keys`` of the K/V
    shard held (slices along the sequence; a varlen step takes all rows and chooses them by its cu_seqlens), or
    rows gathered from them (queries, keys_from: varlen only)."""

    rows: slice
    keys: slice
    params: AttentionParams  # empty_lse -inf: a partial result
    queries: Gather | None = None
    keys_from: Gather | None = None

    @property
    def backward_params(self) -> AttentionParams:
        """The backward reads the merged LSE, whose empty rows are +inf (params.py)."""
        return replace(self.params, empty_lse=math.inf)


def partial_params(softmax_scale: float, deterministic: bool, **varlen) -> AttentionParams:
    """A step's options: no mask, results that a log-sum-exp merge combines, in fp32 (rounded once, after the
    merge)."""
    return AttentionParams(
        softmax_scale=softmax_scale, deterministic=deterministic, empty_lse=-math.inf, fp32_results=True, **varlen
    )


def dense_steps(world: int, rank: int, seqlen: int, layout: str, causal: bool, params: AttentionParams) -> tuple:
    """The Steps of each source rank (a tuple, empty: nothing to compute), for a local shard of ``seqlen`` rows."""
    if not causal:
        return ((Step(ALL, ALL, params),),) * world
    own = (Step(ALL, ALL, replace(params, window_right=0)),)
    first, second = slice(0, seqlen // 2), slice(seqlen // 2, None)
    steps = []
    for src in range(world):
        if src == rank:
            steps.append(own)
        elif layout == ZIGZAG:  # every query against the first half of the keys, or the second half against all
            pieces = ((first, first), (second, first)) if src < rank else ((second, first), (second, second))
            steps.append(tuple(Step(rows, keys, params) for rows, keys in pieces))
        else:
            steps.append((Step(ALL, ALL, params),) if src < rank else ())
    return tuple(steps)


def varlen_steps(
    world: int, rank: int, lengths: list[int], layout: str, causal: bool, params: AttentionParams,
    device: torch.device,
) -> tuple:  # fmt: skip
    """dense_steps for a packed batch whose documents have ``lengths`` rows in the local shard (host ints); a zigzag
    half step is one call on gathered copies (module docstring)."""
    starts = [0, *accumulate(lengths)]
    longest = max(lengths, default=0)
    whole = _varlen(params, starts, starts, longest, longest, device)
    if not causal:
        return ((Step(ALL, ALL, whole),),) * world
    own = Step(ALL, ALL, replace(whole, window_right=0))
    if layout == ZIGZAG:
        # the call's two sequences per document are its halves' places: a document's first and second half rows
        cut = [0, *_pairs([a + n // 2 for a, n in zip(starts, lengths, strict=False)], starts[1:])]
        halves = _varlen(params, cut, cut, longest // 2, longest // 2, device)
        first, second = _halves(starts, lengths, device)
        # src < r: both halves of each document's queries against copies of its first-half keys
        first_keys = Step(ALL, ALL, halves, keys_from=_copies(first, second, first, device))
        # src > r: copies of each document's second-half queries against its first- and second-half keys
        second_rows = Step(ALL, ALL, halves, queries=_copies(first, second, second, device))
    steps = []
    for src in range(world):
        if src == rank:
            steps.append((own,))
        elif layout == ZIGZAG:
            steps.append((first_keys if src < rank else second_rows,))
        else:
            steps.append((Step(ALL, ALL, whole),) if src < rank else ())
    return tuple(steps)


def _halves(starts: list[int], lengths: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """The shard rows of every document's first halves and of its second halves, in document order."""
    first = [torch.arange(a, a + n // 2) for a, n in zip(starts, lengths, strict=False)]
    second = [torch.arange(a + n // 2, a + n) for a, n in zip(starts, lengths, strict=False)]
    return torch.cat([torch.zeros(0, dtype=torch.int64), *first]).to(device), torch.cat(
        [torch.zeros(0, dtype=torch.int64), *second]
    ).to(device)


def _copies(first: torch.Tensor, second: torch.Tensor, rows: torch.Tensor, device) -> Gather:
    """A call laid out as the shard (each document's first-half places, then its second-half places) whose both
    places of a document hold copies of ``rows``'s rows of that document."""
    order = torch.empty(len(first) + len(second), dtype=torch.int64, device=device)
    order[first], order[second] = rows, rows
    return Gather(order, rows, (first, second))


def dense_plan(
    world: int, rank: int, seqlen: int, layout: str, causal: bool, window_left: int, params: AttentionParams
) -> tuple:
    """The Steps of each source rank for a dense shard: window_steps under a left bound (>= 0), else dense_steps."""
    if window_left >= 0:
        return window_steps(world, rank, seqlen, layout, window_left, params)
    return dense_steps(world, rank, seqlen, layout, causal, params)


def window_steps(world: int, rank: int, seqlen: int, layout: str, window_left: int, params: AttentionParams) -> tuple:
    """dense_steps under a causal sliding window (query i sees keys i - window_left .. i of the full sequence): a
    square call per pair of a query chunk and a key chunk that the band meets. A pair whose key chunk starts d rows
    before the query chunk sees keys from d - window_left rows right of its diagonal on: where that is not right of
    it, the call's left bound is window_left - d; where it is, m = d - window_left rows in, the call takes the chunk's
    first c - m queries against its last c - m keys with a left bound of 0 (key j >= query i)."""
    chunks = [rank_chunks(world, r, layout) for r in range(world)]
    c = seqlen // len(chunks[rank])
    steps = []
    for src in range(world):
        pieces = []
        for qi, a in enumerate(chunks[rank]):
            for kj, b in enumerate(chunks[src]):
                d = (a - b) * c
                rows, keys = slice(qi * c, qi * c + c), slice(kj * c, kj * c + c)
                if d == 0:
                    pieces.append(Step(rows, keys, replace(params, window_left=window_left, window_right=0)))
                elif d > 0 and d - window_left <= 0:
                    left = window_left - d if window_left - d < c - 1 else NO_BOUND  # a bound past the chunk is none
                    pieces.append(Step(rows, keys, replace(params, window_left=left)))
                elif 0 < d - window_left < c:
                    m = d - window_left
                    rows, keys = slice(qi * c, qi * c + c - m), slice(kj * c + m, kj * c + c)
                    pieces.append(Step(rows, keys, replace(params, window_left=0)))
        steps.append(tuple(pieces))
    return tuple(steps)


def _pairs(a: list[int], b: list[int]) -> list[int]:
    """a[0], b[0], a[1], b[1], ...: the bounds of two sequences per document."""
    return [x for pair in zip(a, b, strict=True) for x in pair]


def _varlen(params, cu_q: list[int], cu_k: list[int], max_q: int, max_k: int, device) -> AttentionParams:
    as_tensor = partial(torch.tensor, dtype=torch.int32, device=device)
    return replace(
        params, cu_seqlens_q=as_tensor(cu_q), cu_seqlens_k=as_tensor(cu_k), max_seqlen_q=max_q, max_seqlen_k=max_k
    )


def _seq(x: torch.Tensor, rows: slice) -> torch.Tensor:
    """x's rows along the sequence: dim 1 of (batch, seqlen, heads, dim), dim 0 of a packed (total, heads, dim)."""
    return x[:, rows] if x.dim() == 4 else x[rows]


def first_forward(own: tuple[Step, ...], q: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's own step: the fp32 accumulators (out, lse) it starts (one call of every row and key, or pieces
    merged into empty accumulators)."""
    if len(own) == 1 and own[0].rows == ALL and own[0].queries is None:
        return ops.forward(q, kv[0], kv[1], own[0].params)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(lse_shape(q, q.dim() == 3), -math.inf, dtype=torch.float32, device=q.device)
    forward_step(own, q, kv, out, lse)
    return out, lse


def _rows(x: torch.Tensor, rows: slice, gather: Gather | None, dim: int = 0) -> torch.Tensor:
    """A call's rows of x: a slice along the sequence, or a Gather's (packed rows, along ``dim``)."""
    if gather is None:
        return _seq(x, rows) if dim == 0 else x[..., rows]
    return x.index_select(dim, gather.order)


def forward_step(pieces: tuple[Step, ...], q, kv, out: torch.Tensor, lse: torch.Tensor) -> None:
    """One later step: the partial result of each call's rows against its keys, merged into (out, lse)."""
    for step in pieces:
        k, v = (_rows(x, step.keys, step.keys_from) for x in (kv[0], kv[1]))
        part_out, part_lse = ops.forward(_rows(q, step.rows, step.queries), k, v, step.params)
        if step.queries is None:
            merge(_seq(out, step.rows), lse[..., step.rows], part_out, part_lse, dtype=q.dtype)
        else:
            merge(out, lse, part_out, part_lse, step.queries.targets, step.queries.sources, dtype=q.dtype)


def finish_forward(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """out in the inputs' dtype; the LSE as a final one: a row that saw no key +inf (params.py), as flash_attn."""
    return out.to(dtype), lse.masked_fill_(lse == -math.inf, math.inf)


def first_backward(own: tuple[Step, ...], dout, dlse, q, kv, out, lse) -> tuple[torch.Tensor, torch.Tensor]:
    """The own step's gradients: the fp32 dQ accumulator and the fp32 (2, ...) dK/dV accumulator of the own shard."""
    if len(own) == 1 and own[0].rows == ALL and own[0].queries is None:
        dq, dk, dv, _ = ops.backward(dout, dlse, q, kv[0], kv[1], out, lse, own[0].backward_params)  # no sinks
        dkv = torch.empty(kv.shape, dtype=torch.float32, device=kv.device)
        dkv[0], dkv[1] = dk, dv
        return dq, dkv
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    add_kv_grads(dkv, backward_step(own, dout, dlse, q, kv, out, lse, dq), kv.dtype)
    return dq, dkv


def backward_step(pieces: tuple[Step, ...], dout, dlse, q, kv, out, lse, dq: torch.Tensor) -> list[tuple]:
    """One later step: adds each call's dQ share into the fp32 dq; returns (step, dK, dV) per call, dK and dV the
    shares of the call's keys (``step.keys``, or step.keys_from's copies)."""
    shares = []
    for step in pieces:
        rows, gather = step.rows, step.queries
        part_dq, dk, dv, _ = ops.backward(
            _rows(dout, rows, gather), _rows(dlse, rows, gather, -1), _rows(q, rows, gather),
            _rows(kv[0], step.keys, step.keys_from), _rows(kv[1], step.keys, step.keys_from), _rows(out, rows, gather),
            _rows(lse, rows, gather, -1), step.backward_params,
        )  # fmt: skip
        if gather is None:
            add(_seq(dq, rows), part_dq, dtype=q.dtype)
        else:
            add(dq, part_dq, gather.targets, gather.sources, dtype=q.dtype)
        shares.append((step, dk, dv))
    return shares


def add_kv_grads(dkv: torch.Tensor, shares: list[tuple], dtype: torch.dtype) -> None:
    """Adds a step's (dK, dV) shares into the fp32 accumulator of the shard it ran against (dtype: the ring's
    inputs')."""
    for step, dk, dv in shares:
        gather = step.keys_from
        for acc, share in zip(dkv, (dk, dv), strict=True):
            if gather is None:
                add(_seq(acc, step.keys), share, dtype=dtype)
            else:
                add(acc, share, gather.targets, gather.sources, dtype=dtype)


def simulate_forward(plans: list[tuple], qs: list[torch.Tensor], kvs: list[torch.Tensor]) -> list[tuple]:
    """Every rank's (out, lse) as a ring computes them, in one process: plans[r] is rank r's steps by source rank,
    qs[r] its queries, kvs[r] its stacked (2, ...) K/V shard."""
    world = len(qs)
    accs = [first_forward(plans[r][r], qs[r], kvs[r]) for r in range(world)]
    for s in range(1, world):
        for r in range(world):
            forward_step(plans[r][(r - s) % world], qs[r], kvs[(r - s) % world], *accs[r])
    return [finish_forward(out, lse, q.dtype) for (out, lse), q in zip(accs, qs, strict=True)]


def simulate_backward(plans: list[tuple], douts, dlses, qs, kvs, outs, lses) -> list[tuple]:
    """Every rank's (dq, dkv) as a ring computes them, in one process (the arguments per rank, as simulate_forward's;
    outs and lses the merged results). Shard j's dK/dV accumulator takes its shares in the ring's order: rank j's,
    then rank j + 1's, and so on."""
    world = len(qs)
    grads = [first_backward(plans[r][r], douts[r], dlses[r], qs[r], kvs[r], outs[r], lses[r]) for r in range(world)]
    for s in range(1, world):
        for r in range(world):
            src = (r - s) % world
            shares = backward_step(plans[r][src], douts[r], dlses[r], qs[r], kvs[src], outs[r], lses[r], grads[r][0])
            add_kv_grads(grads[src][1], shares, kvs[src].dtype)
    return [(dq.to(q.dtype), dkv.to(kv.dtype)) for (dq, dkv), q, kv in zip(grads, qs, kvs, strict=True)]
