"""The Gluon dQ kernel on sm90, warp-specialised: the deterministic backward's first kernel (dK/dV runs after it).

Notation
  B, H, HKV    batch, query heads, key/value heads; GROUP = H // HKV query heads share a K/V head
  N            sequence length, of queries and keys alike (self-attention); VARLEN: the longest, sequence b being
               rows CU_SEQLENS[b]:CU_SEQLENS[b + 1] of the packed batch. RAGGED: some sequence ends inside a tile
  N_K          the keys' length: N, or apart from it in a dense call without a mask (cross-attention)
  D            the tiles' width (64, 128, 256); HEAD_D <= D the tensors' head dim (primitives.py)
  BLOCK_M      query rows of one consumer warpgroup; a program has two
  BLOCK_N      keys per streamed K/V tile

Grid: (cdiv(N, 2 * BLOCK_M), B * H over one or two axes: primitives.head_program), laid out as the forward's tiles
(causal: longest first). One program computes dQ and delta of 2 * BLOCK_M query rows of one head: each consumer
warpgroup keeps its Q and dO rows resident, first takes delta = rowsum(dO * O) - dLSE, then streams the K/V tiles
its rows see: S = Q K^T, dP = dO V^T, dQ += dS K. No atomics: the backward is bitwise reproducible.

Numerics: P = exp2(S * qk_scale - LSE * LOG2E), the forward's natural-log LSE taken to base 2; dQ accumulates in fp32
and is scaled by softmax_scale once, at the end.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .primitives import (
    CONSUMER_WARPS,
    LOG2E,
    PRODUCER_REGISTERS,
    PRODUCER_WARPS,
    ROWS_ALIGN,
    TWO_CONSUMER_REGISTERS,
    at,
    band_tile,
    barriers,
    fill,
    flat_view,
    give,
    head_program,
    key_tiles,
    keys_of,
    keys_past,
    last_first,
    mma_layout,
    operand_layout,
    outside_band,
    query_tile,
    resident,
    ring,
    rows_start,
    step_tile,
    store,
    store_rows,
    take,
    tiles,
)


@gluon.jit
def _dq_producer(k_desc, v_desc, kv_ring, kv, n_tiles, ROTATE: gl.constexpr, BLOCK_N: gl.constexpr):
    """Streams n_tiles (K, V) tiles from coordinate kv on into kv_ring, in step_tile's order."""
    for j in range(n_tiles):
        tile = at(kv, step_tile(j, n_tiles, ROTATE) * BLOCK_N)
        fill((k_desc, v_desc), (tile, tile), kv_ring, j)


