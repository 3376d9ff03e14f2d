"""Ulysses: context parallelism by all-to-all over heads. Each rank trades its shard of the sequence (all heads) for
the whole sequence of 1 / world of the heads, runs flash_attn_func (a packed batch: flash_attn_varlen_func) on it,
and trades the output back. Every option of those applies (windows included); the cost is two all-to-alls of q, k, v
and one of out per pass, which do not overlap the attention, and nheads and nheads_k must be multiples of the
group's size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..interface import flash_attn_func, flash_attn_varlen_func
from ..validation import check_qkv, check_varlen, check_window, host_read, resolve_softmax_scale
from .checks import check_group, check_local_rows, check_self_attention, check_varlen_shards
from .layout import CONTIGUOUS, ZIGZAG, join, split, split_varlen, world_and_rank


def _exchange(send: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """all_to_all over the first dim: part j of send goes to rank j; part i of the result came from rank i."""
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received


def _sequence_to_heads(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """(B, n, H, D), this rank's shard with every head -> (B, world * n, H / world, D), every rank's shard in rank
    order with this rank's heads (rank j has heads j * H / world ...)."""
    b, n, h, d = x.shape
    send = x.reshape(b, n, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()
    return _exchange(send, group).permute(1, 0, 2, 3, 4).reshape(b, world * n, h // world, d)


def _heads_to_sequence(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """The inverse of _sequence_to_heads: (B, world * n, H / world, D) -> (B, n, H, D)."""
    b, total, heads, d = x.shape
    n = total // world
    send = x.reshape(b, world, n, heads, d).permute(1, 0, 2, 3, 4).contiguous()
    return _exchange(send, group).permute(1, 2, 0, 3, 4).reshape(b, n, world * heads, d)


class AllToAll(torch.autograd.Function):
    """_sequence_to_heads (to_heads) or _heads_to_sequence; the gradient goes back by the other one."""

    @staticmethod
    def forward(ctx, x, group, world: int, to_heads: bool):
        ctx.group, ctx.world, ctx.to_heads = group, world, to_heads
        return (_sequence_to_heads if to_heads else _heads_to_sequence)(x, group, world)

    @staticmethod
    def backward(ctx, grad):
        back = _heads_to_sequence if ctx.to_heads else _sequence_to_heads
        return back(grad.contiguous(), ctx.group, ctx.world), None, None, None


def _natural(x: torch.Tensor, world: int, layout: str) -> torch.Tensor:
    """Every rank's shard side by side (rank order, along dim 1) -> the sequence in order."""
    if layout == CONTIGUOUS:
        return x
    return join(list(x.unflatten(1, (world, -1)).unbind(1)), layout, dim=1)


def _rank_order(x: torch.Tensor, world: int, layout: str) -> torch.Tensor:
    """The inverse of _natural."""
    return x if layout == CONTIGUOUS else torch.cat(split(x, world, layout, dim=1), 1)


def check_heads(heads: int, heads_k: int, world: int) -> None:
    if heads % world or heads_k % world:
        raise ValueError(
            f"q has {heads} heads and k, v {heads_k}: Ulysses gives each of the {world} ranks a share of the heads, "
            f"so both must be multiples of {world}; repeat k and v's heads, or use ring_flash_attn_func"
        )


def ulysses_flash_attn_func(
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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """ring_flash_attn_func's contract (shards, layouts, returns), computed by all-to-all over heads: nheads and
    nheads_k must be multiples of the group's size. Any window_size, head dim and softmax_scale that
    flash_attn_func takes; masks refer to positions in the full sequence."""
    check_qkv(q, k, v)
    check_self_attention(q, k, seq_dim=1)
    window = check_window(window_size)
    resolve_softmax_scale(softmax_scale, q.shape[-1])
    check_group(group, q)
    world, _ = world_and_rank(group)
    check_local_rows(q.shape[1], world, layout)
    check_heads(q.shape[2], k.shape[2], world)

    def gather(x: torch.Tensor) -> torch.Tensor:
        return x if world == 1 else _natural(AllToAll.apply(x, group, world, True), world, layout)

    def scatter(x: torch.Tensor) -> torch.Tensor:
        return x if world == 1 else AllToAll.apply(_rank_order(x, world, layout), group, world, False)

    out, lse, _ = flash_attn_func(
        gather(q), gather(k), gather(v), softmax_scale=softmax_scale, causal=causal, window_size=window,
        deterministic=deterministic, return_attn_probs=True,
    )  # fmt: skip
    out = scatter(out)
    if not return_lse:
        return out
    return out, scatter(lse.transpose(1, 2).unsqueeze(-1)).squeeze(-1).transpose(1, 2)


def _rank_rows(cu_seqlens: torch.Tensor, world: int, layout: str) -> torch.Tensor:
    """The packed batch's row of each row of every rank's shard side by side (rank order): natural = x[argsort],
    rank order = natural[these]."""
    total = int(cu_seqlens[-1])
    return torch.cat(split_varlen(torch.arange(total), cu_seqlens, world, layout))


def ulysses_flash_attn_varlen_func(
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
    """ring_flash_attn_varlen_func's contract (the shards of a packed batch, the global cu_seqlens, returns),
    computed by all-to-all over heads: each rank gets the whole packed batch for 1 / world of the heads, put in
    order by one gather per tensor (the order read from cu_seqlens on the host once per tensor), and runs
    flash_attn_varlen_func on it. Any window_size (per document, as flash_attn_varlen_func's)."""
    check_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    check_self_attention(q, k, seq_dim=0)
    window = check_window(window_size)
    resolve_softmax_scale(softmax_scale, q.shape[-1])
    check_group(group, q)
    world, _ = world_and_rank(group)
    check_varlen_shards(cu_seqlens, max_seqlen, q.shape[0], world, layout)
    check_heads(q.shape[1], k.shape[1], world)
    rows = host_read(cu_seqlens, ("ulysses rows", world, layout), lambda cu: _rank_rows(cu.cpu(), world, layout))
    rows = rows.to(q.device)
    natural = torch.argsort(rows)

    def gather(x: torch.Tensor) -> torch.Tensor:  # (total / world, H, D) -> (total, H / world, D), in order
        x = x if world == 1 else AllToAll.apply(x.unsqueeze(0), group, world, True).squeeze(0)
        return x.index_select(0, natural)

    def scatter(x: torch.Tensor) -> torch.Tensor:  # the inverse
        x = x.index_select(0, rows)
        return x if world == 1 else AllToAll.apply(x.unsqueeze(0), group, world, False).squeeze(0)

    out, lse, _ = flash_attn_varlen_func(
        gather(q), gather(k), gather(v), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale=softmax_scale,
        causal=causal, window_size=window, deterministic=deterministic, return_attn_probs=True,
    )  # fmt: skip
    out = scatter(out)
    if not return_lse:
        return out
    return out, scatter(lse.t().unsqueeze(-1)).squeeze(-1).t()
