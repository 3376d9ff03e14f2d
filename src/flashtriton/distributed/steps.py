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
as two square c * c calls (pieces), which the Hopper kernels serve (they take seqlen_q == seqlen_k).
Contiguous layout: src == r causal, src < r unmasked, src > r nothing. Without a mask every step is unmasked.
A rank's plan is, per source rank, a tuple of such calls (Steps): none when the step computes nothing.

A packed varlen batch follows the same rule document by document. A step that takes half of each document's keys
(or queries) runs as a varlen call of two sequences per document, one of which has no queries (or no keys): the
cu_seqlens choose the rows, so no row is copied.

Every partial result comes with its LSE (empty rows: -inf, so they weigh nothing) and is merged into fp32
accumulators. The backward of a step is the kernel's backward given the *merged* out and LSE: then exp(S - LSE)
is the step's share of the softmax and rowsum(dO * O) the whole row's, so the step's dQ, dK, dV are exactly its
share of the gradients (and dLSE passes through the same way). dQ adds up in fp32 on its rank; dK, dV add up in
fp32 accumulators that follow their K/V shard around the ring.

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
from ..params import AttentionParams
from .layout import ZIGZAG

ALL = slice(None)


@dataclass(frozen=True)
class Step:
    """One kernel call of a ring step: query rows ``rows`` of the local shard against key rows ``keys`` of the K/V
    shard held (slices along the sequence; a varlen step takes all rows and chooses them by its cu_seqlens)."""

    rows: slice
    keys: slice
    params: AttentionParams  # empty_lse -inf: a partial result

    @property
    def backward_params(self) -> AttentionParams:
        """The backward reads the merged LSE, whose empty rows are +inf (params.py)."""
        return replace(self.params, empty_lse=math.inf)


def partial_params(softmax_scale: float, deterministic: bool, **varlen) -> AttentionParams:
    """A step's options: no mask, results that a log-sum-exp merge combines."""
    return AttentionParams(softmax_scale=softmax_scale, deterministic=deterministic, empty_lse=-math.inf, **varlen)


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
    """dense_steps for a packed batch whose documents have ``lengths`` rows in the local shard (host ints). A half
    step's call has two sequences per document, one of them with no queries or no keys (module docstring)."""
    starts = [0, *accumulate(lengths)]
    ends = starts[1:]
    longest = max(lengths, default=0)
    whole = _varlen(params, starts, starts, longest, longest, device)
    if not causal:
        return ((Step(ALL, ALL, whole),),) * world
    own = Step(ALL, ALL, replace(whole, window_right=0))
    if layout == ZIGZAG:
        half = longest // 2
        cut = [0, *_pairs([a + n // 2 for a, n in zip(starts, lengths, strict=False)], ends)]  # first, second halves
        # src < r: each document's queries against its first-half keys, then no queries against its second half
        first_keys = _varlen(params, [0, *_pairs(ends, ends)], cut, longest, half, device)
        # src > r: each document's first-half queries against no keys, then its second half against all its keys
        second_rows = _varlen(params, cut, [0, *_pairs(starts[:-1], ends)], half, longest, device)
    steps = []
    for src in range(world):
        if src == rank:
            steps.append((own,))
        elif layout == ZIGZAG:
            steps.append((Step(ALL, ALL, first_keys if src < rank else second_rows),))
        else:
            steps.append((Step(ALL, ALL, whole),) if src < rank else ())
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


def _weights(lse: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """LSE-shaped weights ((batch, heads, seqlen) or (heads, total)) broadcast against out-shaped ``like``."""
    return (lse.transpose(1, 2) if like.dim() == 4 else lse.t()).unsqueeze(-1)


def merge(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Adds a partial result (part_out, part_lse) over other keys into the fp32 accumulators (out, lse) of the same
    rows, in place, weighting each by exp(its LSE - the merged LSE). Rows empty in both stay out 0, LSE -inf."""
    total = torch.logaddexp(lse, part_lse)
    shift = total.masked_fill(total == -math.inf, 0.0)  # exp(-inf - 0) = 0 instead of exp(-inf + inf) = NaN
    out.mul_(_weights(torch.exp(lse - shift), out)).add_(part_out * _weights(torch.exp(part_lse - shift), out))
    lse.copy_(total)


def first_forward(own: tuple[Step], q: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's own step (one call: every row, every key): the fp32 accumulators (out, lse) it starts."""
    out, lse = ops.forward(q, kv[0], kv[1], own[0].params)
    return out.float(), lse


def forward_step(pieces: tuple[Step, ...], q, kv, out: torch.Tensor, lse: torch.Tensor) -> None:
    """One later step: the partial result of each call's rows against its keys, merged into (out, lse)."""
    for step in pieces:
        part = ops.forward(_seq(q, step.rows), _seq(kv[0], step.keys), _seq(kv[1], step.keys), step.params)
        merge(_seq(out, step.rows), lse[..., step.rows], *part)


def finish_forward(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """out in the inputs' dtype; the LSE as a final one: a row that saw no key +inf (params.py), as flash_attn."""
    return out.to(dtype), lse.masked_fill_(lse == -math.inf, math.inf)


def first_backward(own: tuple[Step], dout, dlse, q, kv, out, lse) -> tuple[torch.Tensor, torch.Tensor]:
    """The own step's gradients: the fp32 dQ accumulator and the fp32 (2, ...) dK/dV accumulator of the own shard."""
    dq, dk, dv, _ = ops.backward(dout, dlse, q, kv[0], kv[1], out, lse, own[0].backward_params)  # no sinks
    dkv = torch.empty(kv.shape, dtype=torch.float32, device=kv.device)
    dkv[0], dkv[1] = dk, dv
    return dq.float(), dkv


def backward_step(pieces: tuple[Step, ...], dout, dlse, q, kv, out, lse, dq: torch.Tensor) -> list[tuple]:
    """One later step: adds each call's dQ share into the fp32 dq; returns (step, dK, dV) per call, dK and dV the
    shares of the keys ``step.keys``."""
    shares = []
    for step in pieces:
        rows, keys = step.rows, step.keys
        part_dq, dk, dv, _ = ops.backward(
            _seq(dout, rows), dlse[..., rows], _seq(q, rows), _seq(kv[0], keys), _seq(kv[1], keys), _seq(out, rows),
            lse[..., rows], step.backward_params,
        )  # fmt: skip
        _seq(dq, rows).add_(part_dq)
        shares.append((step, dk, dv))
    return shares


def add_kv_grads(dkv: torch.Tensor, shares: list[tuple]) -> None:
    """Adds a step's (dK, dV) shares into the fp32 accumulator of the shard it ran against."""
    for step, dk, dv in shares:
        _seq(dkv[0], step.keys).add_(dk)
        _seq(dkv[1], step.keys).add_(dv)


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
            add_kv_grads(grads[src][1], shares)
    return [(dq.to(q.dtype), dkv.to(kv.dtype)) for (dq, dkv), q, kv in zip(grads, qs, kvs, strict=True)]
