"""FlashAttention-2 backward kernels: preprocess, dK/dV, dQ.

Notation (as in forward.py)
  B, H, HKV, GROUP, N_Q, N_K, offset, D, BLOCK_D
  BLOCK_M, BLOCK_N   query / key tile edges of the kernel at hand

Nothing of size N_Q x N_K is stored: every kernel recomputes P = exp2(S * qk_scale - LSE2) from
Q, K and the forward's LSE, one tile at a time.

  preprocess   grid (cdiv(N_Q, BLOCK_M), B * H): delta = rowsum(dO * O) - dLSE, fp32.
               (Subtracting dLSE makes gradients flow through the returned LSE for free:
               dS = P * (dP - delta) with d(LSE)/dS = P.)
  dK/dV        grid (cdiv(N_K, BLOCK_N), B * HKV): a program owns one key tile of one K/V head and
               streams the query tiles of all GROUP query heads that see it, so GQA needs no atomics.
  dQ           grid (cdiv(N_Q, BLOCK_M), B * H): a program owns one query tile and streams the keys
               it sees, exactly as the forward does.

Each output element is written by exactly one program in a fixed order: the backward is
deterministic (bitwise reproducible) whatever ``deterministic`` says.
Causal: key tiles above the diagonal are skipped in both passes; only diagonal tiles are masked.
"""

import triton
import triton.language as tl

from .common import LOG2E, key_range, load_rows, load_tile, query_range, store_tile, visible


