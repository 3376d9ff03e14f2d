"""Launchers: torch tensors in, Triton kernels run, torch tensors out.

Inputs are (batch, seqlen, heads, head_dim) with any strides whose last one is 1; outputs are
new contiguous tensors. Launch parameters come from kernels.config's tables or, for the forward with
FLASHTRITON_AUTOTUNE=1, from autotune.py's choice among config's candidates.
"""

from __future__ import annotations

import functools
import math

import torch
from triton.experimental.gluon import language as gl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import autotune, dropout, route, schedule
from .block_mask import BlockMask
from .kernels import config, hopper
from .kernels.backward import (
    attention_backward_dkdv_kernel,
    attention_backward_dq_convert_kernel,
    attention_backward_dq_kernel,
    attention_backward_preprocess_kernel,
)
from .kernels.forward import attention_forward_kernel
from .launch import LOG2E, Descriptor, Launcher, Plan, Recorder, cdiv, hooked, keep, window_bound
from .params import NO_BOUND, AttentionParams, final_lse, lse_shape, sinks_grad

_GRID_Y = 65535  # CUDA's largest grid along y and z


def _heads_grid(tiles: int, batch: int, heads: int) -> tuple[int, int, int]:
    """The grid (tiles, Y, Z) of Y * Z == batch * heads (batch, head) programs (kernels/common.head_program): all on y
    where they fit, else split exactly over y and z, a whole number of heads on y."""
    programs = batch * heads
    if programs <= _GRID_Y:
        return tiles, programs, 1
    for z in range(cdiv(programs, _GRID_Y), min(batch, _GRID_Y) + 1):
        if batch % z == 0 and programs // z <= _GRID_Y:
            return tiles, programs // z, z
    raise ValueError(
        f"batch {batch} x heads {heads} is more (batch, head) programs than the kernels' grid takes: split the batch"
    )


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get true fp32 products (not tf32): the user asked for fp32 accuracy.
    return "ieee" if dtype == torch.float32 else "tf32"


def _strides(x: torch.Tensor, varlen: bool = False) -> tuple[int, int, int]:
    """(batch, seq, head) strides of a (B, N, H, D) tensor; varlen batches share one row (stride 0)."""
    return 0 if varlen else x.stride(0), x.stride(1), x.stride(2)


