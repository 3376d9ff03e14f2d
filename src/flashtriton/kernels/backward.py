"""FlashAttention-2 backward kernels: preprocess, dK/dV, dQ.

Notation (as in forward.py)
  B, H, HKV, GROUP, N_Q, N_K, offset, D, BLOCK_D
  BLOCK_M, BLOCK_N   query / key tile edges of the kernel at hand

Nothing of size N_Q x N_K is stored: every kernel recomputes P = exp2(S * qk_scale - LSE2) from
Q, K and the forward's LSE, one tile at a time.

  preprocess   grid (cdiv(N_Q, BLOCK_M), B * H): delta = rowsum(dO * O) - dLSE, fp32.
               (Subtracting dLSE makes gradients flow through the returned LSE for free:
               dS = P * (dP - delta) with d(LSE)/dS = P.) Given DQ, also zeroes its rows: the
               fp32 dQ into which the fused Hopper backward adds each key tile's share.
  dQ convert   grid (rows / BLOCK_M, H * D / HALF): the fused Hopper backward's fp32 dQ sums, in
               the order its reductions wrote them, to dQ in the gradients' dtype.
  dK/dV        grid (cdiv(N_K, BLOCK_N), B * HKV): a program owns one key tile of one K/V head and
               streams the query tiles of all GROUP query heads that see it, so GQA needs no atomics.
  dQ           grid (cdiv(N_Q, BLOCK_M), B * H): a program owns one query tile and streams the keys
               it sees, exactly as the forward does.

Q_DESC, DO_DESC (dK/dV) and K_DESC, V_DESC (dQ): tensor descriptors of the streamed tensors, or None,
as the forward's K_DESC, V_DESC.

Each output element is written by exactly one program in a fixed order: the backward is
deterministic (bitwise reproducible) whatever ``deterministic`` says.
Features: the forward's flags (LEFT, RIGHT, SOFTCAP, ALIBI, DROPOUT, VARLEN; see forward.py), with
the same skipping of tiles outside the window band. Dropout regenerates the forward's mask from
the seed; dV takes the dropped P, and dP is dropped and rescaled before dS = P * (dP - delta).
A softcap multiplies dS by its derivative 1 - tanh^2.
"""

import triton
import triton.language as tl

from .common import (
    LOG2E,
    band_stretch,
    dropout_keep,
    head_program,
    key_range,
    listed,
    load_block,
    load_rows,
    load_tile,
    logits,
    query_range,
    sequence,
    store_tile,
    tile_mask,
    tile_start,
    wide,
)


