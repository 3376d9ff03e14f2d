"""Public API, argument-compatible with the ``flash_attn`` package.

Tensors are laid out (batch, seqlen, nheads, headdim), as in flash_attn; swapping
``from flash_attn import flash_attn_func`` for ``from flashtriton import flash_attn_func`` is the
whole migration for the features implemented here. Arguments whose feature is not implemented
yet raise NotImplementedError instead of being ignored.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import torch.nn.functional as F

from . import dropout, kvcache, ops, route, tables
from .block_mask import BlockMask, create_block_mask, mask_dims
from .cache_args import KVCache
from .mods import Mod, as_mod, check_differentiable
from .params import AttentionParams
from .validation import (
    HEAD_DIM_STEP,
    causal_window,
    check_alibi_slopes,
    check_cache_seqlens,
    check_dropout,
    check_flag,
    check_kvcache,
    check_qkv,
    check_sinks,
    check_softcap,
    check_tensor,
    check_varlen,
    check_window,
    resolve_softmax_scale,
)

_Result = torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]


def _bounded_by(window_size, seqlen_k: int, seqlen_q: int) -> tuple[int, int]:
    """check_window's (left, right) as flash_attn's C++ resolves them (seqlen_q, seqlen_k: varlen's maxima, a
    cache's capacity): a bound of seqlen_k keys or more is none (-1), before anything else; then, beside a left
    bound, no right bound is one of seqlen_k keys, which hides keys from the first queries where seqlen_q >
    seqlen_k + 1 (kept as none elsewhere, where it hides nothing: the call then routes as it did before)."""
    left, right = (-1 if w >= seqlen_k else w for w in check_window(window_size))
    if left >= 0 and right < 0 and seqlen_q > seqlen_k + 1:
        right = seqlen_k
    return left, right


def _autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under torch.autocast, run in the autocast dtype as other matmul-like ops do (anything but tensors as given:
    the checks after say what is wrong)."""
    if not all(isinstance(x, torch.Tensor) for x in tensors):
        return tensors
    device_type = tensors[0].device.type
    if not _autocasting(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(x.to(dtype) for x in tensors)


def _autocasting(device_type: str) -> bool:
    """Whether torch.autocast is on for the device type; never for meta tensors, whose device it does not serve
    (asking raises; other devices it does not serve raise torch's error). Not torch.amp.is_autocast_available:
    torch 2.11's dynamo cannot trace it, and a traced call asks too."""
    return device_type != "meta" and torch.is_autocast_enabled(device_type)


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
    *,
    block_mask: BlockMask | None = None,
    mask_mod: Mod | None = None,
    score_mod: Mod | None = None,
    sinks: torch.Tensor | None = None,
    learnable_sink: torch.Tensor | None = None,
) -> _Result:
    """Exact attention softmax(score) v, without materialising the scores.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim).
    nheads must be a multiple of nheads_k (MQA/GQA: query head h reads K/V head
    h // (nheads / nheads_k)). headdim: 1 to 256; one that is not a multiple of 8 runs zero-padded up
    to one (a padded copy of q, k, v, as flash_attn; out is then a view of the padded output). dtypes:
    fp16, bf16, fp32.

    Masks are aligned bottom-right, as in flash_attn: with offset = seqlen_k - seqlen_q,
    causal: query i sees key j iff j <= i + offset.
    window_size (left, right): query i sees key j iff i + offset - left <= j <= i + offset + right;
        -1 leaves that side unbounded; causal=True sets right to 0. Key tiles outside the band
        are skipped, not masked. A tuple, list or integer tensor of two (read on the host). As in
        flash_attn's C++, a bound of seqlen_k or more counts as -1, and a right -1 beside a left
        bound as seqlen_k (which hides keys from the first queries when seqlen_q > seqlen_k + 1).
    A query row that sees no key gets an output of 0, an LSE of +inf and gradients of 0.

    softmax_scale: default 1 / sqrt(headdim) (the headdim passed, not a padded one); score = softmax_scale * q.k.
        Any finite value, 0 and negative ones included (those cost a copy of q, which takes the sign:
        the kernels take a positive scale).
    softcap: > 0 replaces the score by softcap * tanh(score / softcap) (0 disables it).
    alibi_slopes: (nheads,) or (batch, nheads) fp32; adds -slope * |i + offset - j| to the score.
    dropout_p: drop each attention probability with this probability (and scale the kept ones by
        1 / (1 - dropout_p)); the mask comes from a counter-based RNG keyed by a seed drawn from
        torch's default generator, so torch.manual_seed reproduces it, and the backward
        regenerates it instead of storing it. Use 0.0 for evaluation.
    deterministic: True makes the backward bitwise reproducible. False (default) lets it add dQ's shares
        up in fp32 with atomic TMA reductions where that is faster (the Hopper kernels, long
        sequences), so dq may differ in its last bits between runs; dk and dv repeat either way.
    block_mask: a flashtriton.BlockMask (create_block_mask / BlockMask.from_layout): only its tiles
        are visited, forward and backward, and its mask_mod is applied on its partial tiles; work
        is proportional to the tiles visited. Not combined with causal, window_size or alibi_slopes:
        express those in the mask (causal_mask, sliding_window_mask, and_masks).
    mask_mod: a @triton.jit mask_mod(b, h, q_idx, kv_idx, *tensors) or a flashtriton.Mod; without a
        block_mask one is made from it with create_block_mask (default 128 x 128 tiles), per batch
        entry and per head where the mask reads b or h (one for all where it does not).
    score_mod: a @triton.jit score_mod(score, b, h, q_idx, kv_idx, *tensors) or a Mod, applied to the
        score last (after softcap and ALiBi); gradients need Mod(fn, tensors, grad=dfn). A score of -inf
        hides its key, as a mask does (a row left with none gets out 0 and LSE +inf, or sinks[h]); the grad
        must be finite there (0).
    sinks: (nheads,) floating (fp32; bf16 and fp16 are cast), learnable attention sinks (gpt-oss): each
        query row's softmax has one more logit, sinks[h], in the units of the scores (after the scale),
        which takes probability mass and adds no value, so the row's weights sum to less than 1. The LSE
        includes it; a row that sees no key gets out 0 and LSE sinks[h]; -inf is no sink. Gradients flow
        to it (fp32, summed over batch and rows). learnable_sink: the same, by flash_attn 4's name (which
        transformers passes to a flash_attn-style function whose signature has it); pass one of the two.
    return_attn_probs: also return softmax_lse (batch, nheads, seqlen_q) in fp32 (natural log;
        gradients flow through it) and, with dropout, the attention probabilities P (batch, nheads,
        seqlen_q, seqlen_k) in fp32, negated where dropped (torch.signbit(probs) is the drop mask),
        materialised by the reference: for testing small inputs. None in that slot without dropout.
        flash_attn's S_dmask differs: q's dtype, seqlen_q and seqlen_k each rounded up to 128, and
        unnormalised, exp(score - m) with m the row's running max when its kernel reached that key
        tile (so its values depend on that kernel's tile size); its tests rescale it by
        exp(m - lse) into this P. Without dropout it returns an empty tensor in that slot.

    Returns out: (batch, seqlen_q, nheads, headdim), or (out, softmax_lse, probs).
    """
    plain = None  # (a trace reads no table: it would guard on it)
    if not torch.compiler.is_compiling() and alibi_slopes is None and block_mask is None and mask_mod is None:
        plain = _plain_key(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                           return_attn_probs, score_mod, sinks, learnable_sink)  # fmt: skip
        params = None if plain is None else _PLAIN.get(plain)
        if params is not None:
            return _attention(q, k, v, params, return_attn_probs)
    q, k, v = _autocast(q, k, v)  # first: autocast may hand over q, k, v in different dtypes (a rotary in fp32)
    check_qkv(q, k, v)
    sinks = _one_sink(sinks, learnable_sink)
    window = _bounded_by(window_size, k.shape[1], q.shape[1])
    masks = _masks(q, k, v, block_mask, mask_mod, score_mod, causal, window, alibi_slopes, sinks)
    params = _params(
        q, k, v, softmax_scale, causal, window, softcap, alibi_slopes, dropout_p, deterministic,
        return_attn_probs, q.shape[0], sinks=sinks, **masks,
    )  # fmt: skip
    if plain is not None:
        tables.put(_PLAIN, plain, params, _MAX_PLAIN)
    return _attention(q, k, v, params, return_attn_probs)


# Validated parameters of plain flash_attn_func calls (_plain_key): a tiny call's host time is mostly the checks
_PLAIN: dict[tuple, AttentionParams] = {}
_MAX_PLAIN = 64
_NUMBER = (int, float)


def _plain_key(
    q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs, score_mod,
    sinks, learnable_sink,
) -> tuple | None:  # fmt: skip
    """Everything the checks and AttentionParams read of a plain call (plain tensors, no dropout, masks, mods, sinks
    or ALiBi, options as Python numbers), whose params then depend on nothing else; None for any other call, and
    for calls under autocast (which changes the tensors first)."""
    if not (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor):
        return None  # (subclasses: fake and functional tensors, which a trace hands over)
    if score_mod is not None or sinks is not None or learnable_sink is not None:
        return None
    if not _plain_options(softmax_scale, causal, window_size, softcap) or type(dropout_p) not in _NUMBER or dropout_p:
        return None
    if type(deterministic) is not bool:  # (the checks read it: check_flag)
        return None
    if _autocasting(q.device.type):
        return None
    grads = torch.is_grad_enabled() and (q.requires_grad, k.requires_grad, v.requires_grad)
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, softmax_scale,
            causal, tuple(window_size), softcap, bool(deterministic), bool(return_attn_probs), grads)  # fmt: skip