@triton.jit(do_not_specialize=["N_Q", "H"])
def attention_backward_preprocess_kernel(
    O, DO, DLSE, DELTA,
    stride_ob, stride_om, stride_oh,
    stride_dob, stride_dom, stride_doh,
    N_Q, H,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o_ptrs = O + b * stride_ob + h * stride_oh + rows[:, None].to(tl.int64) * stride_om + offs_d[None, :]
    do_ptrs = DO + b * stride_dob + h * stride_doh + rows[:, None].to(tl.int64) * stride_dom + offs_d[None, :]
    o = load_tile(o_ptrs, rows, N_Q, offs_d, D, False, BLOCK_D == D).to(tl.float32)
    do = load_tile(do_ptrs, rows, N_Q, offs_d, D, False, BLOCK_D == D).to(tl.float32)
    row_ptrs = pid_bh.to(tl.int64) * N_Q + rows
    dlse = tl.load(DLSE + row_ptrs, mask=rows < N_Q, other=0.0)
    tl.store(DELTA + row_ptrs, tl.sum(o * do, 1) - dlse, mask=rows < N_Q)


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_dom,
    cols, rows0, offs_d, lo, hi, N_Q, N_K, qk_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Accumulate the query tiles [lo, hi) into this key tile's dK, dV; pointers start at query lo."""
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + rows0
        q = load_tile(q_ptrs, rows, N_Q, offs_d, D, EVEN_M, EVEN_D)
        do = load_tile(do_ptrs, rows, N_Q, offs_d, D, EVEN_M, EVEN_D)
        # Rows past N_Q load LSE = +inf, so their P is 0 and they add nothing.
        lse2 = load_rows(lse_ptrs, rows, N_Q, float("inf"), EVEN_M) * LOG2E
        delta = load_rows(delta_ptrs, rows, N_Q, 0.0, EVEN_M)
        # work transposed ([keys, queries]) so dK and dV accumulate without transposing them
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])
        if MASKED:
            p_t = tl.where(tl.trans(visible(rows, cols, N_Q, N_K, CAUSAL)), p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
        lse_ptrs += BLOCK_M
        delta_ptrs += BLOCK_M
    return dk, dv


@triton.jit(do_not_specialize=["N_Q", "N_K", "H", "GROUP"])
def attention_backward_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    N_Q, N_K, qk_scale, softmax_scale, H, GROUP,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_bhk = tl.program_id(1)
    HKV = H // GROUP
    b = (pid_bhk // HKV).to(tl.int64)
    hk = (pid_bhk % HKV).to(tl.int64)
    n0 = pid_n * BLOCK_N
    EVEN_D: tl.constexpr = BLOCK_D == D

    cols = n0 + tl.arange(0, BLOCK_N)
    rows0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k_ptrs = K + b * stride_kb + hk * stride_kh + cols[:, None].to(tl.int64) * stride_kn + offs_d[None, :]
    v_ptrs = V + b * stride_vb + hk * stride_vh + cols[:, None].to(tl.int64) * stride_vn + offs_d[None, :]
    # Keys past N_K load as 0; their dK/dV rows are computed but never stored.
    k = load_tile(k_ptrs, cols, N_K, offs_d, D, EVEN_N, EVEN_D)
    v = load_tile(v_ptrs, cols, N_K, offs_d, D, EVEN_N, EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    lo, full_lo, hi = query_range(n0, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    lo64 = tl.cast(lo, tl.int64)
    full_lo64 = tl.cast(full_lo, tl.int64)
    for g in range(GROUP):
        h = hk * GROUP + g
        q_base = Q + b * stride_qb + h * stride_qh + rows0[:, None] * stride_qm + offs_d[None, :]
        do_base = DO + b * stride_dob + h * stride_doh + rows0[:, None] * stride_dom + offs_d[None, :]
        row_base = (b * H + h) * N_Q
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_base + lo64 * stride_qm, do_base + lo64 * stride_dom,
            LSE + row_base + lo64 + rows0, DELTA + row_base + lo64 + rows0, stride_qm, stride_dom,
            cols, rows0, offs_d, lo, full_lo, N_Q, N_K, qk_scale,
            D, BLOCK_M, CAUSAL, True, EVEN_M, EVEN_D, DOT_PRECISION,
        )  # fmt: skip
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_base + full_lo64 * stride_qm, do_base + full_lo64 * stride_dom,
            LSE + row_base + full_lo64 + rows0, DELTA + row_base + full_lo64 + rows0, stride_qm, stride_dom,
            cols, rows0, offs_d, full_lo, hi, N_Q, N_K, qk_scale,
            D, BLOCK_M, CAUSAL, False, EVEN_M, EVEN_D, DOT_PRECISION,
        )  # fmt: skip

    # S = softmax_scale * Q K^T, so dK picks up the scale once here.
    dk = dk * softmax_scale
    dk_ptrs = DK + b * stride_dkb + hk * stride_dkh + cols[:, None].to(tl.int64) * stride_dkn + offs_d[None, :]
    dv_ptrs = DV + b * stride_dvb + hk * stride_dvh + cols[:, None].to(tl.int64) * stride_dvn + offs_d[None, :]
    store_tile(dk_ptrs, dk.to(DK.dtype.element_ty), cols, N_K, offs_d, D, EVEN_N, EVEN_D)
    store_tile(dv_ptrs, dv.to(DV.dtype.element_ty), cols, N_K, offs_d, D, EVEN_N, EVEN_D)


@triton.jit
def _dq_tiles(
    dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn,
    rows, cols0, offs_d, lo, hi, N_Q, N_K, qk_scale,
    D: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Accumulate the key tiles [lo, hi) into this query tile's dQ; pointers start at key lo."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + cols0
        k = load_tile(k_ptrs, cols, N_K, offs_d, D, not MASKED, EVEN_D)
        v = load_tile(v_ptrs, cols, N_K, offs_d, D, not MASKED, EVEN_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
        if MASKED:
            p = tl.where(visible(rows, cols, N_Q, N_K, CAUSAL), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return dq


@triton.jit(do_not_specialize=["N_Q", "N_K", "H", "GROUP"])
def attention_backward_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    N_Q, N_K, qk_scale, softmax_scale, H, GROUP,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    EVEN_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP
    m0 = pid_m * BLOCK_M
    EVEN_D: tl.constexpr = BLOCK_D == D

    rows = m0 + tl.arange(0, BLOCK_M)
    cols0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = Q + b * stride_qb + h * stride_qh + rows[:, None].to(tl.int64) * stride_qm + offs_d[None, :]
    do_ptrs = DO + b * stride_dob + h * stride_doh + rows[:, None].to(tl.int64) * stride_dom + offs_d[None, :]
    q = load_tile(q_ptrs, rows, N_Q, offs_d, D, EVEN_M, EVEN_D)
    do = load_tile(do_ptrs, rows, N_Q, offs_d, D, EVEN_M, EVEN_D)
    row_ptrs = pid_bh.to(tl.int64) * N_Q + rows
    lse2 = load_rows(LSE + row_ptrs, rows, N_Q, float("inf"), EVEN_M) * LOG2E
    delta = load_rows(DELTA + row_ptrs, rows, N_Q, 0.0, EVEN_M)

    k_base = K + b * stride_kb + hk * stride_kh + cols0[:, None] * stride_kn + offs_d[None, :]
    v_base = V + b * stride_vb + hk * stride_vh + cols0[:, None] * stride_vn + offs_d[None, :]
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    full_hi, hi = key_range(m0, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    dq = _dq_tiles(
        dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn,
        rows, cols0, offs_d, 0, full_hi, N_Q, N_K, qk_scale,
        D, BLOCK_N, CAUSAL, False, EVEN_D, DOT_PRECISION,
    )  # fmt: skip
    start = tl.cast(full_hi, tl.int64)
    dq = _dq_tiles(
        dq, q, do, lse2, delta, k_base + start * stride_kn, v_base + start * stride_vn, stride_kn, stride_vn,
        rows, cols0, offs_d, full_hi, hi, N_Q, N_K, qk_scale,
        D, BLOCK_N, CAUSAL, True, EVEN_D, DOT_PRECISION,
    )  # fmt: skip

    dq = dq * softmax_scale
    dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + rows[:, None].to(tl.int64) * stride_dqm + offs_d[None, :]
    store_tile(dq_ptrs, dq.to(DQ.dtype.element_ty), rows, N_Q, offs_d, D, EVEN_M, EVEN_D)
