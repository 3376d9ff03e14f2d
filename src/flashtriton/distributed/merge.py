"""The ring's fp32 accumulations: a step's partial result merged into a rank's (out, lse), and its gradient shares
added into dQ, dK, dV, at the accumulator rows a slice or a gathered call picks.

``targets`` (int64, (n,)) are the accumulator rows, ``sources`` one or two tensors of the partial's rows that land on
them (the copies of a gathered call; steps.Gather); both None: the tensors passed are views of the same rows. Where
the kernels run (route.merge_backend) one Triton pass does each (kernels/merge.py); elsewhere torch's elementwise
ops do, a copy at a time. Either way every accumulator row is written in a fixed order: deterministic.

Layouts: (batch, seqlen, heads, dim) with LSEs (batch, heads, seqlen), or a packed batch's (total, heads, dim) with
(heads, total); the last dim contiguous. Gathered rows are a packed batch's.
"""

from __future__ import annotations

import math

import torch
import triton

from .. import route
from ..kernels import config
from ..kernels.merge import accumulate_rows_kernel


def merge(out, lse, part_out, part_lse, targets=None, sources: tuple = (), *, dtype: torch.dtype) -> None:
    """Merges the partial result (part_out, part_lse) over other keys into the fp32 accumulators (out, lse), in
    place, weighting each by exp(its LSE - the merged LSE); rows empty in both stay out 0, LSE -inf. dtype: the
    ring's inputs' (route.merge_backend)."""
    if route.merge_backend(out.device, dtype) == route.TORCH:
        if targets is None:
            _merge(out, lse, part_out, part_lse)
            return
        for rows in sources:  # a copy at a time: each accumulator row merged once per pass
            acc_out, acc_lse = out.index_select(0, targets), lse.index_select(-1, targets)
            _merge(acc_out, acc_lse, part_out.index_select(0, rows), part_lse.index_select(-1, rows))
            out.index_copy_(0, targets, acc_out)
            lse.index_copy_(-1, targets, acc_lse)
        return
    if out.dim() == 3:
        out, lse, part_out, part_lse = _batched(out, lse, part_out, part_lse)
    rows, copies, grid, meta = _launch(out, targets, sources)
    if rows == 0:
        return
    accumulate_rows_kernel[grid](
        out, lse, part_out, part_lse, targets, *copies, rows, *_strides(out), *lse.stride(), *_strides(part_out),
        *part_lse.stride(), MERGE=True, **meta,
    )  # fmt: skip


def add(
    acc: torch.Tensor, part: torch.Tensor, targets: torch.Tensor | None = None, sources: tuple = (), *,
    dtype: torch.dtype,
) -> None:  # fmt: skip
    """acc[targets] += the sum of part's rows ``sources`` (both None: acc += part), in fp32, in place: the same
    additions in the same order on either backend. dtype: the ring's inputs' (route.merge_backend), as merge's."""
    if targets is None:
        acc.add_(part)
        return
    if route.merge_backend(acc.device, dtype) == route.TORCH:
        for rows in sources:
            acc.index_add_(0, targets, part.index_select(0, rows))
        return
    if acc.dim() == 3:
        acc, part = _batched(acc, part)
    rows, copies, grid, meta = _launch(acc, targets, sources)
    if rows == 0:
        return
    accumulate_rows_kernel[grid](
        acc, None, part, None, targets, *copies, rows, *_strides(acc), 0, 0, 0, *_strides(part), 0, 0, 0,
        MERGE=False, **meta,
    )  # fmt: skip


def _merge(out, lse, part_out, part_lse) -> None:
    total = torch.logaddexp(lse, part_lse)
    shift = total.masked_fill(total == -math.inf, 0.0)  # exp(-inf - 0) = 0 instead of exp(-inf + inf) = NaN
    out.mul_(_weights(torch.exp(lse - shift), out)).add_(part_out * _weights(torch.exp(part_lse - shift), out))
    lse.copy_(total)


def _weights(lse: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """LSE-shaped weights ((batch, heads, seqlen) or (heads, total)) broadcast against out-shaped ``like``."""
    return (lse.transpose(1, 2) if like.dim() == 4 else lse.t()).unsqueeze(-1)


def _batched(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A packed batch's tensors as views of one-sequence batches: (1, total, heads, dim) and (1, heads, total)."""
    return tuple(x.unsqueeze(0) for x in xs)


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    """The (batch, seqlen, heads) strides of a (batch, seqlen, heads, dim) tensor whose dim is contiguous."""
    assert x.stride(-1) == 1, "the merges read rows of contiguous head dims"
    return x.stride(0), x.stride(1), x.stride(2)


def _launch(out: torch.Tensor, targets: torch.Tensor | None, sources: tuple) -> tuple:
    """The rows a pass covers, its copies' row tensors (SRC0, SRC1), its grid and its constexprs."""
    batch, seqlen, heads, head_dim = out.shape
    rows = seqlen if targets is None else targets.numel()
    copies = (*sources, None, None)[:2] if sources else (None, None)
    block_d = config.block_d(head_dim)
    block_r = max(1, config.MERGE_TILE_ELEMENTS // block_d)
    grid = (triton.cdiv(rows, block_r), heads, batch)
    meta = dict(D=head_dim, BLOCK_D=block_d, BLOCK_R=block_r, COPIES=max(1, len(sources)),
                num_warps=config.MERGE_WARPS)  # fmt: skip
    return rows, copies, grid, meta
