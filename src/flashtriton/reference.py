"""Standard attention, written plainly: the test oracle and the benchmarks' baseline.

It materialises the (seqlen_q, seqlen_k) score matrix, so it is for checking and comparison,
not for long sequences. The semantics of every option are those of params.py.
"""

from __future__ import annotations

import math
from itertools import pairwise

import torch

from . import dropout
from .mods import Mod, evaluate_score
from .params import AttentionParams


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    compute_dtype: torch.dtype | None = torch.float64,
    *,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    score_mod: Mod | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention by definition: softmax(score) V, and the row log-sum-exp.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim_v), with
    nheads a multiple of nheads_k (GQA). With offset = seqlen_k - seqlen_q (masks aligned
    bottom-right), query i sees key j iff
      i + offset - window_size[0] <= j <= i + offset + window_size[1]  (-1: that side unbounded;
      ``causal`` sets window_size[1] to 0), and ``mask[b, h, i, j]`` if a mask is given:
      bool (batch or 1, nheads or 1, seqlen_q, seqlen_k), True = visible.
    score = softmax_scale * q.k, then softcap * tanh(score / softcap) if softcap > 0, then
      - alibi_slopes[b, h] * |i + offset - j| if alibi_slopes ((nheads,) or (batch, nheads)) is given,
      then score_mod(score, b, h, i, j) if a score_mod (mods.py) is given (autograd differentiates it).
    dropout_mask: bool (batch, nheads, seqlen_q, seqlen_k), True = kept; the kept probabilities are
      scaled by 1 / (1 - dropout_p). Required when dropout_p > 0 (dropout.dropout_mask builds it).
      The lse is that of the probabilities before dropout.
    sinks: (nheads,): each row's softmax has one more logit sinks[h], which takes probability mass and
      multiplies no value (-inf: none).
    Computes in ``compute_dtype`` (None: the inputs' dtype, i.e. "plain PyTorch attention in the
    same dtype") and returns out (batch, seqlen_q, nheads, headdim_v) in that dtype and lse
    (batch, nheads, seqlen_q). Rows that see no key get out = 0 and lse = +inf, as the kernels do (with a
    finite sink: lse = the sink). Differentiable, including through lse, to the sinks too.
    """
    if dropout_p > 0 and dropout_mask is None:
        raise ValueError("dropout_p > 0 needs the keep mask: pass dropout_mask=dropout.dropout_mask(seed, ...)")
    dtype = compute_dtype or q.dtype
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    heads, group = q.shape[2], q.shape[2] // k.shape[2]
    q, k, v = (x.to(dtype).transpose(1, 2) for x in (q, k, v))  # (B, H, N, D)
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)

    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    n_q, n_k = scores.shape[-2:]
    rows = torch.arange(n_q, device=q.device)[:, None]
    cols = torch.arange(n_k, device=q.device)[None, :]
    diagonal = rows + (n_k - n_q)  # the key aligned with each query
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(dtype).reshape(-1, heads, 1, 1)
        scores = scores - slopes * (diagonal - cols).abs().to(dtype)
    if score_mod is not None:
        batch_idx = torch.arange(scores.shape[0], device=q.device)[:, None, None, None]
        head_idx = torch.arange(heads, device=q.device)[:, None, None]
        # a mod reading fp32 tensors promotes; plain attention stays in the inputs' dtype
        scores = evaluate_score(score_mod, scores, batch_idx, head_idx, rows, cols).to(dtype)
    left, right = window_size[0], 0 if causal else window_size[1]
    visible = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
    if left >= 0:
        visible &= cols >= diagonal - left
    if right >= 0:
        visible &= cols <= diagonal + right
    if mask is not None:
        visible = visible & mask
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # the sink's logit, one more column that the probabilities drop below
        column = sinks.to(dtype).view(1, heads, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, column], dim=-1)
    # Rows with no visible key (nor sink): softmax over nothing. Give them finite scores so no NaN reaches
    # autograd, then zero their output and set their lse to +inf.
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)
    scores = scores.masked_fill(empty, 0.0)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse).masked_fill(empty, 0.0)
    if sinks is not None:
        probs = probs[..., :-1]
    if dropout_mask is not None:
        probs = probs.masked_fill(~dropout_mask, 0.0) / (1.0 - dropout_p)
    out = torch.matmul(probs, v).transpose(1, 2)
    lse = lse.masked_fill(empty, float("inf")).squeeze(-1)
    return out, lse


def attention_reference_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    compute_dtype: torch.dtype | None = torch.float64,
    *,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_reference on each sequence of a packed variable-length batch.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim_v); sequence b is
    q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] against k, v[cu_seqlens_k[b]:cu_seqlens_k[b+1]], with its
    own offset. alibi_slopes: (nheads,) or (batch, nheads). With dropout_p > 0, sequence b's keep
    mask is dropout.keep(dropout_seed, b, h, i, j, dropout_p) (i, j within the sequence).
    Returns out (total_q, nheads, headdim_v) and lse (nheads, total_q).
    """
    if dropout_p > 0 and dropout_seed is None:
        raise ValueError("dropout_p > 0 needs the seed the mask is drawn from: pass dropout_seed")
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    heads = torch.arange(q.shape[1], device=q.device)[:, None, None]
    outs, lses = [], []
    for b, ((q0, q1), (k0, k1)) in enumerate(zip(pairwise(starts_q), pairwise(starts_k), strict=True)):
        slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b]
        keep = None
        if dropout_p > 0:
            rows = torch.arange(q1 - q0, device=q.device)[:, None]
            cols = torch.arange(k1 - k0, device=q.device)[None, :]
            batch = torch.tensor(b, device=q.device)
            keep = dropout.keep(dropout_seed, batch, heads, rows, cols, dropout_p)[None]
        out, lse = attention_reference(
            q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], softmax_scale, causal, compute_dtype,
            window_size=window_size, softcap=softcap, alibi_slopes=slopes, dropout_p=dropout_p, dropout_mask=keep,
            sinks=sinks,
        )  # fmt: skip
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def rotary_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotary embedding of x (batch, seqlen, nheads, headdim) at positions (batch, seqlen), in fp32, rounded to x's
    dtype.

    cos, sin: (seqlen_ro, rotary_dim / 2); the first rotary_dim columns turn in pairs by angle (position, f), pair f
    being columns (2f, 2f + 1) if interleaved (GPT-J), else (f, f + rotary_dim / 2) (GPT-NeoX):
    (a, b) -> (a cos - b sin, a sin + b cos). A position outside the table (past it, or negative: cache_seqlens are
    unchecked device values) leaves its row as it is.
    """
    rotary_dim = 2 * cos.shape[1]
    inside = ((positions >= 0) & (positions < cos.shape[0]))[..., None, None]
    at = positions.clamp(min=0, max=cos.shape[0] - 1)
    c = torch.where(inside, cos[at].float()[:, :, None, :], 1.0)
    s = torch.where(inside, sin[at].float()[:, :, None, :], 0.0)
    turned = x[..., :rotary_dim].float()
    if interleaved:
        a, b = turned[..., 0::2], turned[..., 1::2]
        turned = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = turned.chunk(2, dim=-1)
        turned = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return torch.cat((turned.to(x.dtype), x[..., rotary_dim:]), dim=-1)


def dropped_probs(q, k, params: AttentionParams) -> torch.Tensor:
    """The probabilities P (batch, nheads, seqlen_q, seqlen_k) in fp32, negated where dropout drops them, so that
    torch.signbit(probs) is the drop mask exactly (a dropped P of 0 is -0.0).

    Materialised through the reference (attention against V = identity returns P itself), with every option of the
    call, block mask and score_mod included: for testing small inputs. Varlen sequences are zero-padded to
    (max_seqlen_q, max_seqlen_k).
    """
    if not params.varlen:
        batch, heads = torch.arange(q.shape[0], device=q.device), torch.arange(q.shape[2], device=q.device)
        mask = None if params.block_mask is None else params.block_mask.element_mask(b=batch, h=heads)
        return _signed_probs(q, k, params, params.alibi_slopes, mask, first_batch=0)
    starts_q, starts_k = params.cu_seqlens_q.tolist(), params.cu_seqlens_k.tolist()
    shape = (len(starts_q) - 1, q.shape[1], params.max_seqlen_q, params.max_seqlen_k)
    probs = q.new_zeros(shape, dtype=torch.float32)
    for b, ((q0, q1), (k0, k1)) in enumerate(zip(pairwise(starts_q), pairwise(starts_k), strict=True)):
        slopes = None if params.alibi_slopes is None else params.alibi_slopes[b : b + 1]
        probs[b, :, : q1 - q0, : k1 - k0] = _signed_probs(q[None, q0:q1], k[None, k0:k1], params, slopes, None, b)[0]
    return probs


def _signed_probs(q, k, params: AttentionParams, slopes, mask, first_batch: int) -> torch.Tensor:
    """dropped_probs of dense q (batch, n_q, nheads, headdim) against k, whose batch entries are first_batch, ..."""
    batch, n_q, heads, _ = q.shape
    n_k = k.shape[1]
    eye = torch.eye(n_k, device=q.device)[None, :, None, :].expand(batch, n_k, k.shape[2], n_k)
    probs, _ = attention_reference(
        q, k, eye, params.softmax_scale, compute_dtype=torch.float32,
        window_size=(params.window_left, params.window_right), softcap=params.softcap, alibi_slopes=slopes, mask=mask,
        score_mod=params.score_mod, sinks=params.sinks,
    )  # fmt: skip
    probs = probs.transpose(1, 2)  # (batch, heads, n_q, n_k)
    b = torch.arange(first_batch, first_batch + batch, device=q.device)[:, None, None]
    i, j = (torch.arange(n, device=q.device) for n in (n_q, n_k))
    signed = torch.empty(probs.shape, dtype=probs.dtype, device=probs.device)
    for h in range(heads):  # a head at a time: Philox's words are int64 tensors as large as the mask, several at once
        kept = dropout.keep(params.seed, b, h, i[:, None], j, params.dropout_p)
        signed[:, h] = torch.where(kept, probs[:, h], -probs[:, h])
    return signed
