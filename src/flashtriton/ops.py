"""The attention op as registered torch.library custom ops, with fake (meta) and autograd.

``flashtriton::attention_forward`` and ``flashtriton::attention_backward`` are opaque to
torch.compile, which traces them through their fake implementations (no graph break), and the
autograd formula connects the two. Inputs arrive validated from the public API; these ops only
pick a backend and call its launcher. Plain eager calls run the same two functions through a
torch.autograd.Function instead (``attention`` chooses), skipping the ops' argument dispatch.

Backend: environment variable FLASHTRITON_BACKEND, read at each call:
  auto (default)  Triton kernels for fp16/bf16 CUDA tensors, the PyTorch path for anything else
                  (fp32 included: the kernels' hardware exp2 is approximate, about 4x plain fp32's error)
  triton          Triton kernels (CPU tensors too when TRITON_INTERPRET=1: Triton's interpreter)
  torch           the PyTorch path (torch_backend.py) on any device
"""

from __future__ import annotations

import os
from dataclasses import replace
from types import ModuleType

import torch
from torch.autograd import forward_ad
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import torch_backend
from .block_mask import LIST_FIELDS, BlockMask
from .mods import Mod
from .params import AttentionParams, lse_shape

BACKEND_ENV = "FLASHTRITON_BACKEND"
BACKENDS = ("auto", "triton", "torch")


def _triton_backend() -> ModuleType:
    from . import triton_backend  # imported lazily: triton reads TRITON_INTERPRET at import

    return triton_backend


def select_backend(device: torch.device, dtype: torch.dtype) -> ModuleType:
    """The module (triton_backend or torch_backend) that runs attention for these tensors."""
    name = os.environ.get(BACKEND_ENV, "auto")
    if name not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={name!r} is not a backend: use one of {', '.join(BACKENDS)}")
    if name == "torch" or (name == "auto" and (device.type != "cuda" or dtype == torch.float32)):
        return torch_backend
    backend = _triton_backend()
    if device.type != "cuda" and not backend.interpreting():
        raise ValueError(
            f"{BACKEND_ENV}=triton needs CUDA tensors, or TRITON_INTERPRET=1 set before importing "
            f"flashtriton to run the kernels in Triton's CPU interpreter; got {device.type} tensors"
        )
    return backend


# User mod functions cannot be schema arguments: they travel as registry keys, their tensors as lists.
_FUNCTIONS: dict[str, tuple] = {}


def _register(mod: Mod | None) -> str:
    if mod is None:
        return ""
    key = f"{mod.name}@{id(mod.fn):x}:{id(mod.grad):x}"
    _FUNCTIONS[key] = (mod.fn, mod.grad)
    return key


def _mod(key: str, tensors: list[torch.Tensor]) -> Mod | None:
    if not key:
        return None
    fn, grad = _FUNCTIONS[key]
    return Mod(fn, tuple(tensors), grad)


def _flat(p: AttentionParams, seed: torch.Tensor | None) -> tuple:
    """AttentionParams as the ops' schema arguments, in their order."""
    mask = p.block_mask
    if mask is None:
        sparse, sparse_shape, mask_mod = [], [], None
    else:
        sparse = [getattr(mask, name) for name in LIST_FIELDS]
        sparse = [t if t is not None else mask.kv_num_blocks.new_empty(0) for t in sparse]
        sparse_shape = [mask.seqlen_q, mask.seqlen_k, *mask.block_size]
        mask_mod = mask.mask_mod
    return (
        p.cu_seqlens_q, p.cu_seqlens_k, p.max_seqlen_q, p.max_seqlen_k, p.softmax_scale,
        p.window_left, p.window_right, p.softcap, p.alibi_slopes, p.dropout_p, seed,
        sparse, sparse_shape, _register(mask_mod), list(mask_mod.tensors) if mask_mod else [],
        _register(p.score_mod), list(p.score_mod.tensors) if p.score_mod else [],
    )  # fmt: skip


def _params(
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap,
    alibi_slopes, dropout_p, dropout_seed, sparse, sparse_shape, mask_mod, mask_tensors, score_mod, score_tensors,
) -> AttentionParams:  # fmt: skip
    block_mask = None
    if sparse:
        seqlen_q, seqlen_k, block_m, block_n = sparse_shape
        lists = {name: t if t.numel() else None for name, t in zip(LIST_FIELDS, sparse, strict=True)}
        block_mask = BlockMask(seqlen_q, seqlen_k, (block_m, block_n), **lists, mask_mod=_mod(mask_mod, mask_tensors))
    return AttentionParams(
        softmax_scale=softmax_scale, window_left=window_left, window_right=window_right, softcap=softcap,
        alibi_slopes=alibi_slopes, dropout_p=dropout_p,
        dropout_seed=int(dropout_seed.item()) if dropout_seed is not None else 0,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        block_mask=block_mask, score_mod=_mod(score_mod, score_tensors),
    )  # fmt: skip


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams, with_lse: bool = True):
    """(out, lse), lse None without ``with_lse``."""
    if q.numel() == 0 or k.numel() == 0:
        # nothing to compute, or no key at all: every row is empty
        lse = q.new_full(lse_shape(q, params.varlen), float("inf"), dtype=torch.float32) if with_lse else None
        return torch.zeros_like(q), lse
    return select_backend(q.device, q.dtype).forward(q, k, v, params, with_lse)


