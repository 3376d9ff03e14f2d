"""flash_attn_with_kvcache's cache arguments as one record (kvcache.py's op takes its fields as schema arguments;
the decode launchers read it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCache:
    """One call's cache arguments. Each field is one schema argument of the op, in this order."""

    k_cache: torch.Tensor  # (batch_cache, seqlen_cache, nheads_k, headdim), or paged (num_blocks, page_size, ...)
    v_cache: torch.Tensor
    k_new: torch.Tensor | None  # (batch, seqlen_new, nheads_k, headdim)
    v_new: torch.Tensor | None
    cache_seqlens: torch.Tensor  # (batch,) int32
    cache_batch_idx: torch.Tensor | None  # (batch,) int32
    cache_leftpad: torch.Tensor | None  # (batch,) int32
    block_table: torch.Tensor | None  # (batch, max_blocks) int32
    rotary_cos: torch.Tensor | None  # (seqlen_ro, rotary_dim / 2), contiguous
    rotary_sin: torch.Tensor | None
    rotary_interleaved: bool
    rotate_rows: bool  # query i rotated at cache_seqlens + i (else all queries at cache_seqlens)
    num_splits: int  # 0: the config table chooses

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def page_size(self) -> int:
        return self.k_cache.shape[1] if self.paged else 0

    @property
    def capacity(self) -> int:
        """Cache rows one sequence may use."""
        return self.block_table.shape[1] * self.page_size if self.paged else self.k_cache.shape[1]

    @property
    def rotary_dim(self) -> int:
        return 0 if self.rotary_cos is None else 2 * self.rotary_cos.shape[1]

    @property
    def seqlen_new(self) -> int:
        return 0 if self.k_new is None else self.k_new.shape[1]