@triton.jit(do_not_specialize=["N_Q", "H"])
def attention_backward_preprocess_kernel(
    O, DO, DLSE, DELTA, DQ, LSE, LSE_ROWS,
    stride_ob, stride_om, stride_oh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_lb, stride_lh, stride_rb, stride_rh,
    N_Q, H, CU_SEQLENS_Q,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, VARLEN: tl.constexpr, ALIGN: tl.constexpr,
):  # fmt: skip
    """delta = rowsum(dO * O) - dLSE into DELTA: laid out as DLSE (strides stride_lb, stride_lh) or, with ALIGN, in
    the Gluon backward's aligned rows (stride_rb, stride_rh: config.LSE_ROWS_ALIGN), LSE copied beside it into
    LSE_ROWS; and DQ (not None: the fused Gluon backward's fp32 sums, BLOCK_D columns a head) zeroed."""
    pid_m = tl.program_id(0)
    pid_bh = head_program()
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    stride_om, stride_dom, stride_dqm = wide(stride_om), wide(stride_dom), wide(stride_dqm)
    q_start, _, N_Q, _ = sequence(CU_SEQLENS_Q, CU_SEQLENS_Q, b, N_Q, N_Q, VARLEN)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o_ptrs = O + b * stride_ob + h * stride_oh + (q_start + rows[:, None]) * stride_om + offs_d[None, :]
    do_ptrs = DO + b * stride_dob + h * stride_doh + (q_start + rows[:, None]) * stride_dom + offs_d[None, :]
    o = load_tile(o_ptrs, rows, N_Q, offs_d, D, False, BLOCK_D == D).to(tl.float32)
    do = load_tile(do_ptrs, rows, N_Q, offs_d, D, False, BLOCK_D == D).to(tl.float32)
    row_ptrs = b * stride_lb + h * stride_lh + q_start + rows
    dlse = tl.load(DLSE + row_ptrs, mask=rows < N_Q, other=0.0)
    if ALIGN:  # and zeros up to the next whole ALIGN rows, which the Gluon dK/dV kernel reads
        start = q_start
        if VARLEN:
            start = (tl.cdiv(q_start, ALIGN) + b) * ALIGN
        out_rows = b * stride_rb + h * stride_rh + start + rows
        room = rows < tl.cdiv(N_Q, ALIGN) * ALIGN
        tl.store(LSE_ROWS + out_rows, tl.load(LSE + row_ptrs, mask=rows < N_Q, other=0.0), mask=room)
    else:
        out_rows = row_ptrs
        room = rows < N_Q
    tl.store(DELTA + out_rows, tl.sum(o * do, 1) - dlse, mask=room)
    if DQ is not None:  # the fused Gluon backward's fp32 sums: the sequence's whole tiles (BLOCK_M is its block_m)
        # all BLOCK_D columns, the kernel's width: its reductions store a tile's values in fragment order
        dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + (q_start + rows[:, None]) * stride_dqm + offs_d[None, :]
        store_tile(dq_ptrs, tl.zeros_like(o), rows, tl.cdiv(N_Q, BLOCK_M) * BLOCK_M, offs_d, BLOCK_D, False, True)


