"""FlashAttention-2 forward kernel.

Notation
  B, H, HKV    batch, query heads, key/value heads; GROUP = H // HKV query heads share a K/V head
  N_Q, N_K     query and key sequence lengths; offset = N_K - N_Q (causal mask is bottom-right)
  D, BLOCK_D   head dim, and head dim rounded up to a power of two (columns >= D masked)
  BLOCK_M      query rows owned by one program
  BLOCK_N      key rows streamed per inner step

Feature flags (tl.constexpr; params.py has the semantics)
  LEFT, RIGHT  the window band has a left / right bound (causal: RIGHT with window_right = 0)
  SOFTCAP      score = softcap * tanh(score / softcap); 2: tanh by its series near 0 too (config.softcap_mode)
  ALIBI        score -= slope[b, h] * |i + offset - j|
  DROPOUT      P is dropped by the Philox mask of dropout.py and rescaled by 1 / (1 - p)
  VARLEN       sequence b is rows CU_SEQLENS_Q[b]:CU_SEQLENS_Q[b + 1] of a packed batch; N_Q, N_K
               are then that sequence's lengths and programs past its end exit at once
  SPARSE       visit the key tiles a BlockMask lists for this query tile (block_mask.py has the
               layout; SPARSE_BLOCK_M/N are its tile edges, multiples of BLOCK_M/N) instead of the
               window band: its full tiles unmasked, its partial tiles through MASK_MOD
  MASK_MOD, SCORE_MOD, SCORE_GRAD   user @triton.jit functions (mods.py) or None, with their
               tensors in the tuples MASK_TENSORS / SCORE_TENSORS
  K_DESC, V_DESC   tensor descriptors of K and V's (rows, heads * D) views, or None: K/V tiles then
               come through the copy engine (TMA) instead of pointer loads
  SINKS        (H,) fp32 or None: each row's softmax has one more logit, SINKS[h] (natural units), which
               the epilogue folds into the running max and sum; it multiplies no V row

Grid: (cdiv(N_Q, BLOCK_M), B * H), with N_Q the longest sequence under VARLEN. One program computes
O[b, m0:m0+BLOCK_M, h, :] and its LSE (unless LSE is None):
it keeps the Q tile in registers, streams the K/V tiles the rows can see through on-chip memory,
and keeps a running max m, running sum l and unnormalised accumulator (online softmax).
Normalisation by l happens once, after the last tile.

Numerics: scores are taken in base 2 with softmax_scale * LOG2E folded into one multiply
(qk_scale), so m is in base-2 units; l and the accumulator are fp32. The LSE written out is
natural-log (flash_attn's softmax_lse). A row that sees no key gets O = 0 and LSE = empty_lse: +inf for a
final result, so the backward's exp2(s - LSE) is exactly 0 there, -inf for a partial one that a merge combines;
with a finite sink, LSE = SINKS[h] (params.py).
Masks: key tiles outside the window band (above the causal diagonal) are never visited; only tiles
that cross a band edge (and the ragged last key tile) pay for the element mask.
"""

import triton
import triton.language as tl

