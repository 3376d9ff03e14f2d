"""What one attention call computes beyond q, k, v: the options every backend honours.

The public API validates user arguments and builds one ``AttentionParams``; ``schema.py`` carries it through the
custom ops; ``route.py`` reads its derived flags to choose the kernels; each backend's
``forward(q, k, v, params, route)`` and ``backward(dout, dlse, q, k, v, out, lse, params, route)`` implement all of it.

Semantics (per sequence; ``offset = seqlen_k - seqlen_q`` of that sequence, so masks are aligned
bottom-right as in flash_attn):
  window      query i sees key j iff  i + offset - window_left <= j <= i + offset + window_right,
              a bound of -1 being absent. causal is window_right = 0.
  softcap     > 0: score = softcap * tanh(softmax_scale * q.k / softcap); 0: score = softmax_scale * q.k
  alibi       score += -slope[b, h] * |i + offset - j|  (after softcap, as flash_attn)
  dropout     P[b, h, i, j] is kept, and scaled by 1 / (1 - dropout_p), iff
              dropout.keep(seed, b, h, i, j, dropout_p); the LSE is that of the undropped P.
  varlen      q: (total_q, nheads, headdim), k, v: (total_k, nheads_k, headdim); sequence b owns
              rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:cu_seqlens_k[b+1] of
              k, v; i, j above are indices within the sequence; lse is (nheads, total_q).
              Dense: q (batch, seqlen_q, nheads, headdim), lse (batch, nheads, seqlen_q).
  key_pages   varlen only, a block table: k, v are paged caches (num_blocks, page_size, nheads_k, headdim), key j
              of sequence b row j % page_size of page key_pages[b, j // page_size]; ops.forward gathers them into
              packed ones first (forward only)
  block_mask  (dense only, no window) query tile m visits only the key tiles the BlockMask lists for
              it; on its partial tiles, only the scores its mask_mod accepts exist
  score_mod   a user function of the score (mods.py), applied last; its Mod.grad gives the backward
  sinks       (nheads,) fp32: row i of head h has one more logit, sinks[h] (in the units of the scores), which
              takes probability mass and adds no value: LSE_i = log(sum_j exp(score_ij) + exp(sinks[h])),
              O_i = sum_j exp(score_ij - LSE_i) v_j. -inf is no sink. A result with sinks is final: a split-KV or
              ring merge adds the sink once, in one part or after the merge
  lse         natural log, fp32; a row that sees no key has O = 0 and LSE = empty_lse: +inf for a final result
              (flash_attn's: the backward's exp(S - LSE) is then 0), -inf for a partial one that a split-KV or ring
              merge combines by log-sum-exp (an empty part then weighs nothing). With a finite sink the row is not
              empty: O = 0 and LSE = sinks[h] (the sink alone)
  fp32_results  out (forward) and dq, dk, dv (backward) in fp32 instead of the inputs' dtype: partial results that
              a ring merge adds up (distributed/steps.py), rounded once at the end instead of once per part
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

NO_BOUND = -1


@dataclass(frozen=True)
class AttentionParams:
    """One call's options. Each field is one custom-op schema argument (schema.py), or a few for a composite."""

    softmax_scale: float
    window_left: int = NO_BOUND
    window_right: int = NO_BOUND
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None  # (batch, nheads) fp32, contiguous
    dropout_p: float = 0.0
    dropout_seed: torch.Tensor | None = None  # (1,) int64 CPU tensor: a compiled graph takes a new one each call
    cu_seqlens_q: torch.Tensor | None = None  # (batch + 1,) int32
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    key_pages: torch.Tensor | None = None  # (batch, max_blocks) int32 block table: k, v are paged caches (varlen)
    block_mask: Any = None  # block_mask.BlockMask: visit only its tiles, its mask_mod on partial ones
    score_mod: Any = None  # mods.Mod: score = score_mod(score, b, h, i, j, *tensors), after softcap and ALiBi
    deterministic: bool = False  # backward: bitwise reproducible (no atomic sums), where that costs speed
    write_lse: bool = True  # False: an inference call, whose kernels write no LSE (the op returns an empty one)
    empty_lse: float = math.inf  # the LSE of a row that sees no key (module docstring)
    fp32_results: bool = False  # out, dq, dk, dv in fp32 (module docstring)
    # (nheads,) fp32, contiguous. Not compared: layout keys (route._layout_key) take its layout, calls its values
    sinks: torch.Tensor | None = field(default=None, compare=False)

    # Derived flags, each decided here once (plain properties: most calls' params are new each call, so caching
    # them per instance saved little and cost cached_property's lock on every first read).

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def windowed(self) -> bool:
        """Some key is out of sight for some query (causal included)."""
        return self.window_left != NO_BOUND or self.window_right != NO_BOUND

    @property
    def diagonal(self) -> bool:
        """The right bound is the diagonal: causal, or a causal sliding window."""
        return self.window_right == 0

    @property
    def right_only(self) -> bool:
        """Bounded on the right only (causal, or causal shifted): a query row sees a prefix of the keys."""
        return self.window_left == NO_BOUND and self.window_right != NO_BOUND

    @property
    def left_bounded(self) -> bool:
        return self.window_left != NO_BOUND

    @property
    def plain(self) -> bool:
        """No softcap, ALiBi, dropout or score_mod: the scores are scale * q.k."""
        return not (self.softcap > 0 or self.alibi_slopes is not None or self.dropout_p > 0 or self.score_mod)

    @property
    def sparse(self) -> bool:
        return self.block_mask is not None

    @property
    def seed(self) -> int:
        """The dropout seed as the kernels take it (0 without dropout)."""
        return int(self.dropout_seed.item()) if self.dropout_seed is not None else 0

    def result_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of out, dq, dk and dv for inputs of ``dtype``."""
        return torch.float32 if self.fp32_results else dtype

    def span(self, n_q: int, n_k: int) -> int:
        """About how many keys a query row sees: a BlockMask's mean listed keys; the window's width when bounded on
        both sides; half the keys under a right-only bound (rows aligned bottom-right); else all n_k."""
        if self.block_mask is not None:
            return self.block_mask.mean_span()
        if self.window_right == NO_BOUND:
            return n_k
        if self.window_left == NO_BOUND:
            return n_k - min(n_q, n_k) // 2
        return min(n_k, self.window_left + self.window_right + 1)


def lse_shape(q: torch.Tensor, varlen: bool) -> tuple[int, ...]:
    """Dense q (batch, seqlen_q, nheads, headdim): (batch, nheads, seqlen_q); varlen q: (nheads, total_q)."""
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


def final_lse(lse: torch.Tensor, p: AttentionParams) -> torch.Tensor:
    """The LSE as the backwards read it: an empty row's is +inf (exp(S - LSE) = 0), whatever p.empty_lse."""
    return lse if p.empty_lse == math.inf else torch.where(lse == p.empty_lse, math.inf, lse)


