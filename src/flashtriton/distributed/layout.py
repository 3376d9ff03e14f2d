"""How a sequence is split over the ranks of a context-parallel group, and put back together.

A sequence of length N over ``world`` ranks is cut into equal chunks:

  zigzag      2 * world chunks of N / (2 * world); rank r holds chunks r and 2 * world - 1 - r, in that order.
              Under a causal mask every rank then has the same work: an early chunk (few keys before it) with a
              late one (many).
  contiguous  world chunks of N / world; rank r holds chunk r. Under a causal mask the last rank works most.

A packed varlen batch is split document by document: each document's rows are cut as above and rank r holds its
chunks of every document, documents in order. Its local cu_seqlens are then the global ones divided by world.

The ``split_*`` / ``join_*`` functions are the pure maps (a list with every rank's shard, as a simulation holds
them); ``shard`` / ``unshard`` apply them within a process group. None of them is differentiable: shard inputs
before the model (token ids, positions, labels) and unshard results for checking or logging.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.distributed as dist

ZIGZAG, CONTIGUOUS = "zigzag", "contiguous"
LAYOUTS = (ZIGZAG, CONTIGUOUS)


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not a layout: use one of {', '.join(map(repr, LAYOUTS))}")


def chunks_per_rank(layout: str) -> int:
    return 2 if layout == ZIGZAG else 1


def rank_chunks(world: int, rank: int, layout: str) -> tuple[int, ...]:
    """The indices of the chunks that ``rank`` holds, in the order its shard holds them."""
    return (rank, 2 * world - 1 - rank) if layout == ZIGZAG else (rank,)


def check_divisible(length: int, world: int, layout: str, what: str) -> None:
    """A length the layout splits into equal chunks; the message says how to pad."""
    parts = world * chunks_per_rank(layout)
    if length % parts:
        raise ValueError(
            f"{what} is {length}: the {layout} layout over {world} ranks cuts it into {parts} equal chunks, so it "
            f"must be a multiple of {parts}; pad it to {length + (-length % parts)}"
        )


def world_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(size, this process's rank) of the group; (1, 0) without a process group (torch.distributed not started). A
    rank outside the group is refused (torch numbers it -1)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"rank {dist.get_rank()} is not in the group it passed: call with a group this rank is in")
    return dist.get_world_size(group), rank


_TWO_D_CHECKED: set[tuple[str, str]] = set()  # (ring group, Ulysses group) names found consistent on every rank


def check_two_d(group: dist.ProcessGroup | None, ulysses_group: dist.ProcessGroup) -> None:
    """The 2-D form's groups: a ring group that meets this rank's Ulysses group in this rank alone, made of the ranks
    at one place in their Ulysses groups (so every ring rank holds the same share of the heads). The second part is
    an all-gather over the ring group, once per pair of groups; every rank of it raises alike."""
    if group is None:
        raise ValueError("ulysses_group needs the ring's own group: pass group= (the ranks at this rank's place in "
                         "their Ulysses groups)")  # fmt: skip
    rank = dist.get_rank()
    ring, heads = dist.get_process_group_ranks(group), dist.get_process_group_ranks(ulysses_group)
    if set(ring) & set(heads) != {rank}:
        raise ValueError(
            f"the ring's group {ring} and the Ulysses group {heads} must share this rank ({rank}) and no other: a "
            "ring takes one rank of each Ulysses group"
        )
    key = (group.group_name, ulysses_group.group_name)  # unique in the process, unlike id() once a group is gone
    if key in _TWO_D_CHECKED:
        return
    places = [None] * dist.get_world_size(group)
    dist.all_gather_object(places, dist.get_rank(ulysses_group), group=group)
    if len(set(places)) != 1:
        raise ValueError(
            f"the ring's ranks {ring} sit at places {places} of their Ulysses groups: a ring must take the ranks at "
            "one place (they then hold the same heads)"
        )
    _TWO_D_CHECKED.add(key)


def split(x: torch.Tensor, world: int, layout: str = ZIGZAG, dim: int = 1) -> list[torch.Tensor]:
    """Every rank's shard of the full sequence x (along ``dim``): views for contiguous, copies for zigzag."""
    check_layout(layout)
    check_divisible(x.shape[dim], world, layout, f"the sequence length (dim {dim})")
    chunks = x.chunk(world * chunks_per_rank(layout), dim)
    return [_cat([chunks[c] for c in rank_chunks(world, r, layout)], dim) for r in range(world)]


