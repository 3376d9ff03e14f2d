"""What one attention call computes beyond q, k, v: the options every backend honours.

The public API validates user arguments and builds one ``AttentionParams``; the custom ops carry
it as flat schema arguments and rebuild it; each backend's ``forward(q, k, v, params)`` and
``backward(dout, dlse, q, k, v, out, lse, params)`` implement all of it.

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
  block_mask  (dense only, no window) query tile m visits only the key tiles the BlockMask lists for
              it; on its partial tiles, only the scores its mask_mod accepts exist
  score_mod   a user function of the score (mods.py), applied last; its Mod.grad gives the backward
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

NO_BOUND = -1


@dataclass(frozen=True)
class AttentionParams:
    softmax_scale: float
    window_left: int = NO_BOUND
    window_right: int = NO_BOUND
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None  # (batch, nheads) fp32, contiguous
    dropout_p: float = 0.0
    dropout_seed: int = 0
    cu_seqlens_q: torch.Tensor | None = None  # (batch + 1,) int32
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    block_mask: Any = None  # block_mask.BlockMask: visit only its tiles, its mask_mod on partial ones
    score_mod: Any = None  # mods.Mod: score = score_mod(score, b, h, i, j, *tensors), after softcap and ALiBi
    deterministic: bool = False  # backward: bitwise reproducible (no atomic sums), where that costs speed

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def windowed(self) -> bool:
        """Some key is out of sight for some query (causal included)."""
        return self.window_left != NO_BOUND or self.window_right != NO_BOUND

    @property
    def causal(self) -> bool:
        return self.window_left == NO_BOUND and self.window_right == 0


def lse_shape(q: torch.Tensor, varlen: bool) -> tuple[int, ...]:
    """Dense q (batch, seqlen_q, nheads, headdim): (batch, nheads, seqlen_q); varlen q: (nheads, total_q)."""
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