@triton.jit
def attention_backward_dq_convert_kernel(
    DQ_SUMS, DQ, stride_dqb, stride_dqm, stride_dqh, N, SUMS_ROWS, COLS, D: tl.constexpr, HEAD_D: tl.constexpr,
    BLOCK_M: tl.constexpr, HALF: tl.constexpr, FRAGMENTS: tl.constexpr, FRAGMENT_COLS: tl.constexpr,
    EVEN: tl.constexpr,
):  # fmt: skip
    """Grid (B * SUMS_ROWS / BLOCK_M, COLS / HALF): DQ ((B, N, H, HEAD_D), any strides, in the gradients' dtype) from
    the fused Hopper backward's fp32 sums, (B, SUMS_ROWS, H, D) contiguous (SUMS_ROWS >= N, whole BLOCK_M tiles; COLS
    = H * D; D the kernel's width, HEAD_D <= D), a tile of BLOCK_M x HALF per program. FRAGMENTS: the sums are laid
    out for the kernel's reductions: a tile's values as hopper/dkdv.py's _fragments orders a wgmma accumulator
    (BLOCK_M = 64, HALF = D / 2), the buffer's rows as (row tile, fragment row) and its columns as (column tile,
    FRAGMENT_COLS). Else row-major. EVEN: N == SUMS_ROWS, every row is dQ's (no mask: the masked store holds more
    registers)."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    if FRAGMENTS:
        TILE_ROWS: tl.constexpr = BLOCK_M * HALF // FRAGMENT_COLS
        rows = pid_m * TILE_ROWS + tl.arange(0, TILE_ROWS)
        cols = pid_n * FRAGMENT_COLS + tl.arange(0, FRAGMENT_COLS)
        sums = tl.load(DQ_SUMS + rows[:, None] * (COLS // HALF * FRAGMENT_COLS) + cols[None, :])
        # (w, j, r, c, h, e) -> (w, h, r, j, c, e): row 16w + 8h + r, column 8j + 2c + e
        sums = tl.permute(tl.reshape(sums, [4, HALF // 8, 8, 4, 2, 2]), (0, 4, 2, 1, 3, 5))
        sums = tl.reshape(sums, [BLOCK_M, HALF])
    else:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        sums = tl.load(DQ_SUMS + rows[:, None] * COLS + pid_n * HALF + tl.arange(0, HALF)[None, :])
    b = pid_m * BLOCK_M // SUMS_ROWS
    rows = pid_m * BLOCK_M % SUMS_ROWS + tl.arange(0, BLOCK_M)
    PARTS: tl.constexpr = D // HALF  # a head's column tiles
    # the column as a multiple of HALF, so that the stores are seen aligned and go out 16 bytes at a time
    at = DQ + b * stride_dqb + (pid_n // PARTS).to(tl.int64) * stride_dqh + pid_n % PARTS * HALF
    at += rows[:, None] * stride_dqm + tl.arange(0, HALF)[None, :]
    if EVEN and HEAD_D == D:
        tl.store(at, sums.to(DQ.dtype.element_ty))
    else:
        held = rows[:, None] < N
        if HEAD_D < D:  # sums as wide as the Gluon tiles: the columns past HEAD_D are none of dQ's
            held = held & (pid_n % PARTS * HALF + tl.arange(0, HALF) < HEAD_D)[None, :]
        tl.store(at, sums.to(DQ.dtype.element_ty), mask=held)


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v, q_ptrs, do_ptrs, q_tma, do_tma, lse_ptrs, delta_ptrs, stride_qm, stride_dom,
    cols, rows0, offs_d, lo, hi, N_Q, N_K, qk_scale, softcap, slope, window_left, window_right,
    seed, threshold, dropout_scale, b, h, MASK_TENSORS, SCORE_TENSORS,
    D: tl.constexpr, BLOCK_M: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr, DROPOUT: tl.constexpr, MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr,
    SCORE_GRAD: tl.constexpr, MASKED: tl.constexpr, APPLY_MOD: tl.constexpr, ROWS_IN_BOUNDS: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr, LIST=None, SUB: tl.constexpr = 1,
):  # fmt: skip
    """Accumulate query tiles into this key tile's dK, dV: the band [lo, hi) from pointers at query lo,
    or the BlockMask tiles LIST[lo:hi] (SUB tiles of BLOCK_M queries each) from query 0.

    ROWS_IN_BOUNDS: every row is < N_Q, so the loads need no row mask (masked loads in this loop
    cost registers the kernel does not have: 3x slower when every tile paid for them).
    STAGES: this loop's software-pipeline depth (None: the launch's num_stages). q_tma, do_tma:
    load_block's descriptors for in-bounds tiles.
    """
    PLAIN: tl.constexpr = not (SOFTCAP or ALIBI or SCORE_MOD is not None)
    CHAIN: tl.constexpr = SOFTCAP or SCORE_GRAD is not None  # dS picks up d logits / d score
    STEP: tl.constexpr = BLOCK_M if LIST is None else 1
    for it in tl.range(lo * SUB, hi * SUB, STEP, num_stages=STAGES):
        dk, dv = _dkdv_tile(
            dk, dv, k, v, q_ptrs, do_ptrs, q_tma, do_tma, lse_ptrs, delta_ptrs, stride_qm, stride_dom,
            tile_start(it, LIST, BLOCK_M, SUB), cols, rows0, offs_d, N_Q, N_K, qk_scale, softcap, slope,
            window_left, window_right, seed, threshold, dropout_scale, b, h, MASK_TENSORS, SCORE_TENSORS,
            D, LEFT, RIGHT, SOFTCAP, ALIBI, DROPOUT, MASK_MOD, SCORE_MOD, SCORE_GRAD, MASKED, APPLY_MOD,
            ROWS_IN_BOUNDS, EVEN_D, DOT_PRECISION, PLAIN, CHAIN, LIST is not None,
        )  # fmt: skip
        if LIST is None:
            q_ptrs += BLOCK_M * stride_qm
            do_ptrs += BLOCK_M * stride_dom
            lse_ptrs += BLOCK_M
            delta_ptrs += BLOCK_M
    return dk, dv


@triton.jit
def _dkdv_tile(
    dk, dv, k, v, q_ptrs, do_ptrs, q_tma, do_tma, lse_ptrs, delta_ptrs, stride_qm, stride_dom, start_m,
    cols, rows0, offs_d, N_Q, N_K, qk_scale, softcap, slope, window_left, window_right,
    seed, threshold, dropout_scale, b, h, MASK_TENSORS, SCORE_TENSORS,
    D: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr, DROPOUT: tl.constexpr, MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr,
    SCORE_GRAD: tl.constexpr, MASKED: tl.constexpr, APPLY_MOD: tl.constexpr, ROWS_IN_BOUNDS: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, PLAIN: tl.constexpr, CHAIN: tl.constexpr,
    OFFSET: tl.constexpr,
):  # fmt: skip
    """One query tile at start_m (pointers at start_m, or at query 0 with OFFSET) of _dkdv_tiles."""
    if OFFSET:
        q_ptrs += start_m.to(tl.int64) * stride_qm
        do_ptrs += start_m.to(tl.int64) * stride_dom
        lse_ptrs += start_m
        delta_ptrs += start_m
    rows = start_m + rows0
    q = load_block(q_tma, start_m, q_ptrs, rows, N_Q, offs_d, D, ROWS_IN_BOUNDS, EVEN_D)
    do = load_block(do_tma, start_m, do_ptrs, rows, N_Q, offs_d, D, ROWS_IN_BOUNDS, EVEN_D)
    # Rows past N_Q load LSE = +inf, so their P is 0 and they add nothing.
    lse2 = load_rows(lse_ptrs, rows, N_Q, float("inf"), ROWS_IN_BOUNDS) * LOG2E
    delta = load_rows(delta_ptrs, rows, N_Q, 0.0, ROWS_IN_BOUNDS)
    # work transposed ([keys, queries]) so dK and dV accumulate without transposing them
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
    s_scale = qk_scale
    if not PLAIN:
        s_t, deriv_t = logits(
            s_t, rows[None, :], cols[:, None], N_K - N_Q, qk_scale, softcap, slope, b, h, N_Q, N_K,
            SCORE_TENSORS, SOFTCAP, ALIBI, SCORE_MOD, SCORE_GRAD,
        )  # fmt: skip
        s_scale = 1.0
    p_t = tl.math.exp2(s_t * s_scale - lse2[None, :])
    if MASKED:
        mask = tile_mask(
            rows, cols, N_Q, N_K, window_left, window_right, b, h, MASK_TENSORS, LEFT, RIGHT, MASK_MOD, APPLY_MOD
        )
        p_t = tl.where(tl.trans(mask), p_t, 0.0)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    if DROPOUT:
        keep_t = dropout_keep(seed, b, h, rows[None, :], cols[:, None], threshold)
        dv = tl.dot(tl.where(keep_t, p_t * dropout_scale, 0.0).to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.where(keep_t, dp_t * dropout_scale, 0.0)
    else:
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    if CHAIN:
        ds_t = ds_t * deriv_t
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["N_Q", "N_K", "H", "GROUP", "window_left", "window_right", "seed", "threshold"])
def attention_backward_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, Q_DESC, DO_DESC,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_lb, stride_lh,
    N_Q, N_K, qk_scale, softmax_scale, H, GROUP,
    CU_SEQLENS_Q, CU_SEQLENS_K, ALIBI_SLOPES, softcap, window_left, window_right, seed, threshold, dropout_scale,
    TILE_NUM, TILE_IDX, FULL_NUM, FULL_IDX, stride_sb, stride_sh, MASK_TENSORS, SCORE_TENSORS,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LEFT: tl.constexpr, RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    VARLEN: tl.constexpr, SPARSE: tl.constexpr, SPARSE_BLOCK_M: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr,
    MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr, EDGE_STAGES: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_bhk = head_program()
    HKV = H // GROUP
    b = (pid_bhk // HKV).to(tl.int64)
    hk = (pid_bhk % HKV).to(tl.int64)
    stride_qm, stride_kn, stride_vn, stride_dom = wide(stride_qm), wide(stride_kn), wide(stride_vn), wide(stride_dom)
    stride_dkn, stride_dvn = wide(stride_dkn), wide(stride_dvn)
    n0 = pid_n * BLOCK_N
    q_row = b * N_Q  # of Q and dO's (rows, heads * D) views; a varlen sequence's first row instead
    q_start, k_start, N_Q, N_K = sequence(CU_SEQLENS_Q, CU_SEQLENS_K, b, N_Q, N_K, VARLEN)
    if VARLEN:
        if n0 >= N_K:
            return
        q_row = q_start
    EVEN_D: tl.constexpr = BLOCK_D == D

    cols = n0 + tl.arange(0, BLOCK_N)
    rows0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k_ptrs = K + b * stride_kb + hk * stride_kh + (k_start + cols[:, None]) * stride_kn + offs_d[None, :]
    v_ptrs = V + b * stride_vb + hk * stride_vh + (k_start + cols[:, None]) * stride_vn + offs_d[None, :]
    # Keys past N_K load as 0; their dK/dV rows are computed but never stored.
    k = load_tile(k_ptrs, cols, N_K, offs_d, D, EVEN_N, EVEN_D)
    v = load_tile(v_ptrs, cols, N_K, offs_d, D, EVEN_N, EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    lo, full_lo, full_hi, hi = query_range(n0, N_Q, N_K, window_left, window_right, BLOCK_M, BLOCK_N, LEFT, RIGHT)
    for g in range(GROUP):
        h = hk * GROUP + g
        slope = 0.0
        if ALIBI:
            slope = tl.load(ALIBI_SLOPES + b * H + h)
        q_base = Q + b * stride_qb + h * stride_qh + (q_start + rows0[:, None]) * stride_qm + offs_d[None, :]
        do_base = DO + b * stride_dob + h * stride_doh + (q_start + rows0[:, None]) * stride_dom + offs_d[None, :]
        row_base = b * stride_lb + h * stride_lh + q_start + rows0
        q_tma = (Q_DESC, q_row, (h * D).to(tl.int32))
        do_tma = (DO_DESC, q_row, (h * D).to(tl.int32))
        if SPARSE:
            # this key tile's column of the block mask: full query tiles (unmasked: rows past N_Q are
            # neutralised by their loads; EVEN_M is then about SPARSE_BLOCK_M), then partial ones through MASK_MOD
            col = b * stride_sb + h * stride_sh + n0 // SPARSE_BLOCK_N
            for i in tl.static_range(2):
                tiles, count = listed(i, FULL_NUM, FULL_IDX, TILE_NUM, TILE_IDX, col, tl.cdiv(N_Q, SPARSE_BLOCK_M))
                dk, dv = _dkdv_tiles(
                    dk, dv, k, v, q_base, do_base, q_tma, do_tma, LSE + row_base, DELTA + row_base,
                    stride_qm, stride_dom, cols, rows0, offs_d, 0, count, N_Q, N_K, qk_scale, softcap, slope,
                    window_left, window_right, seed, threshold, dropout_scale, b, h, MASK_TENSORS, SCORE_TENSORS,
                    D, BLOCK_M, LEFT, RIGHT, SOFTCAP, ALIBI, DROPOUT, MASK_MOD, SCORE_MOD, SCORE_GRAD,
                    i == 1, i == 1, EVEN_M, EVEN_D, DOT_PRECISION, None, tiles, SPARSE_BLOCK_M // BLOCK_M,
                )  # fmt: skip
        else:
            # the band's stretches of query tiles: lower edge (masked), whole tiles, upper edge (masked),
            # ragged last tile (masked, bounds-checked; none when N_Q is a whole number of tiles)
            # Without window bounds, TMA folds the ragged tile into the trailing edge: one loop body
            # fewer, faster unbanded (banded cases lose with it)
            FOLD: tl.constexpr = Q_DESC is not None and not (EVEN_M or LEFT or RIGHT)
            for i in tl.static_range(4 - (EVEN_M or FOLD)):
                start, end = band_stretch(i, lo, full_lo, full_hi, hi, N_Q if FOLD else N_Q // BLOCK_M * BLOCK_M)
                offset = tl.cast(start, tl.int64)
                dk, dv = _dkdv_tiles(
                    dk, dv, k, v, q_base + offset * stride_qm, do_base + offset * stride_dom, q_tma, do_tma,
                    LSE + row_base + offset, DELTA + row_base + offset, stride_qm, stride_dom,
                    cols, rows0, offs_d, start, end, N_Q, N_K, qk_scale, softcap, slope, window_left, window_right,
                    seed, threshold, dropout_scale, b, h, MASK_TENSORS, SCORE_TENSORS,
                    D, BLOCK_M, LEFT, RIGHT, SOFTCAP, ALIBI, DROPOUT, MASK_MOD, SCORE_MOD, SCORE_GRAD,
                    i != 1, False, i == 1 or (i != 3 and not FOLD), EVEN_D,
                    DOT_PRECISION, None if i == 1 else (1 if i == 3 else EDGE_STAGES),
                )  # fmt: skip

    # S = softmax_scale * Q K^T, so dK picks up the scale once here.
    dk = dk * softmax_scale
    dk_ptrs = DK + b * stride_dkb + hk * stride_dkh + (k_start + cols[:, None]) * stride_dkn + offs_d[None, :]
    dv_ptrs = DV + b * stride_dvb + hk * stride_dvh + (k_start + cols[:, None]) * stride_dvn + offs_d[None, :]
    store_tile(dk_ptrs, dk.to(DK.dtype.element_ty), cols, N_K, offs_d, D, EVEN_N, EVEN_D)
    store_tile(dv_ptrs, dv.to(DV.dtype.element_ty), cols, N_K, offs_d, D, EVEN_N, EVEN_D)


@triton.jit
def _dq_tiles(
    dq, q, do, lse2, delta, k_ptrs, v_ptrs, k_tma, v_tma, stride_kn, stride_vn,
    rows, cols0, offs_d, lo, hi, N_Q, N_K, qk_scale, softcap, slope, window_left, window_right,
    seed, threshold, dropout_scale, b, h, MASK_TENSORS, SCORE_TENSORS,
    D: tl.constexpr, BLOCK_N: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr, DROPOUT: tl.constexpr, MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr,
    SCORE_GRAD: tl.constexpr, MASKED: tl.constexpr, APPLY_MOD: tl.constexpr, IN_BOUNDS: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr, LIST=None, SUB: tl.constexpr = 1,
):  # fmt: skip
    """Accumulate key tiles into this query tile's dQ, walked as the forward's _attend_tiles walks them
    (a band [lo, hi) from pointers at key lo, or the BlockMask tiles LIST[lo:hi] from key 0).

    IN_BOUNDS: every key is < N_K, so K and V load without a bounds mask. STAGES, k_tma, v_tma as in
    _dkdv_tiles.
    """
    PLAIN: tl.constexpr = not (SOFTCAP or ALIBI or SCORE_MOD is not None)
    CHAIN: tl.constexpr = SOFTCAP or SCORE_GRAD is not None  # dS picks up d logits / d score
    STEP: tl.constexpr = BLOCK_N if LIST is None else 1
    for it in tl.range(lo * SUB, hi * SUB, STEP, num_stages=STAGES):
        dq = _dq_tile(
            dq, q, do, lse2, delta, k_ptrs, v_ptrs, k_tma, v_tma, stride_kn, stride_vn,
            tile_start(it, LIST, BLOCK_N, SUB),
            rows, cols0, offs_d, N_Q, N_K, qk_scale, softcap, slope, window_left, window_right,
            seed, threshold, dropout_scale, b, h, MASK_TENSORS, SCORE_TENSORS,
            D, LEFT, RIGHT, SOFTCAP, ALIBI, DROPOUT, MASK_MOD, SCORE_MOD, SCORE_GRAD, MASKED, APPLY_MOD,
            IN_BOUNDS, EVEN_D, DOT_PRECISION, PLAIN, CHAIN, LIST is not None,
        )  # fmt: skip
        if LIST is None:
            k_ptrs += BLOCK_N * stride_kn
            v_ptrs += BLOCK_N * stride_vn
    return dq


@triton.jit
def _dq_tile(
    dq, q, do, lse2, delta, k_ptrs, v_ptrs, k_tma, v_tma, stride_kn, stride_vn, start_n,
    rows, cols0, offs_d, N_Q, N_K, qk_scale, softcap, slope, window_left, window_right,
    seed, threshold, dropout_scale, b, h, MASK_TENSORS, SCORE_TENSORS,
    D: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr, DROPOUT: tl.constexpr, MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr,
    SCORE_GRAD: tl.constexpr, MASKED: tl.constexpr, APPLY_MOD: tl.constexpr, IN_BOUNDS: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, PLAIN: tl.constexpr, CHAIN: tl.constexpr,
    OFFSET: tl.constexpr,
):  # fmt: skip
    """One key tile at start_n (pointers at start_n, or at key 0 with OFFSET) of _dq_tiles."""
    if OFFSET:
        k_ptrs += start_n.to(tl.int64) * stride_kn
        v_ptrs += start_n.to(tl.int64) * stride_vn
    cols = start_n + cols0
    k = load_block(k_tma, start_n, k_ptrs, cols, N_K, offs_d, D, IN_BOUNDS, EVEN_D)
    v = load_block(v_tma, start_n, v_ptrs, cols, N_K, offs_d, D, IN_BOUNDS, EVEN_D)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    s_scale = qk_scale
    if not PLAIN:
        s, deriv = logits(
            s, rows[:, None], cols[None, :], N_K - N_Q, qk_scale, softcap, slope, b, h, N_Q, N_K, SCORE_TENSORS,
            SOFTCAP, ALIBI, SCORE_MOD, SCORE_GRAD,
        )  # fmt: skip
        s_scale = 1.0
    p = tl.math.exp2(s * s_scale - lse2[:, None])
    if MASKED:
        mask = tile_mask(
            rows, cols, N_Q, N_K, window_left, window_right, b, h, MASK_TENSORS, LEFT, RIGHT, MASK_MOD, APPLY_MOD
        )
        p = tl.where(mask, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    if DROPOUT:
        dp = tl.where(dropout_keep(seed, b, h, rows[:, None], cols[None, :], threshold), dp * dropout_scale, 0.0)
    ds = p * (dp - delta[:, None])
    if CHAIN:
        ds = ds * deriv
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["N_Q", "N_K", "H", "GROUP", "window_left", "window_right", "seed", "threshold"])
def attention_backward_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, K_DESC, V_DESC,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_lb, stride_lh,
    N_Q, N_K, qk_scale, softmax_scale, H, GROUP,
    CU_SEQLENS_Q, CU_SEQLENS_K, ALIBI_SLOPES, softcap, window_left, window_right, seed, threshold, dropout_scale,
    TILE_NUM, TILE_IDX, FULL_NUM, FULL_IDX, stride_sb, stride_sh, MASK_TENSORS, SCORE_TENSORS,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LEFT: tl.constexpr, RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    VARLEN: tl.constexpr, SPARSE: tl.constexpr, SPARSE_BLOCK_M: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr,
    MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr, EDGE_STAGES: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = head_program()
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP
    stride_qm, stride_kn, stride_vn, stride_dom = wide(stride_qm), wide(stride_kn), wide(stride_vn), wide(stride_dom)
    stride_dqm = wide(stride_dqm)
    m0 = pid_m * BLOCK_M
    kv_row = b * N_K  # as in the forward
    q_start, k_start, N_Q, N_K = sequence(CU_SEQLENS_Q, CU_SEQLENS_K, b, N_Q, N_K, VARLEN)
    if VARLEN:
        if m0 >= N_Q:
            return
        kv_row = k_start
    k_tma = (K_DESC, kv_row, (hk * D).to(tl.int32))
    v_tma = (V_DESC, kv_row, (hk * D).to(tl.int32))
    slope = 0.0
    if ALIBI:
        slope = tl.load(ALIBI_SLOPES + b * H + h)
    EVEN_D: tl.constexpr = BLOCK_D == D

    rows = m0 + tl.arange(0, BLOCK_M)
    cols0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = Q + b * stride_qb + h * stride_qh + (q_start + rows[:, None]) * stride_qm + offs_d[None, :]
    do_ptrs = DO + b * stride_dob + h * stride_doh + (q_start + rows[:, None]) * stride_dom + offs_d[None, :]
    q = load_tile(q_ptrs, rows, N_Q, offs_d, D, EVEN_M, EVEN_D)
    do = load_tile(do_ptrs, rows, N_Q, offs_d, D, EVEN_M, EVEN_D)
    row_ptrs = b * stride_lb + h * stride_lh + q_start + rows
    lse2 = load_rows(LSE + row_ptrs, rows, N_Q, float("inf"), EVEN_M) * LOG2E
    delta = load_rows(DELTA + row_ptrs, rows, N_Q, 0.0, EVEN_M)

    k_base = K + b * stride_kb + hk * stride_kh + (k_start + cols0[:, None]) * stride_kn + offs_d[None, :]
    v_base = V + b * stride_vb + hk * stride_vh + (k_start + cols0[:, None]) * stride_vn + offs_d[None, :]
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if SPARSE:
        # as the forward: full key tiles, then partial ones through MASK_MOD
        row = b * stride_sb + h * stride_sh + m0 // SPARSE_BLOCK_M
        for i in tl.static_range(2):
            tiles, count = listed(i, FULL_NUM, FULL_IDX, TILE_NUM, TILE_IDX, row, tl.cdiv(N_K, SPARSE_BLOCK_N))
            dq = _dq_tiles(
                dq, q, do, lse2, delta, k_base, v_base, k_tma, v_tma, stride_kn, stride_vn, rows, cols0, offs_d,
                0, count, N_Q, N_K, qk_scale, softcap, slope, window_left, window_right, seed, threshold, dropout_scale,
                b, h, MASK_TENSORS, SCORE_TENSORS, D, BLOCK_N, LEFT, RIGHT, SOFTCAP, ALIBI, DROPOUT, MASK_MOD,
                SCORE_MOD, SCORE_GRAD, i == 1 or not EVEN_N, i == 1, EVEN_N, EVEN_D, DOT_PRECISION, None,
                tiles, SPARSE_BLOCK_N // BLOCK_N,
            )  # fmt: skip
    else:
        lo, full_lo, full_hi, hi = key_range(m0, N_Q, N_K, window_left, window_right, BLOCK_M, BLOCK_N, LEFT, RIGHT)
        FOLD: tl.constexpr = K_DESC is not None and not (EVEN_N or LEFT or RIGHT)  # as in dK/dV
        for i in tl.static_range(4 - (EVEN_N or FOLD)):  # the forward's stretches
            start, end = band_stretch(i, lo, full_lo, full_hi, hi, N_K if FOLD else N_K // BLOCK_N * BLOCK_N)
            offset = tl.cast(start, tl.int64)
            dq = _dq_tiles(
                dq, q, do, lse2, delta, k_base + offset * stride_kn, v_base + offset * stride_vn, k_tma, v_tma,
                stride_kn, stride_vn,
                rows, cols0, offs_d, start, end, N_Q, N_K, qk_scale, softcap, slope, window_left, window_right,
                seed, threshold, dropout_scale, b, h, MASK_TENSORS, SCORE_TENSORS,
                D, BLOCK_N, LEFT, RIGHT, SOFTCAP, ALIBI, DROPOUT, MASK_MOD, SCORE_MOD, SCORE_GRAD,
                i != 1, False, i == 1 or (i != 3 and not FOLD), EVEN_D,
                DOT_PRECISION, None if i == 1 else (1 if i == 3 else EDGE_STAGES),
            )  # fmt: skip

    dq = dq * softmax_scale
    dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + (q_start + rows[:, None]) * stride_dqm + offs_d[None, :]
    store_tile(dq_ptrs, dq.to(DQ.dtype.element_ty), rows, N_Q, offs_d, D, EVEN_M, EVEN_D)
