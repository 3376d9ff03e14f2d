"""The FlashAttention algorithm in PyTorch ops: the path for CPU tensors (and any device where
the Triton kernels cannot run).

Same algorithm as the kernels, written for readability: the forward walks query tiles and, inside,
the key tiles they can see with an online softmax; the backward recomputes each score tile from
Q, K and the saved LSE. Extra memory is O(N * d + BLOCK_M * BLOCK_N) per (batch, head): no
seqlen_q x seqlen_k matrix is ever allocated. Arithmetic is fp32 whatever the input dtype.

GQA: the GROUP query heads that share a K/V head are stacked along the row axis of each tile, so
one batched matmul serves them all and dK/dV sum over the group without a separate reduction.
"""

from __future__ import annotations

import torch

from .kernels.config import TORCH_BLOCK_M, TORCH_BLOCK_N


def _key_end(m1: int, n_q: int, n_k: int, causal: bool) -> int:
    """One past the last key that query rows < m1 can see (bottom-right causal alignment)."""
    return max(0, min(n_k, m1 + n_k - n_q)) if causal else n_k


def _group_rows(x: torch.Tensor, heads_k: int) -> torch.Tensor:
    """(B, m, H, D) -> (B, HKV, GROUP * m, D): the query heads of one K/V head stacked by rows."""
    b, m, h, d = x.shape
    return x.view(b, m, heads_k, h // heads_k, d).permute(0, 2, 3, 1, 4).reshape(b, heads_k, -1, d)


def _ungroup_rows(x: torch.Tensor, m: int) -> torch.Tensor:
    """Inverse of _group_rows: (B, HKV, GROUP * m, D) -> (B, m, H, D)."""
    b, hk, gm, d = x.shape
    return x.view(b, hk, gm // m, m, d).permute(0, 3, 1, 2, 4).reshape(b, m, -1, d)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """(B, n, HKV, D) -> (B, HKV, n, D) in fp32."""
    return x.transpose(1, 2).float()


def _mask(scores, m0, m1, n0, n1, n_q, n_k, causal):
    """-inf where key > query + offset, for the diagonal tiles only; scores: (B, HKV, GROUP*m, n)."""
    if not causal or n1 - 1 <= m0 + n_k - n_q:
        return scores
    rows = torch.arange(m0, m1, device=scores.device).repeat(scores.shape[2] // (m1 - m0))
    cols = torch.arange(n0, n1, device=scores.device)
    return scores.masked_fill(cols[None, :] > rows[:, None] + (n_k - n_q), float("-inf"))


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, n_q, heads, head_dim = q.shape
    n_k, heads_k = k.shape[1], k.shape[2]
    out = torch.empty(batch, n_q, heads, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads, n_q, dtype=torch.float32, device=q.device)
    for m0 in range(0, n_q, TORCH_BLOCK_M):
        m1 = min(m0 + TORCH_BLOCK_M, n_q)
        q_t = _group_rows(q[:, m0:m1].float(), heads_k) * softmax_scale
        row_max = torch.full(q_t.shape[:-1], float("-inf"), device=q.device)
        row_sum = torch.zeros(q_t.shape[:-1], device=q.device)
        acc = torch.zeros(q_t.shape, device=q.device)
        for n0 in range(0, _key_end(m1, n_q, n_k, causal), TORCH_BLOCK_N):
            n1 = min(n0 + TORCH_BLOCK_N, n_k)
            scores = torch.matmul(q_t, _heads_first(k[:, n0:n1]).transpose(-1, -2))
            scores = _mask(scores, m0, m1, n0, n1, n_q, n_k, causal)
            new_max = torch.maximum(row_max, scores.amax(-1))
            # rows with no visible key yet keep max = -inf; shift them by 0 to avoid inf - inf
            shift = torch.where(torch.isneginf(new_max), 0.0, new_max)
            probs = torch.exp(scores - shift[..., None])
            alpha = torch.exp(row_max - shift)
            row_sum = row_sum * alpha + probs.sum(-1)
            acc = acc * alpha[..., None] + torch.matmul(probs, _heads_first(v[:, n0:n1]))
            row_max = new_max
        empty = row_sum == 0
        out[:, m0:m1] = _ungroup_rows(acc / torch.where(empty, 1.0, row_sum)[..., None], m1 - m0)
        tile_lse = torch.where(empty, float("inf"), row_max + torch.log(row_sum))
        lse[:, :, m0:m1] = tile_lse.view(batch, heads, m1 - m0)
    return out, lse


def backward(
    dout: torch.Tensor,
    dlse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, n_q = q.shape[:2]
    n_k, heads_k = k.shape[1], k.shape[2]
    # delta = rowsum(dO * O) - dLSE; the dLSE term carries gradients through the returned LSE
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2) - dlse
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(batch, heads_k, n_k, k.shape[-1], device=q.device)
    dv = torch.zeros(batch, heads_k, n_k, v.shape[-1], device=q.device)
    for m0 in range(0, n_q, TORCH_BLOCK_M):
        m1 = min(m0 + TORCH_BLOCK_M, n_q)
        q_t = _group_rows(q[:, m0:m1].float(), heads_k)
        do_t = _group_rows(dout[:, m0:m1].float(), heads_k)
        lse_t = lse[:, :, m0:m1].reshape(batch, heads_k, -1, 1)
        delta_t = delta[:, :, m0:m1].reshape(batch, heads_k, -1, 1)
        dq_t = torch.zeros(q_t.shape, device=q.device)
        for n0 in range(0, _key_end(m1, n_q, n_k, causal), TORCH_BLOCK_N):
            n1 = min(n0 + TORCH_BLOCK_N, n_k)
            k_t, v_t = _heads_first(k[:, n0:n1]), _heads_first(v[:, n0:n1])
            scores = torch.matmul(q_t, k_t.transpose(-1, -2)) * softmax_scale
            scores = _mask(scores, m0, m1, n0, n1, n_q, n_k, causal)
            # recompute P from the saved LSE; rows with no visible key have lse = +inf, so P = 0
            probs = torch.exp(scores - lse_t)
            dv[:, :, n0:n1] += torch.matmul(probs.transpose(-1, -2), do_t)
            dscores = probs * (torch.matmul(do_t, v_t.transpose(-1, -2)) - delta_t)
            dq_t += torch.matmul(dscores, k_t)
            dk[:, :, n0:n1] += torch.matmul(dscores.transpose(-1, -2), q_t)
        dq[:, m0:m1] = _ungroup_rows(dq_t * softmax_scale, m1 - m0)
    dk = (dk * softmax_scale).to(k.dtype).transpose(1, 2).contiguous()
    return dq, dk, dv.to(v.dtype).transpose(1, 2).contiguous()