def _backward_grads(dout, dlse, q, k, v, out, lse, params: AttentionParams):
    if q.numel() == 0 or k.numel() == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return select_backend(q.device, q.dtype).backward(dout, dlse, q, k, v, out, lse, params)


@torch.library.custom_op("flashtriton::attention_forward", mutates_args=())
def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    dropout_p: float,
    dropout_seed: torch.Tensor | None,
    sparse: list[torch.Tensor],
    sparse_shape: list[int],
    mask_mod: str,
    mask_tensors: list[torch.Tensor],
    score_mod: str,
    score_tensors: list[torch.Tensor],
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out (shaped as q) and the natural-log LSE in fp32 (see _lse_shape); params.py has the semantics."""
    params = _params(
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap,
        alibi_slopes, dropout_p, dropout_seed, sparse, sparse_shape, mask_mod, mask_tensors, score_mod, score_tensors,
    )  # fmt: skip
    return _forward(q, k, v, params)


@attention_forward.register_fake
def _(q, k, v, cu_seqlens_q, *rest):
    return q.new_empty(q.shape), q.new_empty(lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32)


@torch.library.custom_op("flashtriton::attention_backward", mutates_args=())
def attention_backward(
    dout: torch.Tensor,
    dlse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    dropout_p: float,
    dropout_seed: torch.Tensor | None,
    sparse: list[torch.Tensor],
    sparse_shape: list[int],
    mask_mod: str,
    mask_tensors: list[torch.Tensor],
    score_mod: str,
    score_tensors: list[torch.Tensor],
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv; ``deterministic``: in a fixed summation order (AttentionParams.deterministic)."""
    params = _params(
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap,
        alibi_slopes, dropout_p, dropout_seed, sparse, sparse_shape, mask_mod, mask_tensors, score_mod, score_tensors,
    )  # fmt: skip
    return _backward_grads(dout, dlse, q, k, v, out, lse, replace(params, deterministic=deterministic))


@attention_backward.register_fake
def _(dout, dlse, q, k, v, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *flat, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.flat = flat  # the small side tensors (cu_seqlens, slopes, seed) are inputs that need no grad
    ctx.deterministic = deterministic


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    # a caller may use only one of the two outputs
    dout = torch.zeros_like(out) if dout is None else dout
    dlse = torch.zeros_like(lse) if dlse is None else dlse
    dq, dk, dv = attention_backward(dout, dlse, q, k, v, out, lse, *ctx.flat, ctx.deterministic)
    # No gradient for the other inputs, in the structure torch flattened them to: Tensor[] (and any
    # empty list) is a list of leaves, a non-empty int[] is one leaf.
    nones = (
        [None] * len(x) if isinstance(x, list) and (not x or isinstance(x[0], torch.Tensor)) else None for x in ctx.flat
    )
    return dq, dk, dv, *nones, None


attention_forward.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The custom ops' computation and autograd formula without their dispatch: torch.library's
    argument handling (defaults, pytree over the Tensor[] schema) costs about as much host time as a
    small attention call's kernels, so plain eager calls come here; tracing goes through the ops."""

    @staticmethod
    def forward(ctx, q, k, v, params: AttentionParams):
        out, lse = _forward(q, k, v, params)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.params = params
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        # autograd passes zeros for an unused output (materialised grads)
        q, k, v, out, lse = ctx.saved_tensors
        return *_backward_grads(dout, dlse, q, k, v, out, lse, ctx.params), None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    params: AttentionParams,
    dropout_seed: torch.Tensor | None,
    deterministic: bool,
    with_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Differentiable attention: (out, lse); dropout_seed: (1,) int64 CPU tensor, or None. Without ``with_lse``
    a plain eager call that needs no gradient writes no LSE and returns None for it (as SDPA's inference call
    asks for none); every other call has it, as the backward needs it.

    Plain eager tensors take the computation without the ops' dispatch; anything that watches or
    records ops goes through the custom ops: torch.compile / export, torch.jit.trace, a dispatch mode
    (make_fx, FlopCounterMode, checkpoint policies), tensor subclasses (fake, functional tensors).
    """
    traced = torch.compiler.is_compiling() or torch.jit.is_tracing() or _get_current_dispatch_mode() is not None
    if traced or any(type(x) is not torch.Tensor for x in (q, k, v)):
        return attention_forward(q, k, v, *_flat(params, dropout_seed), deterministic)
    if dropout_seed is not None:
        params = replace(params, dropout_seed=int(dropout_seed.item()))
    if deterministic:
        params = replace(params, deterministic=True)
    differentiable = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if not differentiable and forward_ad._current_level < 0:  # dual tensors go to the Function, which refuses them
        with torch.no_grad():  # as in the Function: no gradient reaches ALiBi slopes or a mod's tensors
            return _forward(q, k, v, params, with_lse)  # no autograd node, no saved tensors
    return _EagerAttention.apply(q, k, v, params)
