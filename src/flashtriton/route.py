"""Which kernels serve a call: the one place that decides, from the parameters, the tensors and the GPU.

``forward`` and ``backward`` return a ``Route``: the kernel family and its table config, which ops.py hands to that
family's launchers. The families:

  none      no query or no key: nothing to compute (out 0, every row empty)
  torch     the PyTorch tiled path (torch_backend.py): CPU tensors, fp32, FLASHTRITON_BACKEND=torch
  portable  the Triton kernels of kernels/forward.py and kernels/backward.py: every feature, every GPU, the interpreter
  hopper    the Gluon kernels of kernels/hopper (sm90): plain dense, causal or causal sliding-window self-attention
            of any length, and dense cross-attention without a mask, sinks or not, in any layout TMA reads (strides
            of 16-byte multiples, the last 1); the backward either fused (dK/dV adding dQ up in fp32) or as a pair
            (dQ, then dK/dV: a fixed summation order)
  decode    flash_attn_with_kvcache's split-KV kernels of kernels/decode.py (route.decode, at the end of this file)

Backend (environment variable FLASHTRITON_BACKEND, read at each call):
  auto (default)  Triton kernels for fp16/bf16 CUDA tensors, the PyTorch path for anything else
                  (fp32 included: the kernels' hardware exp2 is approximate, about 4x plain fp32's error)
  triton          Triton kernels (CPU tensors too when TRITON_INTERPRET=1: Triton's interpreter)
  torch           the PyTorch path on any device

tests/test_route.py keeps the routes of a fixed set of calls in tests/route_table.txt, so a change in routing shows
as a diff of that file.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from . import autotune, tables
from .kernels import config, triton_compat
from .params import AttentionParams

BACKEND_ENV = "FLASHTRITON_BACKEND"
BACKENDS = ("auto", "triton", "torch")

NONE, TORCH, PORTABLE, HOPPER, DECODE = "none", "torch", "portable", "hopper", "decode"
FUSED, PAIR = "fused", "pair"


@dataclass(frozen=True)
class Route:
    family: str  # NONE, TORCH, PORTABLE, HOPPER or DECODE
    config: Any = None  # kernels.config's row for the family (None for none and torch)
    dq: str = ""  # the Hopper backward's dQ: FUSED or PAIR
    key: tuple | None = field(default=None, compare=False)  # the call's layout key, where launches may be replayed

    def __str__(self) -> str:
        return " ".join(filter(None, (self.family, self.dq, _describe(self.config))))


def _describe(cfg: Any) -> str:
    if cfg is None:
        return ""
    fields = (f"{k}={v}" for k, v in vars(cfg).items() if isinstance(v, (int, str)) and v is not False)
    return ",".join(fields)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    from triton import knobs  # imported here: triton reads TRITON_INTERPRET at import

    return bool(knobs.runtime.interpret)


def _backend(device: torch.device, dtype: torch.dtype) -> str:
    """TORCH or "triton" for these tensors, by FLASHTRITON_BACKEND."""
    name = os.environ.get(BACKEND_ENV, "auto")
    if name not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={name!r} is not a backend: use one of {', '.join(BACKENDS)}")
    if name == "torch" or (name == "auto" and (device.type != "cuda" or dtype == torch.float32)):
        return TORCH
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"{BACKEND_ENV}=triton needs CUDA tensors, or TRITON_INTERPRET=1 set before importing "
            f"flashtriton to run the kernels in Triton's CPU interpreter; got {device.type} tensors"
        )
    return "triton"


def merge_backend(device: torch.device, dtype: torch.dtype) -> str:
    """TORCH or "triton" for the ring's fp32 merges and adds (distributed/merge.py) of a ring whose inputs are
    ``dtype``: as its attention calls go (an fp32 ring keeps torch's exact exp in its merges, and its adds with them:
    the sums are the same either way)."""
    return _backend(device, dtype)


def arch(device: torch.device) -> str:
    """The kernel tables' name for the GPU: "sm90" (Hopper), "cuda" (any other), "interpreter". The Gluon kernels
    build on private Triton APIs, checked against the tested Triton: on another, the portable kernels serve Hopper."""
    if interpreting():
        return "interpreter"
    return "sm90" if _major(device) == 9 and triton_compat.PRIVATE_API_OK else "cuda"


@functools.cache
def _major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]  # a few microseconds a call: read once per device


def run_dtype(dtype: torch.dtype, gpu: str | None = None) -> torch.dtype:
    """The dtype the kernels compute in: Triton 3.6's interpreter computes bf16 tl.dot wrongly, so fp32 there."""
    interpreter = interpreting() if gpu is None else gpu == "interpreter"
    return torch.float32 if dtype == torch.bfloat16 and interpreter else dtype


