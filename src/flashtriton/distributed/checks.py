"""The context-parallel API's own input checks (the shared ones are validation.py's): each raises before any
communication, with the fix in its message."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..validation import (
    HEAD_DIM_STEP,
    MAX_HEAD_DIM,
    causal_window,
    check_window,
    host_read,
    resolve_softmax_scale,
)
from .layout import check_divisible, check_layout, document_lengths, world_and_rank


def check_group(group: dist.ProcessGroup | None, q: torch.Tensor) -> None:
    """A group whose backend moves q's tensors: NCCL only moves CUDA tensors."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a group was given but torch.distributed is not initialised: call init_process_group")
        return
    world_and_rank(group)  # refuses a rank outside the group before get_backend does, in torch's own words
    if dist.get_backend(group) == "nccl" and q.device.type != "cuda":
        raise ValueError(f"the group's backend is NCCL, which moves CUDA tensors; q is on {q.device}: use a gloo group")


def check_self_attention(q: torch.Tensor, k: torch.Tensor, seq_dim: int) -> None:
    if q.shape[seq_dim] != k.shape[seq_dim]:
        raise ValueError(
            f"q has {q.shape[seq_dim]} local rows, k and v have {k.shape[seq_dim]}: context parallelism splits one "
            "sequence of queries and keys (self-attention), so each rank's shards must have the same length"
        )


def check_local_rows(rows: int, world: int, layout: str) -> None:
    """The local shard of a sequence of world * rows rows, which the layout must split evenly."""
    check_layout(layout)
    check_divisible(rows * world, world, layout, f"the sequence length ({world} ranks x {rows} local rows)")


def check_varlen_shards(cu_seqlens: torch.Tensor, max_seqlen: int, rows: int, world: int, layout: str) -> list[int]:
    """The documents' global lengths (read on the host once per cu_seqlens tensor), checked against the shards'
    ``rows`` local rows and max_seqlen."""
    lengths = host_read(cu_seqlens, ("lengths", world, layout), lambda cu: document_lengths(cu, world, layout))
    if sum(lengths) != world * rows:
        raise ValueError(
            f"cu_seqlens ends at {sum(lengths)} (its last entry), but {world} ranks x {rows} local rows is "
            f"{world * rows}: pass the global cu_seqlens of the full packed batch"
        )
    if max(lengths, default=0) > max_seqlen:
        raise ValueError(f"max_seqlen {max_seqlen} is below the longest document, {max(lengths)}: pass that")
    return lengths


def ring_scale(softmax_scale: float | None, head_dim: int) -> float:
    """The ring's checks on what its kernels take as they are (flash_attn_func adjusts these for its callers)."""
    if head_dim % HEAD_DIM_STEP or head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"head dim {head_dim}: the ring takes head dims that are multiples of {HEAD_DIM_STEP} up to "
            f"{MAX_HEAD_DIM}; pad q, k, v with zeros to {head_dim + (-head_dim % HEAD_DIM_STEP)} and slice the output"
        )
    scale = resolve_softmax_scale(softmax_scale, head_dim)
    if scale <= 0:
        raise ValueError(f"softmax_scale {scale}: the ring needs a positive scale; negate q for a negative one")
    return scale


def ring_window(window_size, causal: bool, varlen: bool = False) -> tuple[int, bool]:
    """(left bound, causal) of the ring's mask: no window, causal, or a causal sliding window (a left bound, -1 for
    none, with a right bound of 0, which causal=True sets whatever window_size says); other windows raise."""
    left, right = causal_window(check_window(window_size), causal)
    causal = right == 0
    if (left, right) == (-1, -1) or (left == -1 and causal):
        return -1, causal
    if varlen or not causal:
        raise NotImplementedError(
            "the ring takes causal sliding windows (window_size=(left, 0), or causal=True with any window) of dense "
            f"shards only, got window_size={window_size}{' on a packed batch' if varlen else ''}: use "
            "ulysses_flash_attn_func, which takes any window"
        )
    return left, causal