from .common import (
    LN2,
    LOG2E,
    add_sink,
    band_stretch,
    dropout_keep,
    head_program,
    key_range,
    listed,
    load_block,
    load_tile,
    logits,
    sequence,
    store_tile,
    tile_mask,
    tile_start,
    wide,
)


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q, k_ptrs, v_ptrs, k_tma, v_tma, stride_kn, stride_vn,
    rows, cols0, offs_d, lo, hi, N_Q, N_K, qk_scale, softcap, slope, window_left, window_right,
    seed, threshold, b, h, MASK_TENSORS, SCORE_TENSORS,
    D: tl.constexpr, BLOCK_N: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr, DROPOUT: tl.constexpr, MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr,
    MASKED: tl.constexpr, APPLY_MOD: tl.constexpr, IN_BOUNDS: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr, LIST=None, SUB: tl.constexpr = 1,
):  # fmt: skip
    """Fold key tiles into the running (acc, l_i, m_i): the band [lo, hi), pointers starting at key lo,
    or with LIST the BlockMask tiles LIST[lo:hi], pointers at key 0, each SUB tiles of BLOCK_N keys.

    MASKED tiles get the bounds and window mask and, with APPLY_MOD, the user's MASK_MOD;
    IN_BOUNDS: every key is < N_K, so K and V load without a bounds mask. STAGES: this loop's
    software-pipeline depth (None: the launch's num_stages); one loop over all listed tiles lets
    the pipeline prefetch across them. k_tma, v_tma: load_block's descriptors for in-bounds tiles.
    """
    # Plain scores stay raw and take qk_scale inside the exp2's FMA; modified ones arrive in base 2.
    PLAIN: tl.constexpr = not (SOFTCAP or ALIBI or SCORE_MOD is not None)
    STEP: tl.constexpr = BLOCK_N if LIST is None else 1
    for it in tl.range(lo * SUB, hi * SUB, STEP, num_stages=STAGES):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, k_tma, v_tma, stride_kn, stride_vn, tile_start(it, LIST, BLOCK_N, SUB),
            rows, cols0, offs_d, N_Q, N_K, qk_scale, softcap, slope, window_left, window_right,
            seed, threshold, b, h, MASK_TENSORS, SCORE_TENSORS,
            D, LEFT, RIGHT, SOFTCAP, ALIBI, DROPOUT, MASK_MOD, SCORE_MOD, MASKED, APPLY_MOD, IN_BOUNDS,
            EVEN_D, DOT_PRECISION, PLAIN, LIST is not None,
        )  # fmt: skip
        if LIST is None:
            k_ptrs += BLOCK_N * stride_kn
            v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def _attend_tile(
    acc, l_i, m_i, q, k_ptrs, v_ptrs, k_tma, v_tma, stride_kn, stride_vn, start_n,
    rows, cols0, offs_d, N_Q, N_K, qk_scale, softcap, slope, window_left, window_right,
    seed, threshold, b, h, MASK_TENSORS, SCORE_TENSORS,
    D: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr, DROPOUT: tl.constexpr, MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr,
    MASKED: tl.constexpr, APPLY_MOD: tl.constexpr, IN_BOUNDS: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PLAIN: tl.constexpr, OFFSET: tl.constexpr,
):  # fmt: skip
    """One key tile at start_n (pointers at start_n, or at key 0 with OFFSET) of _attend_tiles."""
    if OFFSET:
        k_ptrs += start_n.to(tl.int64) * stride_kn
        v_ptrs += start_n.to(tl.int64) * stride_vn
    cols = start_n + cols0
    k = load_block(k_tma, start_n, k_ptrs, cols, N_K, offs_d, D, IN_BOUNDS, EVEN_D)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    s_scale = qk_scale
    if not PLAIN:
        s, _ = logits(
            s, rows[:, None], cols[None, :], N_K - N_Q, qk_scale, softcap, slope, b, h, N_Q, N_K, SCORE_TENSORS,
            SOFTCAP, ALIBI, SCORE_MOD, None,
        )  # fmt: skip
        s_scale = 1.0
    if MASKED:
        mask = tile_mask(
            rows, cols, N_Q, N_K, window_left, window_right, b, h, MASK_TENSORS, LEFT, RIGHT, MASK_MOD, APPLY_MOD
        )
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * s_scale)
    m_shift = m_new
    if MASKED or SCORE_MOD is not None:  # (a score_mod may hide keys with -inf in a tile that needs no mask)
        # A row with no visible key so far keeps m = -inf; shift it by 0 instead (no inf - inf).
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s * s_scale - m_shift[:, None])
    # rescale what was accumulated under the old max
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if DROPOUT:
        # the softmax sum above is of the undropped P; only the product with V sees the mask
        p = tl.where(dropout_keep(seed, b, h, rows[:, None], cols[None, :], threshold), p, 0.0)
    v = load_block(v_tma, start_n, v_ptrs, cols, N_K, offs_d, D, IN_BOUNDS, EVEN_D)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["N_Q", "N_K", "H", "GROUP", "window_left", "window_right", "seed", "threshold"])