def keyless_lse(shape: tuple[int, ...], p: AttentionParams, device: torch.device) -> torch.Tensor:
    """The LSE, shaped as a call's, of rows that see no key: the sink alone, or p.empty_lse where there is none."""
    lse = torch.full(shape, p.empty_lse, dtype=torch.float32, device=device)
    if p.sinks is None:
        return lse
    sinks = p.sinks.view(-1, 1).expand(shape)  # dense (B, H, N_Q) and varlen (H, total_q) alike
    return torch.where(torch.isneginf(sinks), lse, sinks)


def sinks_grad(p: AttentionParams, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor | None:
    """d loss / d sinks (nheads,) fp32, or None without sinks, from the final LSE (final_lse's) and the backward's
    delta = rowsum(dO * O) - dLSE, both shaped as the call's LSE.

    With P_sink = exp(sinks[h] - LSE), dLSE/dsink = P_sink and dO/dsink = -P_sink * O, so each row adds
    P_sink * (dLSE - rowsum(dO * O)) = -P_sink * delta (0 where the row is empty: LSE = +inf).
    """
    if p.sinks is None:
        return None
    heads = lse.dim() - 2  # the head axis: 1 dense, 0 varlen
    terms = torch.exp(p.sinks.view(-1, 1) - lse) * delta
    return -terms.sum(dim=[d for d in range(lse.dim()) if d != heads])
