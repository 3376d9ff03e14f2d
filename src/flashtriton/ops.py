"""The attention op: two torch.library custom ops (one schema, schema.py), their fake implementations, and one
autograd formula.

``flashtriton::attention_forward`` and ``flashtriton::attention_backward`` are opaque to torch.compile, which traces
them through their fake implementations (no graph break). Their implementations ask route.py which kernels serve
the call and run that family's launchers. Plain eager calls run the same implementations through a
torch.autograd.Function with the same autograd formula (``attention`` chooses), skipping the ops' argument
dispatch, which costs about as much host time as a small call's kernels; those that one call of ATen's fused CPU
kernel answers whole run that ATen op under torch's own autograd (torch_backend.aten_serves).
"""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise
from types import ModuleType

import torch
from torch.autograd import forward_ad
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.flop_counter import flop_registry, register_flop_formula

from . import reference, route, schema, tables, torch_backend
from .params import AttentionParams, final_lse, keyless_lse, lse_shape, sinks_grad
from .validation import check_cu_seqlens, host_read


def _launchers(family: str) -> ModuleType:
    if family == route.TORCH:
        return torch_backend
    from . import triton_backend  # imported lazily: triton reads TRITON_INTERPRET at import

    return triton_backend


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttentionParams):
    """(out, lse) of one call, lse None unless p.write_lse."""
    if p.varlen:  # values, read on the host once per cu_seqlens tensor; here too for traced calls
        total_k = k.shape[0] if p.key_pages is None else host_read(p.cu_seqlens_k, "values", torch.Tensor.tolist)[-1]
        check_cu_seqlens(p.cu_seqlens_q, p.cu_seqlens_k, q.shape[0], total_k, p.max_seqlen_q, p.max_seqlen_k)
        if p.key_pages is not None:
            k, v, p = _unpaged(k, v, p)
    r = route.forward(q, k, v, p)
    if r.family == route.NONE:
        lse = keyless_lse(lse_shape(q, p.varlen), p, q.device) if p.write_lse else None
        return torch.zeros_like(q, dtype=p.result_dtype(q.dtype)), lse
    return _launchers(r.family).forward(q, k, v, p, r)


def _unpaged(k: torch.Tensor, v: torch.Tensor, p: AttentionParams):
    """k, v's rows that p.key_pages lists for the sequences of p.cu_seqlens_k (checked), packed as a varlen call
    takes them: (total_k, nheads_k, headdim) copies, and p without the block table."""
    starts = host_read(p.cu_seqlens_k, "values", torch.Tensor.tolist)
    lengths = torch.tensor([b - a for a, b in pairwise(starts)], device=k.device)
    sequence = torch.repeat_interleave(torch.arange(len(lengths), device=k.device), lengths, output_size=starts[-1])
    key = torch.arange(starts[-1], device=k.device) - p.cu_seqlens_k.long()[sequence]  # within its sequence
    pages, rows = p.key_pages.long()[sequence, key // k.shape[1]], key % k.shape[1]
    # indexing would wrap a -1 (a common padding entry) to the last page, and an index past the cache faults on CUDA
    outside = host_read(  # which entries the rows read: the page size's and the lengths' choice
        p.key_pages,
        ("outside", *k.shape[:2], *starts),
        lambda _: int(((pages < 0) | (pages >= k.shape[0])).sum()),
    )
    if outside:
        raise ValueError(
            f"block_table lists {outside} page entries outside the cache's {k.shape[0]} pages for the rows the call "
            "reads (cu_seqlens_k): each must be a page index from 0"
        )
    return k[pages, rows], v[pages, rows], replace(p, key_pages=None)


def backward(dout, dlse, q, k, v, out, lse, p: AttentionParams):
    """dq, dk, dv, and dsinks (None without sinks)."""
    r = route.backward(dout, dlse, q, k, v, out, lse, p)
    if r.family == route.NONE:  # out is 0: delta = -dLSE
        dsinks = sinks_grad(p, final_lse(lse, p), -dlse)
        dq, dk, dv = (torch.zeros_like(x, dtype=p.result_dtype(x.dtype)) for x in (q, k, v))
        return dq, dk, dv, dsinks
    return _launchers(r.family).backward(dout, dlse, q, k, v, out, lse, p, r)


NO_LSE = (0,)  # an inference call's LSE slot in the op's schema


def _forward_op(q, k, v, *fields):
    out, lse = forward(q, k, v, schema.from_schema(fields))
    return out, lse if lse is not None else q.new_empty(NO_LSE, dtype=torch.float32)


def _forward_fake(q, k, v, *fields):
    params = schema.from_schema(fields)
    shape = lse_shape(q, params.varlen) if params.write_lse else NO_LSE
    return q.new_empty(q.shape, dtype=params.result_dtype(q.dtype)), q.new_empty(shape, dtype=torch.float32)


NO_SINKS = (0,)  # the sinks' gradient's slot in the backward op's schema, for a call without sinks


def _backward_op(dout, dlse, q, k, v, out, lse, *fields):
    *grads, dsinks = backward(dout, dlse, q, k, v, out, lse, schema.from_schema(fields))
    return *grads, dsinks if dsinks is not None else q.new_empty(NO_SINKS, dtype=torch.float32)


def _backward_fake(dout, dlse, q, k, v, out, lse, *fields):
    params = schema.from_schema(fields)
    sinks = params.sinks
    dsinks = q.new_empty(NO_SINKS if sinks is None else sinks.shape, dtype=torch.float32)
    dq, dk, dv = (x.new_empty(x.shape, dtype=params.result_dtype(x.dtype)) for x in (q, k, v))
    return dq, dk, dv, dsinks


attention_forward = torch.library.custom_op(
    "flashtriton::attention_forward", _forward_op, mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, {schema.SIGNATURE}) -> (Tensor, Tensor)",
)  # fmt: skip
attention_forward.register_fake(_forward_fake)
attention_backward = torch.library.custom_op(
    "flashtriton::attention_backward", _backward_op, mutates_args=(),
    schema=f"(Tensor dout, Tensor dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {schema.SIGNATURE}) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
)  # fmt: skip
attention_backward.register_fake(_backward_fake)