def _plain_options(softmax_scale, causal, window_size, softcap) -> bool:
    """Whether these options are Python values of the types a cached call's key compares as the checks read them:
    a bool causal, window_size a tuple or list of ints, numbers (None: the default scale)."""
    if type(causal) is not bool or type(window_size) not in (tuple, list) or type(softcap) not in _NUMBER:
        return False
    return (softmax_scale is None or type(softmax_scale) in _NUMBER) and all(type(w) is int for w in window_size)


def _one_sink(sinks: torch.Tensor | None, learnable_sink: torch.Tensor | None) -> torch.Tensor | None:
    """The sinks, given by either name."""
    if learnable_sink is None:
        return sinks
    if sinks is not None:
        raise ValueError("pass sinks or learnable_sink (flash_attn 4's name for the same logits), not both")
    return learnable_sink


def _masks(q, k, v, block_mask, mask_mod, score_mod, causal, window: tuple[int, int], alibi_slopes, sinks) -> dict:
    """The block mask (made from mask_mod when needed) and score_mod, checked against the inputs and the window
    (check_window's)."""
    masks = {}
    if score_mod is not None:
        masks["score_mod"] = as_mod(score_mod, "score_mod")
        learning = (q, k, v) if sinks is None else (q, k, v, sinks)  # the sinks' gradient needs dP too
        if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in learning):
            check_differentiable(masks["score_mod"])
    if block_mask is None and mask_mod is None:
        return masks
    if check_flag("causal", causal) or window != (-1, -1) or alibi_slopes is not None:
        raise ValueError(
            "block_mask / mask_mod do not combine with causal, window_size or alibi_slopes: put the causal or "
            "window mask into the block mask (and_masks(causal_mask(), ...)) and ALiBi into a score_mod"
        )
    batch, n_q, heads, _ = q.shape
    if block_mask is None:  # over the batch and heads the mask reads, which its tiles may differ by
        mod = as_mod(mask_mod, "mask_mod")
        dims = (None, None) if torch.compiler.is_compiling() else mask_dims(mod, batch, heads, q.device)
        block_mask = create_block_mask(mod, *dims, n_q, k.shape[1], device=q.device)
    elif mask_mod is not None:
        raise ValueError("pass either block_mask or mask_mod: a BlockMask already carries its mask_mod")
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a flashtriton.BlockMask, got {type(block_mask).__name__}")
    block_mask.check_matches(batch, heads, n_q, k.shape[1], q.device)
    masks["block_mask"] = block_mask
    return masks