@gluon.jit
def _dq_step(dq, zero_s, q_smem, do_smem, kv_ring, j, first_row, rows, first_col, n_k, lse2, delta, qk_scale,
             window_left, CAUSAL: gl.constexpr, LEFT: gl.constexpr, RAGGED: gl.constexpr,
             MASK: gl.constexpr):  # fmt: skip
    """dQ += dS K for the key tile at ring position j (keys from first_col on, of n_k). MASK: 0, the tile needs no
    mask; 1, a causal band's may (a branch on whether it does); 2, it does (no branch: the stream's first tile,
    last_first)."""
    gl.static_assert(CAUSAL or not RAGGED or MASK != 1, "a ragged sequence without a band streams its last tile first")
    k, v = take(kv_ring, j)
    scores = warpgroup_mma(q_smem, k.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    dp = warpgroup_mma(do_smem, v.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    scores = warpgroup_mma_wait(1, deps=(scores, q_smem, k))[0]
    p = gl.exp2(scores * qk_scale - lse2)
    if CAUSAL:
        if MASK == 2:
            p = band_tile(p, rows, first_col, window_left, 0.0, LEFT)
        elif MASK == 1:
            last_row = first_row + p.shape[0] - 1
            if outside_band(first_row, last_row, first_col, first_col + p.shape[1] - 1, window_left, LEFT):
                p = band_tile(p, rows, first_col, window_left, 0.0, LEFT)
    elif RAGGED and MASK == 2:  # keys past the sequence (causal: the rows stored see none; it is the last tile)
        p = keys_past(p, first_col, n_k, 0.0)
    dp = warpgroup_mma_wait(0, deps=(dp, do_smem, v))[0]
    ds = gl.convert_layout((p * (dp - delta)).to(q_smem.dtype), operand_layout(dq.shape[1]))
    dq = warpgroup_mma(ds, k, dq, is_async=True)
    dq = warpgroup_mma_wait(0, deps=(dq, k))[0]
    give(kv_ring, j)
    return dq


@gluon.jit
def _dq_consumer(dq_out, q_smem, do_smem, kv_ring, q_bar, lse_ptr, rows_ptrs, o_ptr, dlse_ptr, stride_o, coord,
                 first_row, n, n_k, key0, n_tiles, qk_scale, softmax_scale, window_left, CAUSAL: gl.constexpr,
                 LEFT: gl.constexpr, VARLEN: gl.constexpr, RAGGED: gl.constexpr, ROTATE: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, HEAD_D: gl.constexpr):  # fmt: skip
    """One warpgroup's BLOCK_M query rows (those below the sequence's n; of the keys, those below n_k): first
    delta = rowsum(dO * O) - dLSE (the portable path's preprocess kernel), stored for the dK/dV kernel with a copy of
    the LSE in its aligned rows (rows_ptrs: (DELTA, LSE_ROWS) there), then for each streamed key tile S = Q K^T and
    dP = dO V^T (from shared memory), and dQ += dS K with dS from registers (ROTATE: in step_tile's order, whose
    first tile alone needs a mask: last_first). dq_out: ((dQ's descriptor,) or () for
    none, dQ, its strides), dQ written through the descriptor, or from registers where there is none (fp32 results)
    or a varlen sequence ends inside the rows."""
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    o_layout: gl.constexpr = mma_layout(D)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    dq = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    rows = first_row + gl.arange(0, BLOCK_M, rows_s)
    held = rows < n  # rows of the sequence: the others' LSE, O and delta belong to another row or none
    lse = gl.load(lse_ptr + gl.arange(0, BLOCK_M, rows_s), mask=held, other=0.0)
    lse2 = gl.expand_dims(lse * LOG2E, 1)
    tile: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    o_rows = gl.arange(0, BLOCK_M, gl.SliceLayout(1, tile))
    offsets = gl.expand_dims(o_rows, 1) * stride_o + gl.expand_dims(gl.arange(0, D, gl.SliceLayout(0, tile)), 0)
    held_o = gl.expand_dims(first_row + o_rows < n, 1)
    if HEAD_D < D:  # a tile wider than the tensors: O's columns past HEAD_D are another head's or none
        held_o = held_o & gl.expand_dims(gl.arange(0, D, gl.SliceLayout(0, tile)) < HEAD_D, 0)
    o = gl.load(o_ptr + offsets, mask=held_o, other=0.0).to(gl.float32)
    mbarrier.wait(q_bar, 0)
    delta = gl.convert_layout(gl.sum(o * do_smem.load(tile).to(gl.float32), 1), rows_s)
    delta = delta - gl.load(dlse_ptr + gl.arange(0, BLOCK_M, rows_s), mask=held, other=0.0)
    delta_ptr, lse_rows_ptr = rows_ptrs
    room = rows < gl.cdiv(n, ROWS_ALIGN) * ROWS_ALIGN  # the rows the dK/dV kernel reads: past n, zeros
    gl.store(delta_ptr + gl.arange(0, BLOCK_M, rows_s), delta, mask=room)
    gl.store(lse_rows_ptr + gl.arange(0, BLOCK_M, rows_s), lse, mask=room)
    delta = gl.expand_dims(delta, 1)
    if ROTATE:  # the last key tile first, masked; the loop then needs no mask
        dq = _dq_step(dq, zero_s, q_smem, do_smem, kv_ring, 0, first_row, rows, key0 + (n_tiles - 1) * BLOCK_N, n_k,
                      lse2, delta, qk_scale, window_left, CAUSAL, LEFT, RAGGED, 2)  # fmt: skip
        for j in range(1, n_tiles):
            dq = _dq_step(dq, zero_s, q_smem, do_smem, kv_ring, j, first_row, rows, key0 + (j - 1) * BLOCK_N, n_k,
                          lse2, delta, qk_scale, window_left, CAUSAL, LEFT, RAGGED, 0)  # fmt: skip
    else:
        for j in range(n_tiles):
            dq = _dq_step(dq, zero_s, q_smem, do_smem, kv_ring, j, first_row, rows, key0 + j * BLOCK_N, n_k, lse2,
                          delta, qk_scale, window_left, CAUSAL, LEFT, RAGGED, 1)  # fmt: skip

    dq_store, DQ, dq_strides = dq_out
    if len(dq_store) == 0 or (VARLEN and RAGGED and first_row + BLOCK_M > n):
        store_rows(DQ, dq_strides, coord, dq * softmax_scale, n - first_row, HEAD_D)
    else:
        store(dq_store[0], dq * softmax_scale, q_smem, coord)


@gluon.jit
def attention_backward_dq_sm90_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_desc, DQ, stride_dqb, stride_dqm, stride_dqh, LSE, DELTA, LSE_ROWS, O, DLSE,
    stride_ob, stride_om, stride_oh, stride_lb, stride_lh, stride_rb, stride_rh, N, N_K, H, GROUP, qk_scale,
    softmax_scale, window_left,
    CU_SEQLENS, CAUSAL: gl.constexpr, LEFT: gl.constexpr, VARLEN: gl.constexpr, RAGGED: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """Grid (cdiv(N, 2 * BLOCK_M), B * H): dQ (and delta) of 2 * BLOCK_M query rows, laid out as the forward's program,
    K/V tiles through a ring of STAGES slots; O: the forward's output and DQ, (B, N, H, HEAD_D) with the strides given
    (dQ also through dq_desc, or where that is None from registers alone: fp32 results, for which the Q tile that stages
    a TMA store has no room). LSE, DLSE: strides stride_lb, stride_lh; DELTA and LSE_ROWS (LSE's copy): the aligned rows
    that the dK/dV kernel reads (stride_rb, stride_rh; primitives.rows_start). D: the tiles' width, HEAD_D <= D the
    tensors' (primitives.py)."""
    pid_bh = head_program()
    b = pid_bh // H
    h = pid_bh % H
    m0, bc, seq0, N, lse0 = query_tile(gl.program_id(0), b, gl.num_programs(0), N, CU_SEQLENS, CAUSAL, VARLEN,
                                       flat_view(q_desc, k_desc, v_desc, do_desc, dq_desc), 2 * BLOCK_M)  # fmt: skip
    if m0 >= N:  # past the end of a shorter varlen sequence
        return
    n_k = keys_of(N, N_K, VARLEN)
    q = [bc, seq0 + m0, h, 0]

    kv_ring = ring((tiles(k_desc, STAGES), tiles(v_desc, STAGES)), 2)
    q_bar = barriers(1, 1).index(0)  # the resident Q and dO tiles have landed
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes)
    q_bufs = resident(q_desc, q_bar, q, 2)
    do_bufs = resident(do_desc, q_bar, q, 2)

    key0, n_tiles = key_tiles(m0, 2 * BLOCK_M, n_k, window_left, CAUSAL, LEFT, BLOCK_N)
    ROTATE: gl.constexpr = last_first(CAUSAL, LEFT, RAGGED, 2, BLOCK_M, BLOCK_N, True)  # two warpgroups
    row = b * stride_lb + h * stride_lh + lse0 + m0  # of LSE and DLSE
    out_row = b * stride_rb + h * stride_rh + rows_start(CU_SEQLENS, b, VARLEN) + m0  # of DELTA and LSE_ROWS
    o = O + bc.to(gl.int64) * stride_ob + (seq0 + m0).to(gl.int64) * stride_om + h.to(gl.int64) * stride_oh
    dq_store = ()  # (a worker partition's arguments cannot be None)
    if dq_desc is not None:
        dq_store = (dq_desc,)
    dq_out = (dq_store, DQ, (stride_dqb, stride_dqm, stride_dqh))
    gl.warp_specialize(
        [
            (_dq_consumer, (dq_out, q_bufs.index(0), do_bufs.index(0), kv_ring, q_bar, LSE + row,
                            (DELTA + out_row, LSE_ROWS + out_row), o,
                            DLSE + row, stride_om, q, m0, N, n_k, key0, n_tiles, qk_scale, softmax_scale, window_left,
                            CAUSAL, LEFT, VARLEN, RAGGED, ROTATE, BLOCK_M, BLOCK_N, D, HEAD_D)),
            (_dq_consumer, (dq_out, q_bufs.index(1), do_bufs.index(1), kv_ring, q_bar, LSE + row + BLOCK_M,
                            (DELTA + out_row + BLOCK_M, LSE_ROWS + out_row + BLOCK_M), o + BLOCK_M * stride_om,
                            DLSE + row + BLOCK_M, stride_om, at(q, BLOCK_M), m0 + BLOCK_M, N, n_k, key0, n_tiles,
                            qk_scale, softmax_scale, window_left, CAUSAL, LEFT, VARLEN, RAGGED, ROTATE, BLOCK_M,
                            BLOCK_N, D, HEAD_D)),
            (_dq_producer, (k_desc, v_desc, kv_ring, [bc, seq0 + key0, h // GROUP, 0], n_tiles, ROTATE, BLOCK_N)),
        ],
        [CONSUMER_WARPS, PRODUCER_WARPS],
        [TWO_CONSUMER_REGISTERS, PRODUCER_REGISTERS],
    )  # fmt: skip