def _probs_op(q, k, *fields):
    return reference.dropped_probs(q, k, schema.from_schema(fields))


def _probs_fake(q, k, *fields):
    batch, n_q, n_k = route.lengths(q, k, schema.from_schema(fields))
    return q.new_empty((batch, q.shape[-2], n_q, n_k), dtype=torch.float32)


# return_attn_probs' probabilities with dropout: an opaque op for traced calls, whose compiler would otherwise fuse
# Philox's ten rounds (dropout.philox) into one expression, which each round's reuse of the last grows exponentially
probabilities = torch.library.custom_op(
    "flashtriton::dropped_probs", _probs_op, mutates_args=(),
    schema=f"(Tensor q, Tensor k, {schema.SIGNATURE}) -> Tensor",
)  # fmt: skip
probabilities.register_fake(_probs_fake)


# FLOPs for torch.utils.flop_counter.FlopCounterMode, counted as it counts SDPA's (its fused kernels' ops): every
# (query, key) pair of the call, those a causal mask, window or block mask hides included; per pair and query head,
# 2 (d + dv) forward (Q K^T, P V) and 2 (3 d + 2 dv) backward (Q K^T again, dO V^T, P^T dO, dS K, dS^T Q), with the head
# dims the kernels take (a head dim not a multiple of 8 padded: interface.py)


def _query_key_pairs(q: torch.Tensor, k: torch.Tensor, p: AttentionParams) -> int:
    """(query, key) pairs of a call: a varlen call's per sequence, from cu_seqlens' values where they are real (in a
    trace, fake: every sequence at max_seqlen, as torch counts a nested SDPA call)."""
    if not p.varlen:
        return q.shape[0] * q.shape[1] * k.shape[1]
    offsets = p.cu_seqlens_q, p.cu_seqlens_k
    if any(type(x) is not torch.Tensor or x.device.type == "meta" for x in offsets):
        return (offsets[0].shape[0] - 1) * p.max_seqlen_q * p.max_seqlen_k
    starts_q, starts_k = (host_read(x, "values", torch.Tensor.tolist) for x in offsets)
    return sum((b - a) * (d - c) for (a, b), (c, d) in zip(pairwise(starts_q), pairwise(starts_k), strict=True))


def _forward_flops(q, k, v, *fields, out_val=None) -> int:
    pairs = _query_key_pairs(q, k, schema.from_schema(fields))
    return 2 * q.shape[-2] * pairs * (q.shape[-1] + v.shape[-1])


def _backward_flops(dout, dlse, q, k, v, out, lse, *fields, out_val=None) -> int:
    pairs = _query_key_pairs(q, k, schema.from_schema(fields))
    return 2 * q.shape[-2] * pairs * (3 * q.shape[-1] + 2 * v.shape[-1])


for _op, _flops in ((torch.ops.flashtriton.attention_forward, _forward_flops),
                    (torch.ops.flashtriton.attention_backward, _backward_flops)):  # fmt: skip
    if _op not in flop_registry:  # a second import of this module (a reload) finds them registered
        register_flop_formula(_op, get_raw=True)(_flops)


# The autograd formula, for the op (traced calls) and the Function (eager calls) alike: _gradients, with the
# backward the caller runs (the backward op on the schema's values, or its implementation on the AttentionParams).


