"""FlashAttention-2 forward kernel.

Notation
  B, H, HKV    batch, query heads, key/value heads; GROUP = H // HKV query heads share a K/V head
  N_Q, N_K     query and key sequence lengths; offset = N_K - N_Q (causal mask is bottom-right)
  D, BLOCK_D   head dim, and head dim rounded up to a power of two (columns >= D masked)
  BLOCK_M      query rows owned by one program
  BLOCK_N      key rows streamed per inner step

Grid: (cdiv(N_Q, BLOCK_M), B * H). One program computes O[b, m0:m0+BLOCK_M, h, :] and its LSE:
it keeps the Q tile in registers, streams the K/V tiles the rows can see through on-chip memory,
and keeps a running max m, running sum l and unnormalised accumulator (online softmax).
Normalisation by l happens once, after the last tile.

Numerics: scores are taken in base 2 with softmax_scale * LOG2E folded into one multiply
(qk_scale), so m is in base-2 units; l and the accumulator are fp32. The LSE written out is
natural-log (flash_attn's softmax_lse). A row that sees no key gets O = 0 and LSE = +inf, so the
backward's exp2(s - LSE) is exactly 0 there.
Causal: tiles entirely above the diagonal are never visited; only tiles on the diagonal (and the
ragged last key tile) pay for the element mask.
"""

import triton
import triton.language as tl

from .common import LN2, key_range, load_tile, store_tile, visible


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn,
    rows, cols0, offs_d, lo, hi, N_Q, N_K, qk_scale,
    D: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Fold key tiles [lo, hi) into the running (acc, l_i, m_i); pointers start at key lo."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + cols0
        k = load_tile(k_ptrs, cols, N_K, offs_d, D, not MASKED, EVEN_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            s = tl.where(visible(rows, cols, N_Q, N_K, CAUSAL), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        if MASKED:
            # A row with no visible key so far keeps m = -inf; shift by 0 instead to avoid inf - inf.
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        # rescale what was accumulated under the old max
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = load_tile(v_ptrs, cols, N_K, offs_d, D, not MASKED, EVEN_D)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["N_Q", "N_K", "H", "GROUP"])
def attention_forward_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    N_Q, N_K, qk_scale, H, GROUP,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, EVEN_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP
    m0 = pid_m * BLOCK_M

    rows = m0 + tl.arange(0, BLOCK_M)
    cols0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    EVEN_D: tl.constexpr = BLOCK_D == D

    q_ptrs = Q + b * stride_qb + h * stride_qh + rows[:, None].to(tl.int64) * stride_qm + offs_d[None, :]
    q = load_tile(q_ptrs, rows, N_Q, offs_d, D, EVEN_M, EVEN_D)

    k_base = K + b * stride_kb + hk * stride_kh + cols0[:, None] * stride_kn + offs_d[None, :]
    v_base = V + b * stride_vb + hk * stride_vh + cols0[:, None] * stride_vn + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    full_hi, hi = key_range(m0, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
        rows, cols0, offs_d, 0, full_hi, N_Q, N_K, qk_scale,
        D, BLOCK_N, CAUSAL, False, EVEN_D, DOT_PRECISION,
    )  # fmt: skip
    start = tl.cast(full_hi, tl.int64)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, k_base + start * stride_kn, v_base + start * stride_vn, stride_kn, stride_vn,
        rows, cols0, offs_d, full_hi, hi, N_Q, N_K, qk_scale,
        D, BLOCK_N, CAUSAL, True, EVEN_D, DOT_PRECISION,
    )  # fmt: skip

    # epilogue: normalise once; rows that saw no key get O = 0 and LSE = +inf
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(l_safe)) * LN2)

    o_ptrs = O + b * stride_ob + h * stride_oh + rows[:, None].to(tl.int64) * stride_om + offs_d[None, :]
    store_tile(o_ptrs, out.to(O.dtype.element_ty), rows, N_Q, offs_d, D, EVEN_M, EVEN_D)
    lse_ptrs = LSE + pid_bh.to(tl.int64) * N_Q + rows
    if EVEN_M:
        tl.store(lse_ptrs, lse)
    else:
        tl.store(lse_ptrs, lse, mask=rows < N_Q)