def join(shards: list[torch.Tensor], layout: str = ZIGZAG, dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard, in rank order (the inverse of ``split``)."""
    check_layout(layout)
    world = len(shards)
    chunks: list[torch.Tensor | None] = [None] * (world * chunks_per_rank(layout))
    for r, x in enumerate(shards):
        for c, part in zip(rank_chunks(world, r, layout), x.chunk(chunks_per_rank(layout), dim), strict=True):
            chunks[c] = part
    return torch.cat(chunks, dim)


def split_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, world: int, layout: str = ZIGZAG) -> list[torch.Tensor]:
    """Every rank's shard of a packed batch x (total, ...): each document split as ``split`` splits a sequence."""
    per_doc = [split(doc, world, layout, dim=0) for doc in _documents(x, cu_seqlens, world, layout)]
    return [_cat([doc[r] for doc in per_doc], 0) if per_doc else x[:0] for r in range(world)]  # (no documents)


def join_varlen(shards: list[torch.Tensor], cu_seqlens: torch.Tensor, layout: str = ZIGZAG) -> torch.Tensor:
    """The packed batch from every rank's shard (the inverse of ``split_varlen``); cu_seqlens are the global ones."""
    world = len(shards)
    lengths = document_lengths(cu_seqlens, world, layout)
    local = [n // world for n in lengths]
    per_rank = [x.split(local, 0) for x in shards]
    if not lengths:  # no documents
        return shards[0][:0]
    return torch.cat([join([parts[d] for parts in per_rank], layout, dim=0) for d in range(len(lengths))], 0)


def document_lengths(cu_seqlens: torch.Tensor, world: int, layout: str) -> list[int]:
    """The documents' global lengths, read on the host: cu_seqlens from 0, never decreasing, each length split
    evenly by the layout."""
    check_layout(layout)
    starts = cu_seqlens.tolist()
    if starts[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 (cumulative document lengths), got cu_seqlens[0] = {starts[0]}")
    lengths = [b - a for a, b in pairwise(starts)]
    for d, n in enumerate(lengths):
        if n < 0:
            raise ValueError(
                f"cu_seqlens must never decrease (cumulative document lengths): cu_seqlens[{d}] = {starts[d]} > "
                f"cu_seqlens[{d + 1}] = {starts[d + 1]}"
            )
        check_divisible(n, world, layout, f"document {d}'s length")
    return lengths


def local_cu_seqlens(cu_seqlens: torch.Tensor, world: int) -> torch.Tensor:
    """A rank's cu_seqlens: each document holds 1 / world of its rows on every rank."""
    return torch.div(cu_seqlens, world, rounding_mode="floor").to(torch.int32)


def shard(
    x: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    layout: str = ZIGZAG,
    dim: int = 1,
    ulysses_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """This rank's shard of the full sequence x along ``dim`` (every rank passes the same x).

    x: (batch, seqlen, ...) for the default dim 1; seqlen must be a multiple of 2 * world (zigzag) or world
    (contiguous). Returns (batch, seqlen / world, ...): a copy for zigzag, a view for contiguous. With an
    ulysses_group (ring_flash_attn_func's 2-D form), ``group`` is the ring's: the ring shard is cut again into the
    Ulysses group's contiguous parts, one per rank of it.
    """
    if ulysses_group is not None:
        check_two_d(group, ulysses_group)
    world, rank = world_and_rank(group)
    x = split(x, world, layout, dim)[rank]
    if ulysses_group is None:
        return x
    parts, part = world_and_rank(ulysses_group)
    return split(x, parts, CONTIGUOUS, dim)[part]


def unshard(
    x: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    layout: str = ZIGZAG,
    dim: int = 1,
    ulysses_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The full sequence from every rank's shard x along ``dim`` (all-gathered; every rank gets it); shard's
    inverse, ulysses_group included."""
    if ulysses_group is not None:
        check_two_d(group, ulysses_group)
        x = unshard(x, ulysses_group, CONTIGUOUS, dim)
    world, _ = world_and_rank(group)
    if world == 1:
        return x
    shards = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(shards, x.contiguous(), group=group)
    return join(shards, layout, dim)


def shard_varlen(
    x: torch.Tensor, cu_seqlens: torch.Tensor, group: dist.ProcessGroup | None = None, layout: str = ZIGZAG
) -> torch.Tensor:
    """This rank's shard of a packed batch x (total, ...) with the global cu_seqlens: each document's length must be
    a multiple of 2 * world (zigzag) or world (contiguous). The shard's cu_seqlens are cu_seqlens // world."""
    world, rank = world_and_rank(group)
    return split_varlen(x, cu_seqlens, world, layout)[rank]


def unshard_varlen(
    x: torch.Tensor, cu_seqlens: torch.Tensor, group: dist.ProcessGroup | None = None, layout: str = ZIGZAG
) -> torch.Tensor:
    """The packed batch from every rank's shard x (all-gathered), cu_seqlens the global ones."""
    world, _ = world_and_rank(group)
    if world == 1:
        return x
    shards = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(shards, x.contiguous(), group=group)
    return join_varlen(shards, cu_seqlens, layout)


def _documents(x: torch.Tensor, cu_seqlens: torch.Tensor, world: int, layout: str) -> list[torch.Tensor]:
    lengths = document_lengths(cu_seqlens, world, layout)
    if sum(lengths) != x.shape[0]:
        raise ValueError(f"cu_seqlens ends at {sum(lengths)}, the packed batch has {x.shape[0]} rows: they must match")
    return list(x.split(lengths, 0))


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)