def _params(
    q, k, v, softmax_scale, causal, window: tuple[int, int], softcap, alibi_slopes, dropout_p, deterministic,
    return_attn_probs, batch, gradients: bool = True, sinks=None, **extra,
) -> AttentionParams:  # fmt: skip
    """Validated user options as the AttentionParams every backend takes (window: check_window's). gradients: False
    for a call with no backward (its LSE only if asked for)."""
    left, right = causal_window(window, causal)
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
    check_softcap(softcap, scale)
    check_dropout(dropout_p)
    slopes = None if alibi_slopes is None else check_alibi_slopes(alibi_slopes, batch, q.shape[-2], q.device)
    if sinks is not None:
        sinks = check_sinks(sinks, q.shape[-2], q.device)
    watched = (q, k, v) if sinks is None else (q, k, v, sinks)
    needs_grad = gradients and torch.is_grad_enabled() and any(x.requires_grad for x in watched)
    return AttentionParams(
        softmax_scale=scale, window_left=left, window_right=right,
        softcap=float(softcap), alibi_slopes=slopes, dropout_p=float(dropout_p),
        dropout_seed=dropout.draw_seed() if dropout_p > 0 else None,
        deterministic=check_flag("deterministic", deterministic),
        write_lse=bool(return_attn_probs) or needs_grad,  # an inference call writes no LSE, as SDPA's asks for none
        sinks=sinks, **extra,
    )  # fmt: skip