def _gradients(
    ctx, dout, dlse, run_backward, zeros=torch.zeros_like
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dq, dk, dv and dsinks (the backward op's empty slot or None where the call has no sinks)."""
    q, k, v, out, lse = ctx.saved_tensors
    if not lse.numel() and q.numel():
        raise RuntimeError("flashtriton: a call made without an LSE (write_lse=False) has no backward")
    # a caller may use only one of the two outputs
    dout = torch.zeros_like(out) if dout is None else dout
    dlse = zeros(lse) if dlse is None else dlse
    return run_backward(dout, dlse, q, k, v, out, lse)


_ZEROS: dict[tuple, torch.Tensor] = {}
_MAX_ZEROS = 16


def _shared_zeros(x: torch.Tensor) -> torch.Tensor:
    """Zeros shaped as x, one tensor per shape for every eager backward (which only reads dLSE): most calls use out
    alone, and a fill per call would cost the backward a launch. Inside a CUDA-graph capture a fresh one, whose fill
    the graph replays."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return torch.zeros_like(x)
    key = x.shape, x.dtype, x.device
    zeros = _ZEROS.get(key)
    if zeros is None:
        zeros = tables.put(_ZEROS, key, torch.zeros_like(x, memory_format=torch.contiguous_format), _MAX_ZEROS)
    return zeros


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, *fields = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.fields = fields


def _backward(ctx, dout, dlse):
    *grads, dsinks = _gradients(ctx, dout, dlse, lambda *tensors: attention_backward(*tensors, *ctx.fields))
    return *grads, *schema.gradients(ctx.fields, sinks=dsinks)  # none reaches ALiBi slopes or a mod's tensors


attention_forward.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    # forward takes ctx (no separate setup_context): Function.apply then skips binding its arguments by signature,
    # which costs a small call tens of microseconds of host time
    @staticmethod
    def forward(ctx, q, k, v, sinks, params: AttentionParams):  # sinks: params.sinks, an input autograd sees
        out, lse = forward(q, k, v, params)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.params = params
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: _shared_zeros stands for dLSE
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        return *_gradients(ctx, dout, dlse, lambda *tensors: backward(*tensors, ctx.params), _shared_zeros), None


@torch.no_grad()  # a returned tensor for inspection: no gradient reaches the inputs through it (nor a graph kept)
def dropped_probs(q: torch.Tensor, k: torch.Tensor, params: AttentionParams) -> torch.Tensor:
    """reference.dropped_probs, through its custom op where something watches the call (watched)."""
    if watched(q, k):
        return probabilities(q, k, *schema.to_schema(params))
    return reference.dropped_probs(q, k, params)


def watched(*tensors: torch.Tensor) -> bool:
    """Whether something watches or records this call's ops (torch.compile / export, torch.jit.trace, a dispatch mode,
    tensor subclasses such as fake or functional tensors): such calls go through the custom ops, plain eager tensors
    skip their dispatch."""
    traced = torch.compiler.is_compiling() or torch.jit.is_tracing() or _get_current_dispatch_mode() is not None
    return traced or any(type(x) is not torch.Tensor for x in tensors)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams, keep_lse: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Differentiable attention: (out, lse); lse is None when params.write_lse is False (an inference call, which
    must need no gradient; the API asks for it only then), and may be None when keep_lse is False (the caller
    discards it).

    Plain eager tensors take the computation without the ops' dispatch; anything that watches or records ops goes
    through the custom ops: torch.compile / export, torch.jit.trace, a dispatch mode (make_fx, FlopCounterMode,
    checkpoint policies), tensor subclasses (fake, functional tensors). A plain eager call of the PyTorch path that
    ATen's fused CPU kernel answers whole runs that ATen op, under torch's own autograd (torch_backend.aten_serves),
    where the LSE is discarded.
    """
    if watched(q, k, v):
        out, lse = attention_forward(q, k, v, *schema.to_schema(params))
        return out, lse if params.write_lse else None
    dual = forward_ad._current_level >= 0  # the Function refuses duals; so does ATen's op
    causal = None if keep_lse or dual else torch_backend.aten_serves(q, k, v, params)
    if causal is not None and route.forward(q, k, v, params).family == route.TORCH:  # (not the interpreter's kernels)
        return torch_backend.aten_whole(q, k, v, params, causal), None
    sinks = params.sinks
    learning = q.requires_grad or k.requires_grad or v.requires_grad or (sinks is not None and sinks.requires_grad)
    if not (torch.is_grad_enabled() and learning) and not dual:
        with torch.no_grad():  # as in the Function: no gradient reaches ALiBi slopes or a mod's tensors
            return forward(q, k, v, params)  # no autograd node, no saved tensors
    return _EagerAttention.apply(q, k, v, sinks, params)
