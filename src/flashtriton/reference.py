"""Standard attention, written plainly: the test oracle and the benchmarks' baseline.

It materialises the (seqlen_q, seqlen_k) score matrix, so it is for checking and comparison,
not for long sequences.
"""

from __future__ import annotations

import math

import torch


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    compute_dtype: torch.dtype | None = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention by definition: softmax(scale * Q K^T + mask) V, and the row log-sum-exp.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim), with
    nheads a multiple of nheads_k (GQA). ``causal`` aligns the mask bottom-right: query i sees
    key j iff j <= i + seqlen_k - seqlen_q. Computes in ``compute_dtype`` (None: the inputs'
    dtype, i.e. "plain PyTorch attention in the same dtype") and returns
    out (batch, seqlen_q, nheads, headdim) in that dtype and lse (batch, nheads, seqlen_q).
    Rows that see no key get out = 0 and lse = +inf, as the kernels do.
    Differentiable, including through lse.
    """
    dtype = compute_dtype or q.dtype
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[2] // k.shape[2]
    q, k, v = (x.to(dtype).transpose(1, 2) for x in (q, k, v))  # (B, H, N, D)
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)

    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    n_q, n_k = scores.shape[-2:]
    if causal:
        rows = torch.arange(n_q, device=q.device)[:, None]
        cols = torch.arange(n_k, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows + (n_k - n_q), float("-inf"))
    # Rows with no visible key: softmax over nothing. Give them finite scores so no NaN reaches
    # autograd, then zero their output and set their lse to +inf.
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)
    scores = scores.masked_fill(empty, 0.0)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse).masked_fill(empty, 0.0)
    out = torch.matmul(probs, v).transpose(1, 2)
    lse = lse.masked_fill(empty, float("inf")).squeeze(-1)
    return out, lse