def attention_forward_kernel(
    Q, K, V, O, LSE, K_DESC, V_DESC,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh, empty_lse,
    N_Q, N_K, qk_scale, H, GROUP,
    CU_SEQLENS_Q, CU_SEQLENS_K, ALIBI_SLOPES, SINKS, softcap, window_left, window_right, seed, threshold, dropout_scale,
    TILE_NUM, TILE_IDX, FULL_NUM, FULL_IDX, stride_sb, stride_sh, MASK_TENSORS, SCORE_TENSORS,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LEFT: tl.constexpr, RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    VARLEN: tl.constexpr, SPARSE: tl.constexpr, SPARSE_BLOCK_M: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr,
    MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EDGE_STAGES: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = head_program()
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP
    stride_qm, stride_kn, stride_vn, stride_om = wide(stride_qm), wide(stride_kn), wide(stride_vn), wide(stride_om)
    m0 = pid_m * BLOCK_M
    kv_row = b * N_K  # of K and V's (rows, heads * D) views; a varlen sequence's first row instead
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

    rows = m0 + tl.arange(0, BLOCK_M)
    cols0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    EVEN_D: tl.constexpr = BLOCK_D == D

    q_ptrs = Q + b * stride_qb + h * stride_qh + (q_start + rows[:, None]) * stride_qm + offs_d[None, :]
    q = load_tile(q_ptrs, rows, N_Q, offs_d, D, EVEN_M, EVEN_D)

    k_base = K + b * stride_kb + hk * stride_kh + (k_start + cols0[:, None]) * stride_kn + offs_d[None, :]
    v_base = V + b * stride_vb + hk * stride_vh + (k_start + cols0[:, None]) * stride_vn + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if SPARSE:
        # this query tile's row of the block mask: its full key tiles (no mask unless N_K ends inside
        # one: EVEN_N is then about SPARSE_BLOCK_N), then its partial ones through MASK_MOD
        row = b * stride_sb + h * stride_sh + m0 // SPARSE_BLOCK_M
        for i in tl.static_range(2):
            tiles, count = listed(i, FULL_NUM, FULL_IDX, TILE_NUM, TILE_IDX, row, tl.cdiv(N_K, SPARSE_BLOCK_N))
            acc, l_i, m_i = _attend_tiles(
                acc, l_i, m_i, q, k_base, v_base, k_tma, v_tma, stride_kn, stride_vn, rows, cols0, offs_d, 0, count,
                N_Q, N_K, qk_scale, softcap, slope, window_left, window_right, seed, threshold, b, h,
                MASK_TENSORS, SCORE_TENSORS, D, BLOCK_N, LEFT, RIGHT, SOFTCAP, ALIBI, DROPOUT, MASK_MOD, SCORE_MOD,
                i == 1 or not EVEN_N, i == 1, EVEN_N, EVEN_D, DOT_PRECISION, None, tiles, SPARSE_BLOCK_N // BLOCK_N,
            )  # fmt: skip
    else:
        lo, full_lo, full_hi, hi = key_range(m0, N_Q, N_K, window_left, window_right, BLOCK_M, BLOCK_N, LEFT, RIGHT)
        # the band's stretches: left edge (masked), whole tiles, right edge (masked), ragged last tile
        # (masked, bounds-checked; none when N_K is a whole number of tiles)
        for i in tl.static_range(4 - EVEN_N):
            start, end = band_stretch(i, lo, full_lo, full_hi, hi, N_K // BLOCK_N * BLOCK_N)
            offset = tl.cast(start, tl.int64)
            acc, l_i, m_i = _attend_tiles(
                acc, l_i, m_i, q, k_base + offset * stride_kn, v_base + offset * stride_vn, k_tma, v_tma,
                stride_kn, stride_vn, rows, cols0, offs_d, start, end, N_Q, N_K, qk_scale, softcap, slope,
                window_left, window_right, seed, threshold, b, h, MASK_TENSORS, SCORE_TENSORS,
                D, BLOCK_N, LEFT, RIGHT, SOFTCAP, ALIBI, DROPOUT, MASK_MOD, SCORE_MOD, i != 1, False, i != 3, EVEN_D,
                DOT_PRECISION, None if i == 1 else (1 if i == 3 else EDGE_STAGES),
            )  # fmt: skip

    if SINKS is not None:
        acc, m_i, l_i = add_sink(acc, m_i, l_i, tl.load(SINKS + h) * LOG2E)
    # epilogue: normalise once; rows that saw no key (nor a sink) get O = 0 and LSE = empty_lse (+inf final, -inf
    # partial)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, empty_lse, (m_i + tl.math.log2(l_safe)) * LN2)
    if DROPOUT:
        l_safe = l_safe / dropout_scale
    out = acc / l_safe[:, None]

    o_ptrs = O + b * stride_ob + h * stride_oh + (q_start + rows[:, None]) * stride_om + offs_d[None, :]
    store_tile(o_ptrs, out.to(O.dtype.element_ty), rows, N_Q, offs_d, D, EVEN_M, EVEN_D)
    if LSE is not None:  # None: the caller needs no LSE (an inference call)
        lse_ptrs = LSE + b * stride_lb + h * stride_lh + q_start + rows
        if EVEN_M:
            tl.store(lse_ptrs, lse)
        else:
            tl.store(lse_ptrs, lse, mask=rows < N_Q)