def lengths(q: torch.Tensor, k: torch.Tensor, p: AttentionParams) -> tuple[int, int, int]:
    """batch and the (longest) query / key lengths of (B, N, H, D) tensors, or of a varlen batch."""
    if p.varlen:
        return p.cu_seqlens_q.shape[0] - 1, p.max_seqlen_q, p.max_seqlen_k
    return q.shape[0], q.shape[1], k.shape[1]


def tma_fits(x: torch.Tensor, block_d: int) -> bool:
    """A (B, N, H, D) tensor, as the kernels see it (a copy if its last stride is not 1), reads as the 2D
    (B * N, H * D) view in TMA tiles of [rows, block_d]: D a power of two (a tile's columns are exactly one head),
    heads packed, batches back to back, base and row stride 16-byte aligned, fewer than 2**31 rows (int32
    coordinates)."""
    if x.dim() == 3:  # varlen (total, H, D) runs as one batch row
        x = x.unsqueeze(0)
    batch, n, heads, d = x.shape
    copied = x.stride(-1) != 1
    row, batch_stride = (heads * d, n * heads * d) if copied else (x.stride(1), x.stride(0))
    return (
        d == block_d
        and (copied or x.stride(2) == d)
        and row >= heads * d
        and (batch == 1 or batch_stride == n * row)
        and row * x.element_size() % 16 == 0
        and (copied or x.data_ptr() % 16 == 0)
        and batch * n < 2**31
    )


def strided_tma_fits(x: torch.Tensor) -> bool:
    """A (B, N, H, D) tensor, as the kernels see it (a copy if its last stride is not 1), reads through a rank-4 TMA
    descriptor of its own strides (the Gluon kernels'): D up to 256 in rows of 16-byte multiples, base and strides
    16-byte aligned and not 0 (a dim of size 1 has no stride that matters)."""
    size = x.element_size()
    if not (x.shape[-1] <= 256 and x.shape[-1] * size % 16 == 0):
        return False
    if x.stride(-1) != 1:
        return True  # the kernels read a contiguous copy
    return x.data_ptr() % 16 == 0 and all(
        n == 1 or (stride > 0 and stride * size % 16 == 0)
        for n, stride in zip(x.shape[:-1], x.stride()[:-1], strict=True)
    )


def _cu_seqlens(p: AttentionParams) -> list[int] | None:
    """A varlen self-attention batch's cu_seqlens as validation read them to the host (never a new read), or None
    where they were not read or queries and keys differ."""
    from .validation import host_read_cached

    found_q, starts_q = host_read_cached(p.cu_seqlens_q, "values")
    found_k, starts_k = host_read_cached(p.cu_seqlens_k, "values")
    return starts_q if found_q and found_k and starts_q == starts_k else None


def whole_sequences(p: AttentionParams, n: int, tile: int) -> bool:
    """Every sequence is a whole number of ``tile`` rows (varlen: as far as the host knows)."""
    if not p.varlen:
        return n % tile == 0
    starts = _cu_seqlens(p)
    return starts is not None and all(start % tile == 0 for start in starts)


def _lse_entries(q: torch.Tensor, p: AttentionParams) -> int:
    """How many LSE entries the Gluon backward's aligned rows hold, at most (triton_backend._aligned_rows)."""
    batch = p.cu_seqlens_q.shape[0] - 1 if p.varlen else q.shape[0]
    return math.prod(q.shape[:-1]) + q.shape[-2] * (batch + 1) * config.LSE_ROWS_ALIGN


def _starts_aligned(p: AttentionParams, tile: int) -> bool:
    """Every varlen sequence starts at a multiple of ``tile`` rows (the last may end anywhere)."""
    starts = _cu_seqlens(p)
    return starts is not None and all(start % tile == 0 for start in starts[:-1])


