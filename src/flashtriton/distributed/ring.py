"""Ring attention: each rank keeps its shard of the queries and passes its K/V shard around the ring, merging the
partial results of every step (steps.py has the arithmetic, comm.py the transfers).

Forward, on each rank: post the transfer of the K/V shard held to the next rank, compute the step with it, wait for
the previous rank's shard, repeat ``world`` times (under a sliding window, halo.py trades only the rows the band
reaches instead). Backward: the same walk, each step's dK/dV share added into fp32
accumulators that travel one step behind their K/V shard (sent once the step's share is in) and come home after
the last step; dQ stays on its rank in fp32. K and V travel as one stacked (2, ...) buffer, a message per step.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..validation import check_flag, check_qkv, check_varlen, host_read
from . import halo
from . import steps as S
from .checks import (
    check_group,
    check_local_rows,
    check_self_attention,
    check_varlen_shards,
    ring_scale,
    ring_window,
)
from .comm import Ring
from .halo import Halo
from .layout import ZIGZAG, check_two_d, world_and_rank
from .ulysses import AllToAll, check_heads


class _Call:
    """One call's ring: its group (None and world 1: no communication), its Steps by source rank, and under a
    sliding window the trades of only the rows the band reaches (halo.py) instead of whole shards."""

    def __init__(self, group: dist.ProcessGroup | None, world: int, rank: int, steps: tuple, halo: Halo | None = None):
        self.group, self.world, self.rank, self.steps, self.halo = group, world, rank, steps, halo

    def ring(self) -> Ring:
        return Ring(self.group)


def _forward(call: _Call, q: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if call.halo is not None:
        return halo.forward(call.ring(), call.halo, q, kv)
    world, rank = call.world, call.rank
    ring = call.ring() if world > 1 else None
    pending = ring.shift(kv) if ring else None  # the next step's shard travels while this one computes
    out, lse = S.first_forward(call.steps[rank], q, kv)
    for s in range(1, world):
        kv = pending.wait()
        if s + 1 < world:
            pending = ring.shift(kv)
        S.forward_step(call.steps[(rank - s) % world], q, kv, out, lse)
    return S.finish_forward(out, lse, q.dtype)


def _backward(call: _Call, dout, dlse, q, kv, out, lse) -> tuple[torch.Tensor, torch.Tensor]:
    if call.halo is not None:
        return halo.backward(call.ring(), call.halo, dout, dlse, q, kv, out, lse)
    world, rank = call.world, call.rank
    ring = call.ring() if world > 1 else None
    pending_kv = ring.shift(kv) if ring else None
    dq, dkv = S.first_backward(call.steps[rank], dout, dlse, q, kv, out, lse)
    for s in range(1, world):
        pending_dkv = ring.shift(dkv)  # the accumulator follows its shard, which the next rank holds now
        kv = pending_kv.wait()
        if s + 1 < world:
            pending_kv = ring.shift(kv)
        shares = S.backward_step(call.steps[(rank - s) % world], dout, dlse, q, kv, out, lse, dq)
        dkv = pending_dkv.wait()
        S.add_kv_grads(dkv, shares, kv.dtype)
    if ring:
        dkv = ring.shift(dkv).wait()  # the last holder sends it home
    return dq.to(q.dtype), dkv


@functools.lru_cache(maxsize=64)
def _halo(world: int, rank: int, rows: int, layout: str, window_left: int, params) -> Halo:
    """A windowed ring's trades, kept per shape and options: they need every rank's plan (world * world pieces)."""
    return Halo.of([S.window_steps(world, r, rows, layout, window_left, params) for r in range(world)], rank)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: _Call):
        out, lse = _forward(call, q, torch.stack((k, v)))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dkv = _backward(ctx.call, dout, dlse, q, torch.stack((k, v)), out, lse)
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def ring_flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    layout: str = ZIGZAG,
    ulysses_group: dist.ProcessGroup | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over a sequence split across the ranks of ``group``, on this rank's shard.

    q: (batch, seqlen / world, nheads, headdim); k, v: (batch, seqlen / world, nheads_k, headdim): this rank's shard
    of the full sequence as ``flashtriton.distributed.shard(x, group, layout)`` cuts it. ``layout`` "zigzag"
    (default: rank r holds chunks r and 2 * world - 1 - r of 2 * world, which balances causal work; seqlen must be a
    multiple of 2 * world) or "contiguous" (chunk r of world). nheads a multiple of nheads_k (GQA: only the nheads_k
    K/V heads travel); headdim a multiple of 8 up to 256; softmax_scale > 0 (default 1 / sqrt(headdim)).
    causal: query i sees key j iff j <= i in the full sequence. window_size: (-1, -1), or a causal sliding window
    (left, 0): query i sees keys i - left .. i (causal=True sets the right bound to 0, as flash_attn does; other
    windows raise NotImplementedError; ulysses_flash_attn_func takes any); its calls are square pieces of the chunks
    the band meets. group: a process group (gloo for CPU tensors, NCCL for CUDA); None: the default group, or no
    communication at all when torch.distributed is not initialised.
    deterministic: bitwise reproducible gradients (the ring adds the steps' shares in a fixed order either way).

    ulysses_group: the 2-D form. The sequence is split over ``group`` (the ring) and each ring shard again over
    ulysses_group in contiguous parts (shard(x, group, layout, ulysses_group=...) cuts it so); an all-to-all over
    ulysses_group trades the parts for whole ring shards of 1 / its size of the heads (nheads and nheads_k multiples
    of its size), the ring runs on those, and the output goes back the same way. Each ring then moves 1 / its size
    of the K/V heads.

    Returns out: (batch, seqlen / world, nheads, headdim) in q's dtype, and with return_lse the natural-log LSE
    (batch, nheads, seqlen / world) in fp32. Differentiable in q, k, v (and through the LSE). Every call (forward
    and backward) is a collective: every rank of the group must make it.
    """
    check_qkv(q, k, v)
    check_self_attention(q, k, seq_dim=1)
    window_left, causal = ring_window(window_size, causal)
    scale = ring_scale(softmax_scale, q.shape[-1])
    check_group(group, q)
    world, rank = world_and_rank(group)
    parts = 1
    if ulysses_group is not None:
        check_group(ulysses_group, q)
        check_two_d(group, ulysses_group)
        parts, _ = world_and_rank(ulysses_group)
        check_heads(q.shape[2], k.shape[2], parts)
    check_local_rows(q.shape[1] * parts, world, layout)
    params = S.partial_params(scale, check_flag("deterministic", deterministic))
    rows = q.shape[1] * parts
    # every rank's plan under a window: what this rank trades with each (empty shards take the dense plan's steps)
    if window_left >= 0 and world > 1 and rows:
        bands = _halo(world, rank, rows, layout, window_left, params)
        call = _Call(group, world, rank, bands.plans[rank], bands)
    else:
        call = _Call(group, world, rank, S.dense_plan(world, rank, rows, layout, causal, window_left, params))
    if parts == 1:
        out, lse = _RingAttention.apply(q, k, v, call)
        return (out, lse) if return_lse else out
    q, k, v = (AllToAll.apply(x, ulysses_group, parts, True) for x in (q, k, v))
    out, lse = _RingAttention.apply(q, k, v, call)
    out = AllToAll.apply(out, ulysses_group, parts, False)
    if not return_lse:
        return out
    return out, AllToAll.apply(lse.transpose(1, 2).unsqueeze(-1), ulysses_group, parts, False).squeeze(-1).transpose(
        1, 2
    )