def _kernel_view(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the kernels read it: in ``dtype``, its last dim contiguous, (B, N, H, D); varlen (total, H, D)
    tensors run as one batch row (1, total, H, D), the kernels adding cu_seqlens. Steps already true are
    skipped: even a no-op .to() or view costs about a microsecond of host time."""
    if x.dtype != dtype:
        x = x.to(dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.unsqueeze(0) if x.dim() == 3 else x


def _user_view(x: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A kernel output back in the caller's shape and dtype (the inverse of _kernel_view)."""
    return x if x.dtype == dtype and x.dim() == len(shape) else x.view(shape).to(dtype)


def _tma_view(x: torch.Tensor, block_rows: int, block_d: int, enabled: bool) -> TensorDescriptor | None:
    """The (B * N, H * D) view of a (B, N, H, D) tensor whose whole in-bounds tiles the Triton kernels
    load through TMA (common.load_block), or None for pointer loads: when the config does not use TMA,
    or the layout does not fit (route.tma_fits)."""
    if not (enabled and route.tma_fits(x, block_d)):
        return None
    batch, n, heads, d = x.shape
    return TensorDescriptor(x, [batch * n, heads * d], [x.stride(1), 1], [block_rows, block_d])


_GLUON_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


@functools.cache
def _shared_layout(rows: int, cols: int, dtype: torch.dtype, rank: int = 2) -> gl.NVMMASharedLayout:
    """The swizzled layout of [rows, cols] tiles, for descriptors of that rank (blocks [1, rows, 1, cols] at rank
    4: the same bytes, kernels/hopper/primitives.py's flat_layout)."""
    flat = gl.NVMMASharedLayout.get_default_for([rows, cols], _GLUON_DTYPES[dtype])
    return flat if rank == 2 else gl.NVMMASharedLayout(flat.swizzle_byte_width, flat.element_bitwidth, rank)


def _gluon_view(x: torch.Tensor, rows: int, cols: int | None = None, flat: bool = False) -> Descriptor:
    """A (B, N, H, D) tensor as the Gluon kernels read and write it: a rank-4 descriptor of its own strides (route.
    strided_tma_fits), blocks of [1, rows, 1, cols] (default: the kernels' width, config.hopper_width, which TMA
    fills past D with zeros and whose columns past D it does not store); flat (_flat): the (B * N, H, D) view, blocks
    of [rows, 1, cols]."""
    batch, n, heads, d = x.shape
    cols = cols or config.hopper_width(d)
    # a dim of size 1 may have any stride (route.strided_tma_fits ignores it): the descriptor gets a legal one
    head = x.stride(2) if heads > 1 else d
    row = x.stride(1) if n > 1 else heads * head
    if flat:
        return Descriptor(
            x, (batch * n, heads, d), (row, head, 1), (rows, 1, cols), _shared_layout(rows, cols, x.dtype, 3)
        )
    strides = (x.stride(0) if batch > 1 else n * row, row, head, 1)
    return Descriptor(x, tuple(x.shape), strides, (1, rows, 1, cols), _shared_layout(rows, cols, x.dtype, 4))


def _flat(common: dict, *xs: torch.Tensor) -> bool:
    """Whether a call's kernels see its (B, N, H, D) tensors as one sequence of B * N rows (config.FLAT_VIEW_BANDED):
    each batch's rows follow the last's in every tensor, in whole tiles, so that no K/V tile, no Q/dO step and no
    stored row crosses a batch's end. (A forward tile of three warpgroups' rows may: the rows past the batch it
    loads are the next one's, which the warpgroup that would take them skips.)"""
    if common["VARLEN"] or common["RAGGED"]:
        return False
    if (common["CAUSAL"] or common["LEFT"]) and not config.FLAT_VIEW_BANDED:
        return False
    n = common["N"]  # (cross-attention's keys of another length: rank-4, the kernels' sequence b starts at b * N)
    return all(x.shape[1] == n and (x.shape[0] == 1 or x.stride(0) == n * x.stride(1)) for x in xs)


def _sums_view(sums: torch.Tensor, rows: int, cols: int) -> Descriptor:
    """The fused backward's fp32 dQ sums (contiguous (B, rows per batch, H, D)) as (B * rows per batch, H * D), in
    blocks of rows x cols."""
    width = sums.shape[-2] * sums.shape[-1]
    shape = (sums.numel() // width, width)
    return Descriptor(sums, shape, (width, 1), (rows, cols), _shared_layout(rows, cols, sums.dtype))


_ROWS_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
_FRAGMENTS_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def _fragments_view(sums: torch.Tensor, rows: int, cols: int) -> Descriptor:
    """The fused backward's fp32 dQ sums (contiguous (B, rows, H, the tiles' width)) as (row tile, fragment row) x
    (column tile, config.DQ_FRAGMENT_COLS), in blocks of one rows x cols tile of dQ in kernels/hopper/dkdv.py's
    _fragments order."""
    width, frag = sums.shape[-2] * sums.shape[-1], config.DQ_FRAGMENT_COLS
    tile_rows = rows * cols // frag
    shape = (sums.numel() // width // rows * tile_rows, width // cols * frag)
    return Descriptor(sums, shape, (shape[1], 1), (tile_rows, frag), _FRAGMENTS_LAYOUT)


def _gluon_rows(x: torch.Tensor, rows: int) -> Descriptor:
    """A flat fp32 vector (LSE, delta) read through TMA in blocks of ``rows`` entries."""
    return Descriptor(x, (x.numel(),), (1,), (rows,), _ROWS_LAYOUT)


def _hopper_common(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, p: AttentionParams, rows: int):
    """(batch, longest sequence, the arguments every Gluon kernel takes); ``rows``: the config's tile rows, which
    a sequence that ends inside one (RAGGED) makes the kernels mask past its end. N_K: the keys' length, which a
    dense call without a mask may have apart from the queries' (route.hopper_fits); varlen, N."""
    batch, n, n_k = route.lengths(q, k, p)
    n_k = n if p.varlen else n_k
    stride_lb, stride_lh = _lse_strides(lse, p.varlen)
    return batch, n, dict(
        stride_lb=stride_lb, stride_lh=stride_lh, N=n, N_K=n_k, H=q.shape[2], GROUP=q.shape[2] // k.shape[2],
        qk_scale=p.softmax_scale * LOG2E, window_left=window_bound(p.window_left, 2 * n), CU_SEQLENS=p.cu_seqlens_q,
        CAUSAL=p.diagonal, LEFT=p.left_bounded, VARLEN=p.varlen,
        RAGGED=not route.whole_sequences(p, n, rows) or (not p.varlen and n_k % rows != 0),
        D=config.hopper_width(q.shape[3]), HEAD_D=q.shape[3], num_warps=config.HOPPER_NUM_WARPS,
    )  # fmt: skip


_FORWARD_SM90 = Launcher(hopper.attention_forward_sm90_kernel)
_DKDV_SM90 = Launcher(hopper.attention_backward_dkdv_sm90_kernel)
_DQ_SM90 = Launcher(hopper.attention_backward_dq_sm90_kernel)
_PREPROCESS = Launcher(attention_backward_preprocess_kernel)
_DQ_CONVERT = Launcher(attention_backward_dq_convert_kernel)

# Replayable calls by their route's layout key (launch.Plan): a small call's host time is otherwise about its GPU time.
# A plan (and route._ROUTES) holds the choices of kernels/config.py's tables when it was recorded: a sweep that
# changes them at run time must clear both (and _schedule's cache, for the SCHEDULE_* constants).
_PLANS: dict[tuple, Plan] = {}


def _plan_key(r: route.Route) -> tuple | None:
    """The route's layout key (the calls a Plan may replay: it holds all that the launches depend on), or None where
    launches must go through Triton (a launch hook set; the interpreter's kernels leave no Plan to replay)."""
    return None if r.key is None or hooked() else r.key


def _hopper_forward(q, k, v, out, lse, p: AttentionParams, cfg: config.HopperForwardConfig, recorder: Recorder):
    """The persistent Gluon forward: one program per SM (or per tile or work unit, if fewer) loops over its query
    tiles: dense causal, mostly those that schedule.py's table lists for it (the recorder holds the table), otherwise
    units i, i + P, ... (kernels/hopper/forward.py's _forward_tile). The _hopper_* launchers return Launcher.bind's
    (Bound, tensors), for a Recorder."""
    batch, n, common = _hopper_common(q, k, lse, p, cfg.rows)
    rows = cfg.consumers * cfg.block_m
    tiles = cdiv(n, rows)
    units = (cdiv(tiles, 2) if common["CAUSAL"] else tiles) * batch * common["H"]
    programs, table, bits = _forward_schedule(batch, common["H"], tiles, units, n, cfg, common, p.varlen, q.device)
    if table is not None:
        recorder.constant("schedule", table)
    # O staged in shared memory for a TMA store, in q's dtype: fp32 results go out from registers
    staged = cfg.stage_o and not p.fp32_results
    flat = _flat(common, q, k, v, out)
    return _FORWARD_SM90.bind((programs,))(
        _gluon_view(q, cfg.block_m, flat=flat), _gluon_view(k, cfg.block_n, flat=flat),
        _gluon_view(v, cfg.block_n, flat=flat),
        _gluon_view(out, cfg.block_m, common["D"] // cfg.o_pieces, flat) if staged else None, out,
        *_strides(out, p.varlen), lse, **common, SINKS=p.sinks, units=units, SCHEDULE=table, m_bits=bits[0],
        h_bits=bits[1], CONSUMERS=cfg.consumers,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, Q_STAGES=cfg.q_stages, STAGES=cfg.stages,
        TREE_ROWS=cfg.tree_rows, PINGPONG=cfg.pingpong,
        LAST_FIRST=cfg.last_first and not common["LEFT"],  # (autotuning toggles it; a window's tiles keep their order)
    )  # fmt: skip


def _forward_schedule(
    batch: int,
    heads: int,
    tiles: int,
    units: int,
    n: int,
    cfg: config.HopperForwardConfig,
    common: dict,
    varlen: bool,
    device,
) -> tuple[int, torch.Tensor | None, tuple[int, int]]:
    """(programs, schedule.py's table or None for the kernel's own order, the widths of its entries' tile and head
    fields) of the persistent forward over ``batch`` x ``heads`` heads of ``tiles`` query tiles each (``units`` in the
    kernel's own order)."""
    sms = route.sm_count(device)
    if not common["CAUSAL"] or varlen or batch * heads * tiles > config.SCHEDULE_MAX_TILES:
        return min(units, sms), None, (0, 0)
    costs = _tile_costs(n, tiles, cfg, common["window_left"] if common["LEFT"] else None)
    return _schedule(batch, heads, costs, sms, config.SCHEDULE_BATCH_ROUNDS, device)


@functools.cache
def _tile_costs(n: int, tiles: int, cfg: config.HopperForwardConfig, window_left: int | None) -> tuple[int, ...]:
    """What each causal query tile of a head costs the forward (longest first): the keys its longest warpgroup
    streams (as the kernel's _key_tiles counts them) plus config.SCHEDULE_TILE_KEYS."""
    costs = []
    for m in reversed(range(tiles)):
        keys = 0
        for w in range(cfg.consumers):
            first_row = (m * cfg.consumers + w) * cfg.block_m
            if first_row < n:
                key0 = 0 if window_left is None else max(first_row - window_left, 0) // cfg.block_n
                keys = max(keys, (cdiv(min(first_row + cfg.block_m, n), cfg.block_n) - key0) * cfg.block_n)
        costs.append(keys + config.SCHEDULE_TILE_KEYS)
    return tuple(costs)


@functools.cache  # never evicted: a CUDA graph captured with a table keeps its address
def _schedule(
    batch: int, heads: int, costs: tuple[int, ...], sms: int, batch_rounds: int, device
) -> tuple[int, torch.Tensor | None, tuple[int, int]]:
    """(programs, table, field widths) of schedule.causal_forward over ``batch`` x ``heads`` heads, its entries
    re-encoded as the kernel reads them (_fields), or the kernel's own pairs (None) where by the costs' count the table
    would end later."""
    total = batch * heads
    programs = min(total * len(costs), sms)
    table = schedule.causal_forward(total, costs, programs, batch_rounds * programs)
    pairs = min(total * ((len(costs) + 1) // 2), sms)
    # a tie takes the table: at D=256 N=512 the count sees none (the greedy split's, before balancing);
    # measured, the table was 1-2% faster in one run, level in another
    if schedule.makespan(table, costs, programs) > schedule.pairs_makespan(total, costs, pairs):
        return pairs, None, (0, 0)
    entries, bits = _fields(table[programs + 1 :], len(costs), heads, batch)
    return programs, torch.tensor(table[: programs + 1] + entries, dtype=torch.int32, device=device), bits


def _fields(entries: list[int], n_m: int, heads: int, batch: int) -> tuple[list[int], tuple[int, int]]:
    """schedule.py's entries ((head * n_m + p) << 1) | r as the kernel decodes them without dividing (_forward_tile):
    ((((b << h_bits) | h) << m_bits | p) << 1) | r, for batch b's head h; and (m_bits, h_bits)."""
    m_bits, h_bits = (n_m - 1).bit_length(), (heads - 1).bit_length()
    assert 1 + m_bits + h_bits + (batch - 1).bit_length() <= 31, "config.SCHEDULE_MAX_TILES keeps them in an int32"
    fields = []
    for e in entries:
        head, p = divmod(e >> 1, n_m)
        b, h = divmod(head, heads)
        fields.append((((b << h_bits | h) << m_bits | p) << 1) | (e & 1))
    return fields, (m_bits, h_bits)


def _aligned_rows(batch: int, heads: int, rows: int, varlen: bool) -> tuple[int, ...]:
    """The shape of the Gluon backward's aligned LSE and delta rows (config.LSE_ROWS_ALIGN): (B, H, N rounded up)
    or, varlen, (H, room for each of the B sequences to start aligned among ``rows`` packed rows)."""
    align = config.LSE_ROWS_ALIGN
    if varlen:
        return heads, (cdiv(rows, align) + batch) * align
    return batch, heads, cdiv(rows, align) * align


def _lse_strides(lse: torch.Tensor | None, varlen: bool) -> tuple[int, int]:
    """(batch, head) strides of the LSE rows: dense (B, H, N_Q), varlen (H, total_q) with no batch stride; none
    (zeros) for no LSE."""
    if lse is None:
        return 0, 0
    return (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))


def _features(p: AttentionParams, n: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """Runtime arguments and constexpr flags of the feature set, shared by every kernel (n: query plus key rows;
    dtype: the inputs' as the kernels run them)."""
    runtime = dict(
        CU_SEQLENS_Q=p.cu_seqlens_q, CU_SEQLENS_K=p.cu_seqlens_k, ALIBI_SLOPES=p.alibi_slopes,
        softcap=p.softmax_scale / p.softcap if p.softcap > 0 else 0.0,
        window_left=window_bound(p.window_left, n), window_right=window_bound(p.window_right, n),
        seed=p.seed, threshold=dropout.threshold(p.dropout_p), dropout_scale=1.0 / (1.0 - p.dropout_p),
        MASK_TENSORS=(), SCORE_TENSORS=tuple(p.score_mod.tensors) if p.score_mod else (),
    )  # fmt: skip
    flags = dict(
        LEFT=p.left_bounded, RIGHT=p.window_right != NO_BOUND, SOFTCAP=config.softcap_mode(p.softcap, dtype),
        ALIBI=p.alibi_slopes is not None, DROPOUT=p.dropout_p > 0, VARLEN=p.varlen, SPARSE=p.sparse,
        SPARSE_BLOCK_M=1, SPARSE_BLOCK_N=1, MASK_MOD=None, SCORE_MOD=p.score_mod.fn if p.score_mod else None,
    )  # fmt: skip
    mask = p.block_mask
    if mask is not None:
        flags.update(SPARSE_BLOCK_M=mask.block_size[0], SPARSE_BLOCK_N=mask.block_size[1])
        if mask.mask_mod is not None:
            flags.update(MASK_MOD=mask.mask_mod.fn)
            runtime.update(MASK_TENSORS=tuple(mask.mask_mod.tensors))
    return runtime, flags


def _tile_lists(mask: BlockMask | None, transposed: bool) -> dict:
    """A BlockMask's tile lists as kernel arguments: per query tile or, transposed, per key tile.

    Absent full lists become zero counts; a mask dim of size 1 is read with stride 0 (broadcast).
    """
    if mask is None:
        return dict(TILE_NUM=None, TILE_IDX=None, FULL_NUM=None, FULL_IDX=None, stride_sb=0, stride_sh=0)
    prefix = "q" if transposed else "kv"
    num, idx = getattr(mask, f"{prefix}_num_blocks"), getattr(mask, f"{prefix}_indices")
    full_num, full_idx = getattr(mask, f"full_{prefix}_num_blocks"), getattr(mask, f"full_{prefix}_indices")
    if full_num is None:
        full_num, full_idx = torch.zeros_like(num), idx
    bm, hm, tiles = num.shape
    return dict(
        TILE_NUM=num, TILE_IDX=idx, FULL_NUM=full_num, FULL_IDX=full_idx,
        stride_sb=hm * tiles if bm > 1 else 0, stride_sh=tiles if hm > 1 else 0,
    )  # fmt: skip


def _tile(size: int, mask: BlockMask | None, axis: int) -> int:
    """A kernel tile edge, shrunk to divide the block mask's tile edge along that axis."""
    return size if mask is None else math.gcd(size, mask.block_size[axis])


def _even(n: int, block: int, p: AttentionParams) -> bool:
    """Every sequence is a whole number of tiles (varlen lengths are known only to the kernel)."""
    return not p.varlen and n % block == 0


def _sparse_block(size: int, mask: BlockMask | None, axis: int) -> int:
    """The tile a kernel walks along an axis as a unit: the block mask's, if any (for EVEN_*)."""
    return size if mask is None else mask.block_size[axis]


def _tuning_key(p: AttentionParams, head_dim: int, dtype: torch.dtype, span: int, with_lse: bool) -> tuple:
    """What a tuned config is chosen for beside the kernel family and the GPU (autotune.choose): the head dim, the
    dtype, the span's bucket, the features on, whether the LSE is written (an inference call's kernel writes none,
    and its best config may differ) and whether the results are fp32 (stored from registers on Hopper)."""
    _, flags = _features(p, 0, dtype)  # the flags alone; a level (SOFTCAP's) with its value
    flags = sorted((name, on) for name, on in flags.items() if on and not name.startswith("SPARSE_BLOCK"))
    features = tuple(f"{name}={on}" if type(on) is int else name for name, on in flags)
    written = (() if with_lse else ("no lse",)) + (("fp32 results",) if p.fp32_results else ())
    return head_dim, str(dtype).removeprefix("torch."), autotune.span_bucket(span), *features, *written


def _hopper_dkdv(q, k, v, dout, lse, delta, dk, dv, dq_sums, p: AttentionParams, cfg: config.HopperBackwardConfig):
    """dK, dV and, when dq_sums (fp32, (B, whole tiles of rows, H, the tiles' width), zeroed) is given, dQ added
    into it by TMA reductions; lse and delta in aligned rows (_aligned_rows)."""
    batch, _, common = _hopper_common(q, k, lse, p, cfg.rows)
    cols = common["D"] // 2 if cfg.split_d else common["D"]  # of dK and dV per warpgroup
    # dK and dV staged in the K and V tiles for TMA stores, in their dtype: fp32 results go out from registers
    flat = _flat(common, q, k, v, dout, dk, dv)
    dk_desc, dv_desc = (None, None) if p.fp32_results else (_gluon_view(x, cfg.block_n, cols, flat) for x in (dk, dv))
    sums_rows = 0 if dq_sums is None else dq_sums.shape[1]
    if dq_sums is not None:  # TMA reductions of D / 2 columns per warpgroup, split_d's in two pieces
        dq_sums = (_sums_view if cfg.split_d else _fragments_view)(dq_sums, cfg.block_m, cols // 2)
    heads, blocks = batch * k.shape[2], cdiv(common["N_K"], cfg.keys)
    order_heads = min(max(cfg.order_programs // blocks, 1), config.ORDER_HEADS, heads) if common["CAUSAL"] else 1
    return _DKDV_SM90.bind((blocks * heads,))(
        _gluon_view(q, cfg.block_m, flat=flat), _gluon_view(k, cfg.block_n, flat=flat),
        _gluon_view(v, cfg.block_n, flat=flat), _gluon_view(dout, cfg.block_m, flat=flat), dk_desc, dv_desc,
        dk, *_strides(dk, p.varlen), dv, *_strides(dv, p.varlen),
        dq_sums, sums_rows, _gluon_rows(lse, cfg.block_m), _gluon_rows(delta, cfg.block_m),
        softmax_scale=p.softmax_scale, order_heads=order_heads, **common,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
        DQ_LATE=cfg.dq_late, READ_AHEAD=cfg.read_ahead, SPLIT_D=cfg.split_d,
        WORKER_REGISTERS=cfg.dkdv_registers(p.windowed),
    )  # fmt: skip


def _dq_convert(sums: torch.Tensor, dq: torch.Tensor, cfg: config.HopperBackwardConfig):
    """dQ in its dtype and layout from the fused kernel's fp32 sums (the kernel's width a head), laid out as
    _hopper_dkdv's reductions left them."""
    width, head_dim = sums.shape[-2] * sums.shape[-1], sums.shape[-1]
    # the fragment order holds a tile's D / 2 columns together; row-major sums split as finely as registers want
    half = min(head_dim // 2, config.DQ_CONVERT_COLS) if cfg.split_d else head_dim // 2
    return _DQ_CONVERT.bind((sums.numel() // width // cfg.block_m, width // half))(
        sums, dq, *dq.stride()[:3], dq.shape[1], sums.shape[1], width, D=head_dim, HEAD_D=dq.shape[-1],
        BLOCK_M=cfg.block_m, HALF=half,
        FRAGMENTS=not cfg.split_d, FRAGMENT_COLS=config.DQ_FRAGMENT_COLS, EVEN=dq.shape[1] == sums.shape[1],
    )  # fmt: skip


def _hopper_dq(q, k, v, out, dout, lse, dlse, delta, lse_rows, dq, p: AttentionParams, cfg):
    """dQ, and delta = rowsum(dO * O) - dLSE and a copy of the LSE (in aligned rows, for the dK/dV kernel) in the
    same pass."""
    batch, n, common = _hopper_common(q, k, lse, p, cfg.rows)
    tiles = cfg.dq
    stride_rb, stride_rh = _lse_strides(delta, p.varlen)
    flat = _flat(common, q, k, v, dout, dq, out)
    return _DQ_SM90.bind(_heads_grid(cdiv(n, 2 * tiles.block_m), batch, common["H"]))(
        _gluon_view(q, tiles.block_m, flat=flat), _gluon_view(k, tiles.block_n, flat=flat),
        _gluon_view(v, tiles.block_n, flat=flat), _gluon_view(dout, tiles.block_m, flat=flat),
        None if p.fp32_results else _gluon_view(dq, tiles.block_m, flat=flat), dq,
        *_strides(dq, p.varlen), lse, delta, lse_rows, out, dlse, *_strides(out, p.varlen), stride_rb=stride_rb,
        stride_rh=stride_rh, softmax_scale=p.softmax_scale, **common, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        STAGES=tiles.stages,
    )  # fmt: skip


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttentionParams, r: route.Route
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """O and the natural-log LSE in fp32 (params.py has the layouts) by the route's forward kernel; unless
    p.write_lse the kernel writes no LSE and None stands for it."""
    key = _plan_key(r)
    plan = _PLANS.get(key)
    if plan is not None:
        made = plan(q=q, k=k, v=v, sinks=p.sinks)
        return made["out"], made.get("lse")
    recorder = Recorder(q=q, k=k, v=v, sinks=p.sinks)
    out_dtype = p.result_dtype(q.dtype)
    run_dtype = route.run_dtype(q.dtype)
    shape = q.shape
    lse = recorder.empty("lse", lse_shape(q, p.varlen), torch.float32, q.device) if p.write_lse else None
    q, k, v = (_kernel_view(x, run_dtype) for x in (q, k, v))
    batch, n_q, n_k = route.lengths(q, k, p)
    head_dim = q.shape[3]
    out = recorder.empty("out", q.shape, p.result_dtype(run_dtype), q.device)
    cfg = r.config
    if r.family == route.HOPPER:
        if autotune.enabled():

            def run(c: config.HopperForwardConfig) -> tuple[torch.Tensor, ...]:
                _hopper_forward(q, k, v, out, lse, p, c, Recorder())
                return _written(out, lse)

            candidates = config.hopper_forward_candidates(head_dim, cfg)
            tuning = _tuning_key(p, head_dim, run_dtype, p.span(n_q, n_k), lse is not None)
            cfg = autotune.choose("gluon forward", tuning, cfg, candidates, run, q.device)
        recorder.add(_hopper_forward(q, k, v, out, lse, p, cfg, recorder))
        keep(_PLANS, key, recorder)  # replays return out as it is: a plan's tensors are in their run dtype and shape
        return _user_view(out, shape, out_dtype), lse
    if autotune.enabled():
        cfg = autotune.choose(
            "forward", _tuning_key(p, head_dim, run_dtype, p.span(n_q, n_k), lse is not None), cfg,
            config.forward_candidates(route.arch(q.device), head_dim, run_dtype, cfg),
            lambda c: _written(*_portable_forward(q, k, v, out, lse, p, c, batch, n_q, n_k)), q.device,
        )  # fmt: skip
    _portable_forward(q, k, v, out, lse, p, cfg, batch, n_q, n_k)
    return _user_view(out, shape, out_dtype), lse


def _written(out: torch.Tensor, lse: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """What a forward wrote, for autotune to compare between configs: out, and the LSE unless none was asked for."""
    return (out,) if lse is None else (out, lse)


def _portable_forward(q, k, v, out, lse, p: AttentionParams, cfg: config.ForwardConfig, batch, n_q, n_k):
    """The portable forward kernel into out and lse: (out, lse)."""
    heads, head_dim, heads_k = q.shape[2], q.shape[3], k.shape[2]
    runtime, flags = _features(p, n_q + n_k, q.dtype)
    block_m, block_n = _tile(cfg.block_m, p.block_mask, 0), _tile(cfg.block_n, p.block_mask, 1)
    grid = _heads_grid(cdiv(n_q, block_m), batch, heads)
    block_d = config.block_d(head_dim)
    attention_forward_kernel[grid](
        q, k, v, out, lse, _tma_view(k, block_n, block_d, cfg.tma), _tma_view(v, block_n, block_d, cfg.tma),
        *_strides(q, p.varlen), *_strides(k, p.varlen), *_strides(v, p.varlen), *_strides(out, p.varlen),
        *_lse_strides(lse, p.varlen), p.empty_lse,
        N_Q=n_q, N_K=n_k, qk_scale=p.softmax_scale * LOG2E, H=heads, GROUP=heads // heads_k, SINKS=p.sinks,
        D=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        EVEN_M=_even(n_q, block_m, p), EVEN_N=_even(n_k, _sparse_block(block_n, p.block_mask, 1), p),
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.max_registers, EDGE_STAGES=cfg.edge_stages,
        **_tile_lists(p.block_mask, False), **runtime, **flags,
    )  # fmt: skip
    return out, lse


def _shaped(grads: tuple[torch.Tensor, ...], shapes: tuple[torch.Size, ...], dtype: torch.dtype) -> tuple:
    return tuple(_user_view(g, shape, dtype) for g, shape in zip(grads, shapes, strict=True))


def backward(
    dout: torch.Tensor,
    dlse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    p: AttentionParams,
    r: route.Route,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dQ, dK, dV by recomputation from Q, K, V and the forward's LSE (no N x N buffer), by the route's kernels; and
    dsinks (None without sinks), from the delta their pass over dO and O wrote."""
    dq, dk, dv, delta = _gradients(dout, dlse, q, k, v, out, lse, p, r)
    if p.sinks is None:
        return dq, dk, dv, None
    if r.family == route.HOPPER:
        delta = _unaligned(delta, p, lse.shape)
    return dq, dk, dv, sinks_grad(p, final_lse(lse, p), delta)


def _unaligned(rows: torch.Tensor, p: AttentionParams, shape: torch.Size) -> torch.Tensor:
    """Values in the Gluon backward's aligned rows (_aligned_rows) laid out as the LSE (``shape``): dense, the first
    N_Q of each head's rows; varlen, sequence b's rows from (cdiv(its start, ALIGN) + b) * ALIGN, gathered on the
    device (no host read)."""
    if not p.varlen:
        return rows[..., : shape[-1]]
    align, cu = config.LSE_ROWS_ALIGN, p.cu_seqlens_q.long()
    starts = cu[:-1]
    shifts = (starts + align - 1) // align * align + torch.arange(len(starts), device=cu.device) * align - starts
    sequence = torch.repeat_interleave(torch.arange(len(starts), device=cu.device), cu.diff(), output_size=shape[1])
    return rows[:, torch.arange(shape[1], device=cu.device) + shifts[sequence]]


def _gradients(dout, dlse, q, k, v, out, lse, p: AttentionParams, r: route.Route):
    """dQ, dK, dV and delta = rowsum(dO * O) - dLSE: laid out as the LSE, or on the Gluon path in aligned rows."""
    grad_dtype = p.result_dtype(q.dtype)
    shapes = q.shape, k.shape, v.shape
    key = _plan_key(r)
    plan = _PLANS.get(key)
    if plan is not None:
        made = plan(dout=dout, dlse=dlse, q=q, k=k, v=v, out=out, lse=lse)
        return *_shaped((made["dq"], made["dk"], made["dv"]), shapes, grad_dtype), made["delta"]
    # the tensors as passed: a conversion's copy below is no input, and a launch reading one is not replayed
    recorder = Recorder(dout=dout, dlse=dlse, q=q, k=k, v=v, out=out, lse=lse)
    run_dtype = route.run_dtype(q.dtype)
    q, k, v, out, dout = (_kernel_view(x, run_dtype) for x in (q, k, v, out, dout))
    lse = final_lse(lse, p).contiguous()
    dlse = dlse.contiguous()
    batch, n_q, n_k = route.lengths(q, k, p)
    heads, head_dim, heads_k = q.shape[2], q.shape[3], k.shape[2]
    fused = r.dq == route.FUSED
    gluon = r.family == route.HOPPER
    # the Gluon dK/dV kernel's LSE and delta in aligned rows (config.LSE_ROWS_ALIGN), which delta's pass writes
    rows_shape = _aligned_rows(batch, heads, q.shape[1], p.varlen) if gluon else lse.shape
    delta = recorder.empty("delta", rows_shape, torch.float32, q.device)
    lse_rows = recorder.empty("lse_rows", rows_shape, torch.float32, q.device) if gluon else None
    # the fused kernel adds dQ's shares up in fp32, zeroed by the preprocess kernel, and converts them after: rows
    # of whole tiles per batch (a dense sequence may end inside its last)
    dq_sums = None
    if fused:
        rows = cdiv(q.shape[1], r.config.block_m) * r.config.block_m
        sums_shape = (q.shape[0], rows, heads, config.hopper_width(head_dim))
        dq_sums = recorder.empty("dq_sums", sums_shape, torch.float32, q.device)
    # the gradients in their inputs' layouts, as flash_attn's (a model's (B, H, N, D) storage seen as (B, N, H, D))
    grads = ("dq", q), ("dk", k), ("dv", v)
    dq, dk, dv = (recorder.empty_like(name, x, p.result_dtype(x.dtype)) for name, x in grads)
    if r.dq == route.PAIR:  # dQ's own pass, which also computes delta for the dK/dV kernel after it
        recorder.add(_hopper_dq(q, k, v, out, dout, lse, dlse, delta, lse_rows, dq, p, r.config))
        recorder.add(_hopper_dkdv(q, k, v, dout, lse_rows, delta, dk, dv, None, p, r.config))
        keep(_PLANS, key, recorder)
        return *_shaped((dq, dk, dv), shapes, grad_dtype), delta
    block_d = config.block_d(head_dim)  # the preprocess zeroes this many columns of the dQ sums: their width
    common = dict(H=heads, D=head_dim, BLOCK_D=block_d)
    lse_strides = _lse_strides(lse, p.varlen)
    block = config.PREPROCESS_BLOCK_M
    recorder.add(_PREPROCESS.bind(_heads_grid(cdiv(n_q, block), batch, heads))(
        out, dout, dlse, delta, dq_sums, lse, lse_rows,
        *_strides(out, p.varlen), *_strides(dout, p.varlen), *_strides(dq if dq_sums is None else dq_sums, p.varlen),
        *lse_strides, *_lse_strides(delta, p.varlen), N_Q=n_q, CU_SEQLENS_Q=p.cu_seqlens_q, BLOCK_M=block,
        VARLEN=p.varlen, ALIGN=config.LSE_ROWS_ALIGN if gluon else 0, **common,
    ))  # fmt: skip
    if fused:  # one pass: dK, dV and dQ, whose shares the key tiles add up in no fixed order
        recorder.add(_hopper_dkdv(q, k, v, dout, lse_rows, delta, dk, dv, dq_sums, p, r.config))
        recorder.add(_dq_convert(dq_sums, dq, r.config))
        keep(_PLANS, key, recorder)
        return *_shaped((dq, dk, dv), shapes, grad_dtype), delta
    cfg = r.config
    runtime, flags = _features(p, n_q + n_k, q.dtype)
    flags.update(SCORE_GRAD=p.score_mod.grad if p.score_mod else None)
    kernel_args = dict(
        N_Q=n_q, N_K=n_k, qk_scale=p.softmax_scale * LOG2E, softmax_scale=p.softmax_scale, GROUP=heads // heads_k,
        DOT_PRECISION=_dot_precision(run_dtype), EDGE_STAGES=cfg.edge_stages, **common, **runtime, **flags,
    )  # fmt: skip
    mask = p.block_mask
    block_m, block_n = _tile(cfg.block_m_kv, mask, 0), _tile(cfg.block_n_kv, mask, 1)
    attention_backward_dkdv_kernel[_heads_grid(cdiv(n_k, block_n), batch, heads_k)](
        q, k, v, dout, lse, delta, dk, dv,
        _tma_view(q, block_m, block_d, cfg.tma), _tma_view(dout, block_m, block_d, cfg.tma),
        *(s for x in (q, k, v, dout, dk, dv) for s in _strides(x, p.varlen)), *lse_strides,
        BLOCK_M=block_m, BLOCK_N=block_n,
        EVEN_M=_even(n_q, _sparse_block(block_m, mask, 0), p), EVEN_N=_even(n_k, block_n, p),
        num_warps=cfg.num_warps, num_stages=cfg.stages_kv, **_tile_lists(mask, transposed=True), **kernel_args,
    )  # fmt: skip
    block_m, block_n = _tile(cfg.block_m_q, mask, 0), _tile(cfg.block_n_q, mask, 1)
    attention_backward_dq_kernel[_heads_grid(cdiv(n_q, block_m), batch, heads)](
        q, k, v, dout, lse, delta, dq,
        _tma_view(k, block_n, block_d, cfg.tma), _tma_view(v, block_n, block_d, cfg.tma),
        *(s for x in (q, k, v, dout, dq) for s in _strides(x, p.varlen)), *lse_strides,
        BLOCK_M=block_m, BLOCK_N=block_n, EVEN_M=_even(n_q, block_m, p),
        EVEN_N=_even(n_k, _sparse_block(block_n, mask, 1), p),
        num_warps=cfg.warps_q or cfg.num_warps, num_stages=cfg.stages_q, **_tile_lists(mask, transposed=False),
        **kernel_args,
    )  # fmt: skip
    return *_shaped((dq, dk, dv), shapes, grad_dtype), delta