def hopper_fits(p: AttentionParams, *tensors: torch.Tensor) -> bool:
    """The Gluon kernels' scope: plain dense, causal or causal sliding-window self-attention (varlen: the same
    cu_seqlens for queries and keys, known to the host), and dense attention without a mask whose keys (k, v:
    tensors 1 and 2) are of another length than the queries (cross-attention), in layouts TMA reads (tensors: q, k,
    v and any more, (B, N, H, D) or varlen)."""
    q = tensors[0]
    n = q.shape[-3]
    # (not yet a ring step's fp32 partial results: that path has not run on a GPU with two lengths)
    keys_apart = not p.varlen and not p.windowed and not p.fp32_results
    return (
        p.plain
        and not p.sparse
        and (p.diagonal or not p.windowed)
        and all(
            (x.shape[-3] == n or (keys_apart and i in (1, 2))) and strided_tma_fits(x) for i, x in enumerate(tensors)
        )
        and _lse_entries(q, p) < 2**31  # the kernels' offsets into the LSE and delta are 32-bit
        and (not p.varlen or _cu_seqlens(p) is not None)
    )


# Routes of calls whose launches may be replayed (launch.Plan), by layout: a small call's host time is otherwise
# about its GPU time, and the decision below is a good part of it.
_ROUTES: dict[tuple, Route] = {}
_MAX_ROUTES = 256


def _layout_key(kind: str, p: AttentionParams, tensors: tuple[torch.Tensor, ...]) -> tuple | None:
    """What every choice between a call's arguments and its launches depends on (shapes, strides, dtypes, 16-byte
    alignment, which arguments are one tensor, the device, the options, the backend and autotune variables), for
    dense CUDA calls with the features the Gluon kernels take; None for any other call (decided afresh each time)."""
    q = tensors[0]
    if q.device.type != "cuda" or p.varlen or not p.plain or p.sparse:
        return None
    where = q.device, torch.cuda.current_device(), os.environ.get(BACKEND_ENV), autotune.enabled()
    if p.sinks is not None:  # p compares without it (params.py): its layout is the key's, its values each call's
        tensors = (*tensors, p.sinks)
    return kind, p, *where, tensors_layout(tensors)


def tensors_layout(tensors) -> tuple:
    """What launches read of these tensors beyond their addresses: shapes, strides, dtypes, 16-byte alignment, and
    which of them are one tensor."""
    layout = tuple((x.shape, x.stride(), x.dtype, x.data_ptr() % 16 == 0) for x in tensors)
    ids = [id(x) for x in tensors]
    return layout, tuple(map(ids.index, ids))


def _remembered(key: tuple | None, decide) -> Route:
    route = _ROUTES.get(key) if key is not None else None
    if route is None:
        route = decide()
        if key is not None:
            route = tables.put(_ROUTES, key, replace(route, key=key), _MAX_ROUTES)
    return route


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttentionParams, gpu: str | None = None) -> Route:
    """The forward's route. ``gpu``: route for that arch's kernel tables instead of q's device (tests)."""
    key = _layout_key("forward", p, (q, k, v)) if gpu is None else None
    return _remembered(key, lambda: _forward(q, k, v, p, gpu))


def backward(dout, dlse, q, k, v, out, lse, p: AttentionParams, gpu: str | None = None) -> Route:
    """The backward's route (dout, out shaped as q; dlse, lse as the forward's LSE)."""
    key = _layout_key("backward", p, (dout, dlse, q, k, v, out, lse)) if gpu is None else None
    return _remembered(key, lambda: _backward(q, k, v, out, dout, p, gpu))


@dataclass(frozen=True)
class _Call:
    gpu: str
    dtype: torch.dtype  # as the kernels compute (run_dtype)
    head_dim: int
    span: int  # keys a query row sees (AttentionParams.span)


