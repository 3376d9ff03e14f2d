"""Public API, argument-compatible with the ``flash_attn`` package.

Tensors are laid out (batch, seqlen, nheads, headdim), as in flash_attn; swapping
``from flash_attn import flash_attn_func`` for ``from flashtriton import flash_attn_func`` is the
whole migration for the features implemented here. Arguments whose feature is not implemented
yet raise NotImplementedError instead of being ignored.
"""

from __future__ import annotations

import torch

from . import ops
from .validation import check_features, check_qkv, check_tensor, resolve_softmax_scale

_Result = torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]


def _autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under torch.autocast, run in the autocast dtype as other matmul-like ops do."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(x.to(dtype) for x in tensors)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> _Result:
    """Exact attention softmax(softmax_scale * q k^T + mask) v, without materialising the scores.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim).
    nheads must be a multiple of nheads_k (MQA/GQA: query head h reads K/V head
    h // (nheads / nheads_k)). headdim: a multiple of 8 from 8 to 256. dtypes: fp16, bf16, fp32.

    softmax_scale: default 1 / sqrt(headdim).
    causal: query i sees key j iff j <= i + seqlen_k - seqlen_q (aligned bottom-right, as
        flash_attn). A query row that sees no key (possible when seqlen_q > seqlen_k) gets an
        output of 0, an LSE of +inf and gradients of 0.
    deterministic: accepted for compatibility; the backward is always bitwise reproducible.
    return_attn_probs: also return softmax_lse (batch, nheads, seqlen_q) in fp32 (natural log)
        and, in the third slot, None (flash_attn returns probabilities only with dropout, which
        is not implemented yet). Gradients flow through softmax_lse too.
    dropout_p, window_size, softcap, alibi_slopes: only their defaults are implemented yet;
        anything else raises NotImplementedError.

    Returns out: (batch, seqlen_q, nheads, headdim), or (out, softmax_lse, None).
    """
    check_features(dropout_p, window_size, softcap, alibi_slopes)
    check_qkv(q, k, v)
    q, k, v = _autocast(q, k, v)
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
    out, lse = ops.attention_forward(q, k, v, scale, bool(causal), bool(deterministic))
    return (out, lse, None) if return_attn_probs else out


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> _Result:
    """flash_attn_func on qkv: (batch, seqlen, 3, nheads, headdim), no copy of q, k, v."""
    check_tensor("qkv", qkv, 5, "(batch, seqlen, 3, nheads, headdim)")
    if qkv.shape[2] != 3:
        raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(dim=2)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, return_attn_probs,
    )  # fmt: skip


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> _Result:
    """flash_attn_func on q: (batch, seqlen_q, nheads, headdim), kv: (batch, seqlen_k, 2, nheads_k, headdim)."""
    check_tensor("kv", kv, 5, "(batch, seqlen_k, 2, nheads_k, headdim)")
    if kv.shape[2] != 2:
        raise ValueError(f"kv must be (batch, seqlen_k, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    k, v = kv.unbind(dim=2)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, return_attn_probs,
    )  # fmt: skip


_VARLEN_MISSING = "the kernels do not read cu_seqlens (variable-length batches)"
_VARLEN_INSTEAD = "pad the sequences to one length and call flash_attn_func"


def _not_yet(name: str, missing: str, instead: str):
    raise NotImplementedError(f"{name} is not implemented yet: {missing}; for now, {instead}")


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None,
):  # fmt: skip
    """flash_attn's variable-length API on packed (total_tokens, nheads, headdim) tensors."""
    _not_yet("flash_attn_varlen_func", _VARLEN_MISSING, _VARLEN_INSTEAD)


def flash_attn_varlen_qkvpacked_func(
    qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
):  # fmt: skip
    """flash_attn's variable-length API on packed qkv (total_tokens, 3, nheads, headdim)."""
    _not_yet("flash_attn_varlen_qkvpacked_func", _VARLEN_MISSING, _VARLEN_INSTEAD)


def flash_attn_varlen_kvpacked_func(
    q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False,
):  # fmt: skip
    """flash_attn's variable-length API on packed q and kv (total_tokens, 2, nheads_k, headdim)."""
    _not_yet("flash_attn_varlen_kvpacked_func", _VARLEN_MISSING, _VARLEN_INSTEAD)


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
    cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
    window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
    return_softmax_lse=False,
):  # fmt: skip
    """flash_attn's inference API: attention against a KV cache, appending k, v in place."""
    _not_yet(
        "flash_attn_with_kvcache",
        "there is no KV-cache update, cache_seqlens handling or split-KV decoding kernel",
        "concatenate the cache with the new k, v and call flash_attn_func(..., causal=True)",
    )
