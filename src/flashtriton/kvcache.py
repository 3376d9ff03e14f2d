"""Attention against a KV cache (flash_attn_with_kvcache): the cache's arguments as one record, the custom op that
appends to the cache in place and attends, and the choice of backend.

Semantics (per sequence b; the public API validates and documents them, params.py has the masks):
  cache rows     a contiguous cache's rows are those of batch row cache_batch_idx[b] (or b); a paged cache's row r is
                 row r % page_size of page block_table[b, r // page_size]; capacity is the rows one sequence may use
  append         k_new[b, j], v_new[b, j] are written to cache row cache_seqlens[b] + j (k_new rotated first)
  keys           cache rows [start, end): start = cache_leftpad[b] (or 0; clamped at 0), end = cache_seqlens[b] +
                 seqlen_new; key j is row start + j, seqlen_k = end - start
  rotary         new key j at position cache_seqlens[b] + j; query i at cache_seqlens[b] + i if rotate_rows, else
                 every query at cache_seqlens[b] (positions index rotary_cos / rotary_sin's rows)

``flashtriton::attention_with_kvcache`` mutates k_cache and v_cache; torch.compile traces it through its fake
implementation. Plain eager calls run the implementation directly, as ops.attention does. There is no backward.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import torch

from . import route, schema
from .cache_args import KVCache
from .ops import NO_LSE, watched
from .params import AttentionParams, lse_shape

_TYPES = {"torch.Tensor": "Tensor", "torch.Tensor | None": "Tensor?", "bool": "bool", "int": "int"}
_MUTATED = {"k_cache": "Tensor(a!)", "v_cache": "Tensor(b!)"}
_CACHE_FIELDS = tuple(f.name for f in dataclasses.fields(KVCache))
_CACHE_SIGNATURE = ", ".join(f"{_MUTATED.get(f.name) or _TYPES[f.type]} {f.name}" for f in dataclasses.fields(KVCache))


_BACKENDS: dict[str, ModuleType] = {}


def _launchers(family: str) -> ModuleType:
    backend = _BACKENDS.get(family)
    if backend is None:
        if family == route.TORCH:
            from . import decode_torch as backend
        else:
            from . import decode_backend as backend  # imported lazily: triton reads TRITON_INTERPRET at import
        _BACKENDS[family] = backend
    return backend


def forward(
    q: torch.Tensor, cache: KVCache, p: AttentionParams, signature: tuple | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, lse) of one call, lse None unless p.write_lse; k_new, v_new appended to the cache first. signature: the
    API's of a plain eager call (replay), under which the call's launches are kept for later calls."""
    r = route.decode(q, cache.capacity, cache.k_cache.shape[2], cache.num_splits, page_size=cache.page_size)
    if r.family == route.NONE:  # an empty batch: nothing to append or attend
        lse = q.new_full(lse_shape(q, False), p.empty_lse, dtype=torch.float32) if p.write_lse else None
        return torch.zeros_like(q, dtype=p.result_dtype(q.dtype)), lse
    backend = _launchers(r.family)
    out, lse = backend.forward(q, cache, p, r)
    if signature is not None and r.family == route.DECODE:
        backend.sign(signature, q, cache, p, r)
    return out, lse


def replay(
    signature: tuple, tensors: dict[str, torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(out, lse) of a plain eager call whose signature an earlier call's launches were kept under, launched again
    with these tensors (q, KVCache's tensor fields by name, None where not given); None where none were kept."""
    backend = _BACKENDS.get(route.DECODE)
    return None if backend is None else backend.replay(signature, tensors)


def _op(q, *values):
    cache = KVCache(*values[: len(_CACHE_FIELDS)])
    out, lse = forward(q, cache, schema.from_schema(values[len(_CACHE_FIELDS) :]))
    return out, lse if lse is not None else q.new_empty(NO_LSE, dtype=torch.float32)


def _fake(q, *values):
    params = schema.from_schema(values[len(_CACHE_FIELDS) :])
    out = q.new_empty(q.shape, dtype=params.result_dtype(q.dtype))
    return out, q.new_empty(lse_shape(q, False) if params.write_lse else NO_LSE, dtype=torch.float32)


attention_with_kvcache_op = torch.library.custom_op(
    "flashtriton::attention_with_kvcache", _op, mutates_args=("k_cache", "v_cache"),
    schema=f"(Tensor q, {_CACHE_SIGNATURE}, {schema.SIGNATURE}) -> (Tensor, Tensor)",
)  # fmt: skip
attention_with_kvcache_op.register_fake(_fake)


def attention_with_kvcache(
    q: torch.Tensor, cache: KVCache, params: AttentionParams, signature: tuple | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, lse), lse None unless params.write_lse; k_new, v_new written into the cache in place. No gradient.

    Anything that watches or records ops (torch.compile, a dispatch mode, tensor subclasses) goes through the
    custom op; plain eager tensors skip its dispatch (signature: forward's)."""
    tensors = (q, cache.k_cache, cache.v_cache)
    if watched(*tensors):
        values = [getattr(cache, name) for name in _CACHE_FIELDS]
        out, lse = attention_with_kvcache_op(q, *values, *schema.to_schema(params))
        return out, lse if params.write_lse else None
    return forward(q, cache, params, signature)