def _attention(q, k, v, params: AttentionParams, return_attn_probs: bool) -> _Result:
    head_dim = q.shape[-1]
    q, k, v, params = _kernel_inputs(q, k, v, params)
    out, lse = ops.attention(q, k, v, params, keep_lse=return_attn_probs)
    if out.shape[-1] != head_dim:
        out = out[..., :head_dim]
    if not return_attn_probs:
        return out
    return out, lse, ops.dropped_probs(q, k, params) if params.dropout_p > 0 else None


def _kernel_inputs(q, k, v, params: AttentionParams):
    """(q, k, v, params) as the kernels take them, for the same attention: softmax_scale > 0 (their running max is
    max(q.k) * scale), a negative scale's sign moved into q and a zero scale made q = 0 at scale 1 (exact: IEEE
    products are sign-symmetric); the head dim zero-padded up to a multiple of HEAD_DIM_STEP (zeros add nothing to
    q.k; the caller slices out's extra columns off, and F.pad's backward slices the gradients)."""
    scale = params.softmax_scale
    if scale < 0:
        q, params = -q, replace(params, softmax_scale=-scale)
    elif scale == 0:
        q, params = q * 0, replace(params, softmax_scale=1.0)
    pad = -q.shape[-1] % HEAD_DIM_STEP
    if pad:
        q, k, v = (F.pad(x, (0, pad)) for x in (q, k, v))
    return q, k, v, params


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
    *,
    sinks: torch.Tensor | None = None,
) -> _Result:
    """flash_attn_func on qkv: (batch, seqlen, 3, nheads, headdim), no copy of q, k, v."""
    check_tensor("qkv", qkv, 5, "(batch, seqlen, 3, nheads, headdim)")
    if qkv.shape[2] != 3:
        raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(dim=2)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, return_attn_probs, sinks=sinks,
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
    *,
    sinks: torch.Tensor | None = None,
) -> _Result:
    """flash_attn_func on q: (batch, seqlen_q, nheads, headdim), kv: (batch, seqlen_k, 2, nheads_k, headdim)."""
    check_tensor("kv", kv, 5, "(batch, seqlen_k, 2, nheads_k, headdim)")
    if kv.shape[2] != 2:
        raise ValueError(f"kv must be (batch, seqlen_k, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    k, v = kv.unbind(dim=2)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, return_attn_probs, sinks=sinks,
    )  # fmt: skip


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    *,
    sinks: torch.Tensor | None = None,
    learnable_sink: torch.Tensor | None = None,
) -> _Result:
    """flash_attn_func on a packed batch of sequences of different lengths, with no work on padding.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim). Sequence b is
    q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] against k, v[cu_seqlens_k[b]:cu_seqlens_k[b+1]].
    cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32, starting at 0, non-decreasing, ending at the
    packed length. max_seqlen_q, max_seqlen_k: at least the longest sequence (they size the grid).
    Masks, offsets and dropout indices are per sequence (see flash_attn_func), but window_size resolves against
    max_seqlen_k (flash_attn's C++): a bound of max_seqlen_k or more is none, and beside a left bound a right -1 is
    max_seqlen_k (it hides keys in sequence b when seqlen_q_b > max_seqlen_k + 1); alibi_slopes may be
    (batch, nheads); sinks (or learnable_sink) are flash_attn_func's. Returns out (total_q, nheads, headdim), or (out,
    softmax_lse (nheads, total_q), probs (batch, nheads, max_seqlen_q, max_seqlen_k) or None).

    block_table: (batch, max_blocks) int32, paged prefill: k, v are then paged caches (num_blocks, page_size,
    nheads_k, headdim), any page size, and sequence b's key j is row j % page_size of page
    block_table[b, j // page_size]; cu_seqlens_k still gives the key lengths. The pages a call reads are gathered
    into packed rows (a copy of those rows, not of the cache; under autocast, a cache in another dtype is cast whole
    first); head dims multiples of 8; no backward and no dropout (an inference call). The entries the call reads
    must be page indices of the cache (checked on the host once per block_table and lengths).
    """
    q, k, v = _autocast(q, k, v)
    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table)
    sinks = _one_sink(sinks, learnable_sink)
    window = _bounded_by(window_size, int(max_seqlen_k), int(max_seqlen_q))
    varlen = dict(
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=int(max_seqlen_q),
        max_seqlen_k=int(max_seqlen_k),
    )  # fmt: skip
    if block_table is not None:
        if dropout_p:
            raise ValueError("block_table (paged prefill) is for inference: pass dropout_p=0.0")
        varlen["key_pages"] = block_table
    batch = cu_seqlens_q.shape[0] - 1
    params = _params(
        q, k, v, softmax_scale, causal, window, softcap, alibi_slopes, dropout_p, deterministic,
        return_attn_probs, batch, sinks=sinks, **varlen,
    )  # fmt: skip
    watched = (q, k, v) if params.sinks is None else (q, k, v, params.sinks)
    if block_table is not None and torch.is_grad_enabled() and any(x.requires_grad for x in watched):
        raise ValueError(
            "block_table (paged prefill) has no backward, as in flash_attn: call it under torch.no_grad() or pass "
            "tensors that do not require grad"
        )
    return _attention(q, k, v, params, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    sinks: torch.Tensor | None = None,
) -> _Result:
    """flash_attn_varlen_func on qkv: (total, 3, nheads, headdim), one cu_seqlens for q and k."""
    check_tensor("qkv", qkv, 4, "(total, 3, nheads, headdim)")
    if qkv.shape[1] != 3:
        raise ValueError(f"qkv must be (total, 3, nheads, headdim), got {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(dim=1)
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal, window_size,
        softcap, alibi_slopes, deterministic, return_attn_probs, sinks=sinks,
    )  # fmt: skip


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    sinks: torch.Tensor | None = None,
) -> _Result:
    """flash_attn_varlen_func on q: (total_q, nheads, headdim), kv: (total_k, 2, nheads_k, headdim)."""
    check_tensor("kv", kv, 4, "(total_k, 2, nheads_k, headdim)")
    if kv.shape[1] != 2:
        raise ValueError(f"kv must be (total_k, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    k, v = kv.unbind(dim=1)
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, return_attn_probs, sinks=sinks,
    )  # fmt: skip


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of q against a KV cache, after appending k, v to it in place: flash_attn's inference API.

    q: (batch, seqlen_q, nheads, headdim), seqlen_q >= 1 (1 when decoding one token).
    k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), or with block_table a paged cache
        (num_blocks, page_size, nheads_k, headdim) of any page size; last dim contiguous. nheads a multiple of
        nheads_k (MQA/GQA), headdim 1 to 256, dtypes fp16, bf16, fp32, all one dtype.
    k, v: (batch, seqlen_new, nheads_k, headdim) or None: written into the cache rows cache_seqlens[b] + j, in place.
    cache_seqlens: int, or (batch,) int32: rows of each sequence's cache already filled (the append starts there).
        Required with k, v; None: every sequence uses the whole cache.
    cache_batch_idx: (batch,) int32: the cache's batch row of each sequence (default b); not with block_table.
        Duplicate rows with k, v: any one sequence's rows are written.
    cache_leftpad: (batch,) int32: each sequence's keys start at that cache row (default 0; a negative one counts
        as 0).
    block_table: (batch, max_blocks) int32: sequence b's cache row r lives in page block_table[b, r // page_size] at
        row r % page_size; capacity = max_blocks * page_size rows per sequence (seqlen_cache without pages).

    Sequence b attends to cache rows [cache_leftpad[b], cache_seqlens[b] + seqlen_new): key j is row
    cache_leftpad[b] + j and seqlen_k is that range's length; causal, window_size and alibi_slopes are
    flash_attn_func's (aligned bottom-right, offset = seqlen_k - seqlen_q). A window bound of capacity or more counts
    as none, and beside a left bound a right -1 as the capacity (flash_attn's; it hides keys from the first queries
    when seqlen_q > capacity + 1). A query row that sees no key gets out 0 and LSE +inf.
    rotary_cos, rotary_sin: (seqlen_ro >= capacity, rotary_dim / 2) in q's dtype, rotary_dim even and at most
        headdim; only with k, v. The new key j is rotated at position cache_seqlens[b] + j; the queries, under
        causal or a window, at cache_seqlens[b] + i, otherwise all at cache_seqlens[b] (flash_attn's rule: positions
        are cache rows, cache_leftpad does not shift them). rotary_interleaved: pairs columns (2i, 2i + 1) (GPT-J);
        False pairs (i, i + rotary_dim / 2) (GPT-NeoX). Computed in fp32, rounded to the dtype.
    softmax_scale, softcap: as flash_attn_func.
    num_splits: programs that share each sequence's keys (their partial results merged by log-sum-exp); 0 chooses
        from the shapes and the GPU's SM count, 1 is one pass. At most 128, and at most the cache's key tiles.
    return_softmax_lse: also return the LSE (batch, nheads, seqlen_q), fp32, natural log.
    sinks: (nheads,) learnable attention sinks, as flash_attn_func's (not in flash_attn): a row that sees no key gets
        out 0 and LSE sinks[h].

    Values of tensor arguments (cache_seqlens, cache_batch_idx, cache_leftpad, block_table) are never read on the
    host, so a call captures in a CUDA graph (the Triton path; the PyTorch path reads them, and refuses entries it
    would use outside the cache before writing); they are therefore not validated: rows they place outside the cache
    are neither written nor read, and a page index past num_blocks is the caller's error. An int cache_seqlens is
    checked against the capacity; an append longer than the cache is refused either way. No gradient flows.

    Returns out (batch, seqlen_q, nheads, headdim), or (out, softmax_lse).
    """
    signature = _kvcache_signature(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
        (softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse,
         sinks),
    )  # fmt: skip
    if signature is not None:
        made = kvcache.replay(signature, dict(
            q=q, k_cache=k_cache, v_cache=v_cache, k_new=k, v_new=v, cache_seqlens=cache_seqlens,
            cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
            rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        ))  # fmt: skip
        if made is not None:
            return made if return_softmax_lse else made[0]
    capacity = check_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table, num_splits
    )
    seqlen_new = 0 if k is None else k.shape[1]
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("k, v are appended at cache_seqlens: pass cache_seqlens (an int or (batch,) int32)")
        cache_seqlens = capacity
    check_cache_seqlens(cache_seqlens, q, seqlen_new, capacity)
    if not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    # flash_attn's: a bound of capacity or more is none, and rotary turns the queries row by row only under a bound
    window = _bounded_by(window_size, capacity, q.shape[1])
    params = _params(
        q, k_cache, v_cache, softmax_scale, causal, window, softcap, alibi_slopes, 0.0, False, return_softmax_lse,
        q.shape[0], gradients=False, sinks=sinks,
    )  # fmt: skip
    cache = KVCache(
        k_cache, v_cache, k, v, *map(_contiguous, (cache_seqlens, cache_batch_idx, cache_leftpad, block_table)),
        _contiguous(rotary_cos), _contiguous(rotary_sin), bool(rotary_interleaved),
        rotate_rows=params.window_left >= 0 or params.window_right >= 0, num_splits=int(num_splits),
    )  # fmt: skip
    out, lse = kvcache.attention_with_kvcache(q, cache, params, signature)
    return (out, lse) if return_softmax_lse else out


def _contiguous(x: torch.Tensor | None) -> torch.Tensor | None:
    return x if x is None or x.is_contiguous() else x.contiguous()


def _kvcache_signature(
    q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
    options: tuple,
) -> tuple | None:  # fmt: skip
    """What a plain eager flash_attn_with_kvcache call's checks, route and launches depend on: each tensor's layout
    (route.tensors_layout: shapes, strides, dtypes, alignment, which are one tensor) and device, the current device,
    the backend variable, and the options (as Python values, ALiBi and sinks not given); the call's launches are kept
    under it (kvcache.replay). None for any other call: a traced or watched one, subclasses, an int or default
    cache_seqlens (made a tensor per call), index or rotary tensors that are not contiguous (copied per call: a
    replay would pass the caller's in the copy's place)."""
    softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits, lse, sinks = options
    if alibi_slopes is not None or sinks is not None or type(cache_seqlens) is not torch.Tensor:
        return None
    if not _plain_options(softmax_scale, causal, window_size, softcap):
        return None
    if type(rotary_interleaved) is not bool or type(lse) is not bool or type(num_splits) is not int:
        return None
    tensors = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
               block_table)  # fmt: skip
    given = [x for x in tensors if x is not None]
    if any(type(x) is not torch.Tensor for x in given) or ops.watched():
        return None
    copied = (rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table)  # by _contiguous
    if not all(x is None or x.is_contiguous() for x in copied):
        return None
    where = torch.cuda.current_device() if q.is_cuda else None, os.environ.get(route.BACKEND_ENV)
    present = tuple(x is not None for x in tensors)
    layout = route.tensors_layout(given), tuple(x.device for x in given)
    values = softmax_scale, causal, tuple(window_size), softcap, rotary_interleaved, num_splits, lse
    return present, layout, where, values
