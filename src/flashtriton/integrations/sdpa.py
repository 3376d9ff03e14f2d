"""flashtriton behind F.scaled_dot_product_attention's FlashAttention backend (torch 2.11 and later).

    import flashtriton.integrations.sdpa
    flashtriton.integrations.sdpa.activate()   # every model that calls SDPA now runs flashtriton where SDPA picks flash

torch's flash-impl registry (torch.nn.attention.register_flash_attention_impl / activate_flash_attention_impl) lets a
library replace the CUDA kernels of aten::_scaled_dot_product_flash_attention and its backward. SDPA still decides
which backend a call takes, exactly as before (no attn_mask, fp16 or bf16, head dim up to 256 and a multiple of 8,
causal only with as many queries as keys...); the calls it sends to the FlashAttention backend run flashtriton's
kernels, and every other call falls back where it went before: cuDNN, memory-efficient or math attention, and all
CPU calls (their flash kernel is another op). deactivate() restores torch's own FlashAttention kernels.

The translation: SDPA's (batch, nheads, seqlen, headdim) tensors are read as (batch, seqlen, nheads, headdim) views,
without copies; the output comes back in the query's layout, as the op's meta function (which torch.compile checks)
lays it out: where the query's storage is (batch, seqlen, nheads, headdim), as a model's projections leave it, that
is the kernels' own, and otherwise (a contiguous (batch, nheads, seqlen, headdim) query) a copy. The LSE is
flashtriton's (batch, nheads, seqlen_q) fp32; dropout's Philox key travels in the rng_state slot (two uint64 words, as
the meta function's, the key in the first), so the backward drops the same entries. GQA (enable_gqa) passes K/V with
fewer heads, which the kernels take as they are.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .. import ops
from ..interface import _kernel_inputs, _params
from ..validation import HEAD_DIM_STEP

NAME = "flashtriton"
_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward")


def activate() -> None:
    """Route SDPA's FlashAttention backend to flashtriton (replacing any other activated flash impl)."""
    registry = _registry()
    registry.register_flash_attention_impl(NAME, register_fn=lambda: _Handle(_library("CUDA")))
    registry.activate_flash_attention_impl(NAME)


def deactivate() -> None:
    """Give SDPA's FlashAttention backend back to torch's kernels, if flashtriton holds it."""
    registry = _registry()
    if registry.current_flash_attention_impl() == NAME:
        registry.restore_flash_attention_impl()


def active() -> bool:
    return _registry().current_flash_attention_impl() == NAME


def _registry():
    attention = torch.nn.attention
    if not hasattr(attention, "activate_flash_attention_impl"):
        raise RuntimeError(
            f"torch {torch.__version__} has no flash-impl registry for SDPA (torch.nn.attention."
            "register_flash_attention_impl, torch 2.11 and later): upgrade torch, or call flashtriton.flash_attn_func"
        )
    return attention


class _Handle:
    """Keeps the kernels registered; torch's registry calls remove() to restore its own (dropping the Library
    unregisters them)."""

    def __init__(self, library: torch.library.Library):
        self.library: torch.library.Library | None = library

    def remove(self) -> None:
        self.library = None


def _library(dispatch_key: str) -> torch.library.Library:
    """flashtriton's kernels for SDPA's flash ops under ``dispatch_key`` (CUDA; the tests also take CPU, where the
    ops have no kernel of their own)."""
    library = torch.library.Library("aten", "IMPL")
    library.impl(_OPS[0], _forward, dispatch_key)
    library.impl(_OPS[1], _backward, dispatch_key)
    return library


def _bnhd(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(x.transpose(1, 2) for x in tensors)


def _square_causal(query: torch.Tensor, key: torch.Tensor, is_causal: bool) -> None:
    # SDPA's is_causal is aligned top-left, flashtriton's bottom-right: the same only when the lengths match, the only
    # causal calls SDPA gives its FlashAttention backend
    if is_causal and query.shape[-2] != key.shape[-2]:
        raise ValueError(
            f"is_causal with {query.shape[-2]} queries and {key.shape[-2]} keys: SDPA's top-left causal mask is not "
            "flashtriton's; pass the mask explicitly, or call flashtriton.flash_attn_func (bottom-right)"
        )


def _prepared(query, key, value, dropout_p, is_causal, scale, seed=None):
    """(q, k, v, params) for flashtriton's ops from SDPA's arguments; seed: the forward's dropout key, given to the
    backward (which must not draw another from torch's generator)."""
    _square_causal(query, key, is_causal)
    if query.shape[-1] % HEAD_DIM_STEP:
        raise ValueError(f"head dim {query.shape[-1]}: SDPA's FlashAttention backend takes multiples of 8")
    q, k, v = _bnhd(query, key, value)
    drawn = 0.0 if seed is not None else dropout_p  # (the backward's key is the forward's)
    params = _params(q, k, v, scale, is_causal, (-1, -1), 0.0, None, drawn, False, True, q.shape[0])
    if seed is not None:
        params = replace(params, dropout_p=float(dropout_p), dropout_seed=seed)
    return _kernel_inputs(q, k, v, params)


def _forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    if return_debug_mask:
        raise NotImplementedError("flashtriton's SDPA backend returns no debug attention mask: call deactivate()")
    q, k, v, params = _prepared(query, key, value, dropout_p, is_causal, scale)
    out, lse = ops.forward(q, k, v, params)
    out = out.transpose(1, 2)
    if out.stride() != query.stride():  # the meta function's out is torch.empty_like(query): dense, in its order
        like = torch.empty_like(query)
        if like.stride() != out.stride():
            out = like.copy_(out)
    empty = query.new_empty(0)
    rng_state = torch.zeros(2, dtype=torch.uint64)
    if params.dropout_seed is not None:
        rng_state.view(torch.int64)[:1] = params.dropout_seed
    offset = torch.zeros((), dtype=torch.uint64)
    return out, lse, empty, empty, query.shape[-2], key.shape[-2], rng_state, offset, empty


def _backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
              philox_seed, philox_offset, *, scale=None):  # fmt: skip
    seed = philox_seed.view(torch.int64)[:1] if dropout_p > 0 else None  # the forward's key (_forward)
    q, k, v, params = _prepared(query, key, value, dropout_p, is_causal, scale, seed)
    dout, o = _bnhd(grad_out, out)
    dq, dk, dv, _ = ops.backward(dout, ops._shared_zeros(logsumexp), q, k, v, o, logsumexp, params)
    # _kernel_inputs folded a negative scale's sign into q, or made q zero for a zero scale: the chain rule through it
    if scale is not None and scale < 0:
        dq = -dq
    elif scale == 0:
        dq = torch.zeros_like(dq)
    return _bnhd(dq, dk, dv)
