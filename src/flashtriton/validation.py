"""Checks on user input, run by the public API before anything is launched.

Each raises ValueError or TypeError whose message says what to change.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM, HEAD_DIM_STEP = 8, 256, 8


def check_tensor(name: str, x: object, ndim: int, layout: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims {layout}, got shape {tuple(x.shape)}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, 4, "(batch, seqlen, nheads, headdim)")
    _check_same("dtype", q, k, v, lambda x: x.dtype)
    _check_same("device", q, k, v, lambda x: x.device)
    if q.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"q, k, v have dtype {q.dtype}: supported dtypes are {names}; cast the inputs")
    if k.shape != v.shape:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape (batch, seqlen_k, nheads_k, headdim)"
        )
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q has batch {q.shape[0]}, k and v have batch {k.shape[0]}: they must match")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q has head dim {q.shape[3]}, k and v have {k.shape[3]}: they must match")
    check_head_dim(q.shape[3])
    heads, heads_k = q.shape[2], k.shape[2]
    if heads_k == 0 or heads % heads_k != 0:
        raise ValueError(
            f"k and v have {heads_k} heads, q has {heads}: q heads must be a positive multiple of k heads (MQA/GQA)"
        )


def _check_same(what: str, q, k, v, get) -> None:
    if not get(q) == get(k) == get(v):
        raise ValueError(f"q, k, v must share one {what}; got {get(q)}, {get(k)}, {get(v)}")


def check_head_dim(head_dim: int) -> None:
    if not (MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM and head_dim % HEAD_DIM_STEP == 0):
        raise ValueError(
            f"head dim {head_dim} is not supported: use a multiple of {HEAD_DIM_STEP} from "
            f"{MIN_HEAD_DIM} to {MAX_HEAD_DIM} (pad the head dim with zeros if needed)"
        )


def resolve_softmax_scale(softmax_scale: float | None, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale}")
    return float(softmax_scale)


def check_features(dropout_p: float, window_size, softcap: float, alibi_slopes) -> None:
    """Arguments of flash_attn's signature whose features are not implemented yet."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0.0:
        raise NotImplementedError("dropout_p > 0 is not implemented yet: pass dropout_p=0.0")
    if len(window_size) != 2 or any(w < -1 for w in window_size):
        raise ValueError(f"window_size must be (left, right) with each >= -1, got {window_size}")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(
            "local attention (window_size != (-1, -1)) is not implemented yet: pass window_size=(-1, -1)"
        )
    if softcap < 0.0:
        raise ValueError(f"softcap must be >= 0 (0 disables it), got {softcap}")
    if softcap > 0.0:
        raise NotImplementedError("softcap > 0 is not implemented yet: pass softcap=0.0")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes is not implemented yet: pass alibi_slopes=None")