def ring_flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    layout: str = ZIGZAG,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """ring_flash_attn_func on this rank's shard of a packed batch of documents.

    q: (total / world, nheads, headdim); k, v: (total / world, nheads_k, headdim): this rank's shard as
    ``flashtriton.distributed.shard_varlen(x, cu_seqlens, group, layout)`` cuts it (each document split as a
    sequence is, documents in order). cu_seqlens: the *global* (batch + 1,) int32 boundaries of the documents in the
    full packed batch, each document's length a multiple of 2 * world (zigzag) or world (contiguous): pad documents
    to that; max_seqlen: the longest document. Each document attends within itself (causal: within its own rows).
    The documents' lengths are read on the host once per cu_seqlens tensor (a synchronisation), with the ring's
    step plan kept for it.

    Returns out (total / world, nheads, headdim), and with return_lse the LSE (nheads, total / world) in fp32.
    """
    check_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    check_self_attention(q, k, seq_dim=0)
    _, causal = ring_window(window_size, causal, varlen=True)
    scale = ring_scale(softmax_scale, q.shape[-1])
    check_group(group, q)
    world, rank = world_and_rank(group)

    lengths = check_varlen_shards(cu_seqlens, max_seqlen, q.shape[0], world, layout)
    causal, deterministic = check_flag("causal", causal), check_flag("deterministic", deterministic)
    options = (world, rank, layout, causal, scale, deterministic)
    params = S.partial_params(scale, deterministic)
    local = [n // world for n in lengths]
    steps = host_read(  # one plan per cu_seqlens tensor: its step cu_seqlens are then read on the host once too
        cu_seqlens,
        ("ring", *options),
        lambda cu: S.varlen_steps(world, rank, local, layout, causal, params, q.device),
    )
    out, lse = _RingAttention.apply(q, k, v, _Call(group, world, rank, steps))
    return (out, lse) if return_lse else out
