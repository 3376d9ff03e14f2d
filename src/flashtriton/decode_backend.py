"""Launchers of the split-KV decode kernels (kernels/decode.py): the KV append, the split pass and the combine.

No host read of a device value and no allocation sized by one: every buffer (the fp32 partials of the splits
included) is sized from shapes, so a call can be captured in a CUDA graph. Launch parameters are the route's
kernels.config.DecodeConfig. A decode step's kernels take microseconds, so calls of one layout replay the first one's
allocations and bound launches (launch.Plan), as triton_backend's do.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import route, tables
from .cache_args import KVCache
from .kernels import config
from .kernels.decode import append_kv_kernel, decode_combine_kernel, decode_split_kernel
from .launch import LOG2E, Launcher, Plan, Recorder, RegisterCap, cdiv, hooked, keep, window_bound
from .params import NO_BOUND, AttentionParams

# launch.Launcher skips Triton's per-call argument binding: most of a decode step's host time otherwise
_APPEND, _SPLIT, _COMBINE = map(Launcher, (append_kv_kernel, decode_split_kernel, decode_combine_kernel))

# Replayable calls by layout (_plan_key). A plan holds the decode table's choices when it was recorded: a sweep that
# changes them at run time must clear _PLANS, _SIGNED and route._ROUTES.
_PLANS: dict[tuple, Plan] = {}
# The same plans by the signature of a plain eager call (interface._kvcache_signature), which determines all that
# _plan_key holds while the tables stand: later calls with that signature replay without the checks, the route and
# this key (replay)
_SIGNED: dict[tuple, Plan] = {}
_MAX_SIGNED = 256
_CACHE_TENSORS = tuple(f.name for f in dataclasses.fields(KVCache) if "Tensor" in str(f.type))


def _inputs(q: torch.Tensor, cache: KVCache, p: AttentionParams) -> dict[str, torch.Tensor]:
    """The call's tensors by name, as a Recorder names its launches' slots."""
    tensors = {name: getattr(cache, name) for name in _CACHE_TENSORS}
    tensors.update(q=q, alibi_slopes=p.alibi_slopes, sinks=p.sinks)
    return {name: x for name, x in tensors.items() if x is not None}


def _plan_key(r: route.Route, cache: KVCache, p: AttentionParams, inputs: dict[str, torch.Tensor]) -> tuple | None:
    """What a decode call's launches depend on beyond its tensors' addresses: the route (q's shape, the splits),
    which tensors are given and their layouts (route.tensors_layout), the options and the current device. None where
    launches go through Triton (a launch hook, the interpreter's CPU tensors)."""
    if r.key is None or not inputs["q"].is_cuda or hooked():
        return None
    # (the slopes are a tensor slot: a key keeps their layout, not the tensor)
    params = p if p.alibi_slopes is None else dataclasses.replace(p, alibi_slopes=None)
    layout = route.tensors_layout(inputs.values())
    options = cache.rotary_interleaved, cache.rotate_rows, params
    return r.key, torch.cuda.current_device(), tuple(inputs), layout, options


def _last_dim_contiguous(x: torch.Tensor | None) -> torch.Tensor | None:
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def _rotary(cache: KVCache) -> dict:
    return dict(
        ROT_COS=cache.rotary_cos, ROT_SIN=cache.rotary_sin,
        seqlen_ro=0 if cache.rotary_cos is None else cache.rotary_cos.shape[0],
        ROTARY_DIM=cache.rotary_dim, INTERLEAVED=cache.rotary_interleaved,
    )  # fmt: skip


def _pages(cache: KVCache, cfg: config.DecodeConfig, split: bool = False) -> dict:
    """The paged cache's kernel arguments; the split kernel's also say how it reads the block table (TILE_PAGES: by
    tile, only paged (config.tile_pages); SYNC_TABLE: by plain loads past 2 stages, where they ran faster, DECISIONS
    "Decoding"; the interpreter runs no inline PTX). The append kernel reads an entry per new row."""
    table = cache.block_table
    pages = dict(BLOCK_TABLE=table, stride_tb=0 if table is None else table.stride(0),
                 PAGE_SIZE=max(cache.page_size, 1), CAPACITY=cache.capacity)  # fmt: skip
    if split:
        pages.update(TILE_PAGES=cfg.tile_pages, SYNC_TABLE=cfg.num_stages > 2 and not route.interpreting())
    return pages


def _pdl(cfg: config.DecodeConfig) -> dict:
    """The kernels' PDL flag and the launch option that goes with it (kernels/decode.py's wait_for_previous_grid)."""
    return dict(PDL=cfg.pdl, launch_pdl=cfg.pdl)


def _append(cache: KVCache, cfg: config.DecodeConfig, recorder: Recorder) -> None:
    """k_new (rotated) and v_new into the cache rows cache_seqlens[b] + j, in place."""
    k_new, v_new = _last_dim_contiguous(cache.k_new), _last_dim_contiguous(cache.v_new)
    batch, n_new, heads_k, head_dim = k_new.shape
    grid = (batch * heads_k, cdiv(n_new, cfg.block_n))
    recorder.add(_APPEND.bind(grid)(
        k_new, v_new, cache.k_cache, cache.v_cache, cache.cache_seqlens, cache.cache_batch_idx,
        *k_new.stride()[:3], *v_new.stride()[:3], *cache.k_cache.stride()[:3], *cache.v_cache.stride()[:3],
        N_NEW=n_new, HKV=heads_k, D=head_dim, BLOCK_D=config.block_d(head_dim), BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps, **_pages(cache, cfg), **_rotary(cache), **_pdl(cfg),
    ))  # fmt: skip


def forward(
    q: torch.Tensor, cache: KVCache, p: AttentionParams, r: route.Route
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """out (shaped as q) and the natural-log LSE (batch, nheads, seqlen_q) in fp32, None unless p.write_lse."""
    inputs = _inputs(q, cache, p)
    key = _plan_key(r, cache, p, inputs)
    plan = _PLANS.get(key) if key is not None else None
    if plan is not None:
        made = plan(**inputs)
        return made["out"], made.get("lse")
    recorder = Recorder(**inputs)
    cfg: config.DecodeConfig = r.config
    if cache.k_new is not None:
        _append(cache, cfg, recorder)
    q = _last_dim_contiguous(q)
    batch, n_q, heads, head_dim = q.shape
    heads_k = cache.k_cache.shape[2]
    rows = heads // heads_k * n_q
    out = recorder.empty("out", q.shape, p.result_dtype(q.dtype), q.device)
    lse = recorder.empty("lse", (batch, heads, n_q), torch.float32, q.device) if p.write_lse else None
    if cfg.splits == 1:
        o_split, lse_split, lse_start, empty_lse = out, lse, 0, p.empty_lse
        o_strides = (0, *out.stride()[:3])
        lse_strides = (0, *lse.stride()) if lse is not None else (0, 0, 0, 0)
    else:
        # fp32 partials in one allocation (one fewer per call: a decode step's host time is of the order of its
        # kernels'): O's (split, b, i, h, D), then the LSEs' (split, b, i, h) from element lse_start, so that a
        # final row's partials are one stride apart
        rows_all = batch * n_q * heads
        lse_start = cfg.splits * rows_all * head_dim
        o_split = lse_split = recorder.empty("parts", (lse_start + cfg.splits * rows_all,), torch.float32, q.device)
        o_strides = (rows_all * head_dim, n_q * heads * head_dim, heads * head_dim, head_dim)
        lse_strides = (rows_all, n_q * heads, 1, heads)  # split, b, h, i
        empty_lse = -math.inf  # a partial's: it weighs nothing in the combine
    scale = p.softmax_scale
    softcap = p.softcap > 0 and scale != 0  # at scale 0 every score is 0, capped or not
    n = cache.capacity + n_q
    cap = None if cfg.max_registers is None else RegisterCap(cfg.max_registers)
    recorder.add(_SPLIT.bind((batch * heads_k, cfg.splits, cdiv(rows, cfg.block_m)))(
        q, cache.k_cache, cache.v_cache, o_split, lse_split, cache.cache_seqlens, cache.cache_batch_idx,
        cache.cache_leftpad, p.alibi_slopes, p.sinks if cfg.splits == 1 else None,
        *q.stride()[:3], *cache.k_cache.stride()[:3], *cache.v_cache.stride()[:3], *o_strides, *lse_strides, lse_start,
        N_Q=n_q, N_NEW=cache.seqlen_new, H=heads, HKV=heads_k,
        GROUP=heads // heads_k, SPLITS=cfg.splits, qk_scale=scale * LOG2E,
        softcap=scale / p.softcap if softcap else 0.0,
        window_left=window_bound(p.window_left, n), window_right=window_bound(p.window_right, n),
        rotary_step=int(cache.rotate_rows), empty_lse=empty_lse,
        D=head_dim, BLOCK_D=config.block_d(head_dim), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        LEFT=p.window_left != NO_BOUND, RIGHT=p.window_right != NO_BOUND,
        SOFTCAP=config.softcap_mode(p.softcap, q.dtype) if softcap else 0,
        UPCAST=q.dtype == torch.bfloat16 and route.interpreting(),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cap, **_pages(cache, cfg, split=True),
        **_rotary(cache), **_pdl(cfg),
    ))  # fmt: skip
    if cfg.splits > 1:
        recorder.add(_COMBINE.bind((batch * n_q * heads,))(
            o_split, out, lse, p.sinks, rows_all, n_q, heads, cfg.splits, p.empty_lse,
            D=head_dim, BLOCK_D=config.block_d(head_dim), BLOCK_S=config.next_power_of_2(cfg.splits),
            num_warps=config.DECODE_COMBINE_WARPS, **_pdl(cfg),
        ))  # fmt: skip
    keep(_PLANS, key, recorder)
    return out, lse


def sign(signature: tuple, q: torch.Tensor, cache: KVCache, p: AttentionParams, r: route.Route) -> None:
    """Files the plan of this call, just made, under its signature, if it left one."""
    inputs = _inputs(q, cache, p)
    key = _plan_key(r, cache, p, inputs)
    plan = _PLANS.get(key) if key is not None else None
    if plan is not None:
        tables.put(_SIGNED, signature, plan, _MAX_SIGNED)


def replay(
    signature: tuple, tensors: dict[str, torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(out, lse) of a call with that signature, replayed with these tensors (named as _inputs names them; None for
    those not given), lse None unless the call asked for it; None where no plan has that signature or a launch hook
    is set (a profiler's: its launches must go through Triton)."""
    plan = _SIGNED.get(signature)
    if plan is None or hooked():
        return None
    made = plan(**tensors)
    return made["out"], made.get("lse")