def _triton_call(q: torch.Tensor, k: torch.Tensor, p: AttentionParams, gpu: str | None) -> Route | _Call:
    """The route when no kernel runs (nothing to compute, or the PyTorch path); else what the kernel tables read."""
    if q.numel() == 0 or k.numel() == 0:
        return Route(NONE)
    if gpu is None and _backend(q.device, q.dtype) == TORCH:
        return Route(TORCH)
    gpu = gpu or arch(q.device)
    _, n_q, n_k = lengths(q, k, p)
    return _Call(gpu, run_dtype(q.dtype, gpu), q.shape[-1], p.span(n_q, n_k))


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttentionParams, gpu: str | None) -> Route:
    call = _triton_call(q, k, p, gpu)
    if isinstance(call, Route):
        return call
    gpu, dtype, head_dim, span = call.gpu, call.dtype, call.head_dim, call.span
    cfg = config.hopper_forward_config(gpu, head_dim, dtype, banded=p.windowed, span=span, left_bounded=p.left_bounded)
    # a varlen sequence that ends inside a tile has its last rows of O stored from registers: 256 wide they spill
    if (
        cfg is not None
        and hopper_fits(p, q, k, v)
        and (config.hopper_width(head_dim) <= 128 or whole_sequences(p, 0, cfg.rows))
    ):
        return Route(HOPPER, cfg)
    return Route(PORTABLE, config.forward_config(gpu, head_dim, dtype, span, p.plain))


def _backward(q, k, v, out, dout, p: AttentionParams, gpu: str | None) -> Route:
    call = _triton_call(q, k, p, gpu)
    if isinstance(call, Route):
        return call
    gpu, dtype, head_dim, span = call.gpu, call.dtype, call.head_dim, call.span
    cfg = config.hopper_backward_config(gpu, head_dim, dtype)
    if cfg is not None and hopper_fits(p, q, k, v, dout, out):
        # the fused dQ sums (in fragment order) take each varlen sequence's tiles at whole-tile rows: its start
        aligned = not p.varlen or _starts_aligned(p, cfg.block_m)
        if not p.deterministic and span >= cfg.fused_span and aligned:
            return Route(HOPPER, cfg, FUSED)  # one pass, dQ's shares added up in no fixed order
        if cfg.dq is not None:
            return Route(HOPPER, cfg, PAIR)
    portable = config.backward_config(
        gpu, head_dim, dtype, span=span, windowed=p.left_bounded, causal=p.right_only, varlen=p.varlen,
        sparse=p.sparse,
    )  # fmt: skip
    return Route(PORTABLE, portable)


def decode(
    q: torch.Tensor,
    capacity: int,
    heads_k: int,
    num_splits: int,
    gpu: str | None = None,
    sms: int | None = None,
    page_size: int = 0,
) -> Route:
    """The route of a KV-cache call: q (batch, seqlen_q, nheads, headdim) against caches of ``capacity`` rows per
    sequence and ``heads_k`` K/V heads, in pages of ``page_size`` rows (0: contiguous); ``num_splits`` the caller's
    (0: the table chooses). ``gpu``, ``sms``: route
    for that arch's table and SM count instead of q's device (tests). Remembered by shape: a decode step's host time
    is of the order of its kernels'."""
    if gpu is not None or sms is not None:
        return _decode(q, capacity, heads_k, num_splits, gpu, sms, page_size)
    key = "decode", q.shape, q.dtype, q.device, capacity, heads_k, num_splits, page_size, os.environ.get(BACKEND_ENV)
    return _remembered(key, lambda: _decode(q, capacity, heads_k, num_splits, gpu, sms, page_size))


def _decode(q, capacity: int, heads_k: int, num_splits: int, gpu: str | None, sms: int | None, page_size: int) -> Route:
    if q.numel() == 0:
        return Route(NONE)
    if gpu is None and _backend(q.device, q.dtype) == TORCH:
        return Route(TORCH)
    gpu = gpu or arch(q.device)
    if sms is None:
        sms = config.INTERPRETER_SMS if gpu == "interpreter" else sm_count(q.device)
    batch, n_q, heads, head_dim = q.shape
    rows = heads // heads_k * n_q
    cfg = config.decode_config(
        gpu, head_dim, run_dtype(q.dtype, gpu), rows, batch * heads_k, capacity, sms, num_splits, page_size
    )
    return Route(DECODE, cfg)


@functools.cache
def sm_count(device: torch.device) -> int:
    """The GPU's SM count, read once per device."""
    return torch.cuda.get_device_properties(device).multi_processor_count
