"""Small @triton.jit helpers shared by the forward and backward kernels.

Notation (as in every kernel file)
  N_Q, N_K     query and key sequence lengths
  D, BLOCK_D   head dim, and head dim rounded up to a power of two (columns >= D are masked)
  offset       N_K - N_Q: the causal mask is aligned bottom-right, so query i sees key j iff
               j <= i + offset (flash_attn's convention for N_Q != N_K)
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # 1 / ln(2): exp(x) == exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): converts a base-2 LSE to natural log


@triton.jit
def head_program():
    """Which (batch, head) of a grid (tiles, Y, Z) this program computes: Y * Z of them, split over two axes where
    there are more than CUDA's 65535 on one (triton_backend._heads_grid)."""
    return tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)


@triton.jit
def wide(stride):
    """A row stride in 64 bits, so that every product with it is: Triton passes an int below 2**31 as int32, whose
    products wrap silently, and on a tensor over 2**31 elements row * stride passes 2**31 (row 2**21 of rows of
    9 * 128 elements). Cast once per program: the inner loops only advance 64-bit pointers by a hoisted step."""
    return tl.cast(stride, tl.int64)


@triton.jit
def load_tile(ptrs, rows, n_rows, cols, n_cols, ROWS_IN_BOUNDS: tl.constexpr, COLS_IN_BOUNDS: tl.constexpr):
    """Load a [rows, cols] tile, zero-filling rows >= n_rows and cols >= n_cols unless known in bounds."""
    if ROWS_IN_BOUNDS and COLS_IN_BOUNDS:
        x = tl.load(ptrs)
    elif ROWS_IN_BOUNDS:
        x = tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
    elif COLS_IN_BOUNDS:
        x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
    return x


@triton.jit
def load_block(tma, at, ptrs, rows, n_rows, cols, n_cols, ROWS_IN_BOUNDS: tl.constexpr, COLS_IN_BOUNDS: tl.constexpr):
    """load_tile, but through the copy engine (TMA) when the launcher gave a tensor descriptor: ``tma``
    is (descriptor or None, first row, column) of this tensor's 2D view (rows, heads * D), whose tiles
    span whole heads (COLS_IN_BOUNDS), and ``at`` the tile's first row after that first row. A ragged
    tile's rows past n_rows hold the next sequence's rows there (or zeros past the view): zeroed here.
    """
    desc, row0, col = tma
    if desc is not None and COLS_IN_BOUNDS:
        x = desc.load([(row0 + at).to(tl.int32), col])
        if not ROWS_IN_BOUNDS:
            x = tl.where(rows[:, None] < n_rows, x, 0.0)
    else:
        x = load_tile(ptrs, rows, n_rows, cols, n_cols, ROWS_IN_BOUNDS, COLS_IN_BOUNDS)
    return x


@triton.jit
def store_tile(ptrs, x, rows, n_rows, cols, n_cols, ROWS_IN_BOUNDS: tl.constexpr, COLS_IN_BOUNDS: tl.constexpr):
    if ROWS_IN_BOUNDS and COLS_IN_BOUNDS:
        tl.store(ptrs, x)
    elif ROWS_IN_BOUNDS:
        tl.store(ptrs, x, mask=cols[None, :] < n_cols)
    elif COLS_IN_BOUNDS:
        tl.store(ptrs, x, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))


@triton.jit
def load_rows(ptrs, rows, n_rows, other, ROWS_IN_BOUNDS: tl.constexpr):
    """Load a per-row vector (LSE, delta), filling rows >= n_rows with ``other``."""
    if ROWS_IN_BOUNDS:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=rows < n_rows, other=other)
    return x


@triton.jit
def visible(rows, cols, N_Q, N_K, window_left, window_right, LEFT: tl.constexpr, RIGHT: tl.constexpr):
    """[rows, cols] mask of the scores that exist: key in range and inside the window band.

    Query i sees key j iff i + offset - window_left <= j <= i + offset + window_right; LEFT / RIGHT
    say whether that side is bounded at all (causal: RIGHT with window_right = 0).
    """
    mask = cols[None, :] < N_K
    diag = rows[:, None] + (N_K - N_Q)
    if RIGHT:
        mask = mask & (cols[None, :] <= diag + window_right)
    if LEFT:
        mask = mask & (cols[None, :] >= diag - window_left)
    return mask


@triton.jit
def _band(first, last, n, bound_lo, bound_hi, BLOCK: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr):
    """Tiles of BLOCK along an axis of length n that the rows first..last (a tile of the other axis)
    see, where row r sees [r - bound_lo, r + bound_hi]: returns lo <= full_lo <= full_hi <= hi, with
    [full_lo, full_hi) seen whole by every row and [lo, full_lo), [full_hi, hi) partially.
    """
    lo = 0
    full_lo = 0
    if LO:
        lo = tl.maximum(first - bound_lo, 0) // BLOCK * BLOCK
        full_lo = tl.cdiv(tl.maximum(last - bound_lo, 0), BLOCK) * BLOCK
    if HI:
        hi = tl.minimum(tl.maximum(last + bound_hi + 1, 0), n)
        full_hi = tl.minimum(tl.maximum(first + bound_hi + 1, 0), n) // BLOCK * BLOCK
    else:
        hi = n
        full_hi = n // BLOCK * BLOCK
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def key_range(
    m0, N_Q, N_K, window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
):  # fmt: skip
    """Key tiles that the query tile [m0, m0 + BLOCK_M) sees: lo <= full_lo <= full_hi <= hi.

    [full_lo, full_hi) are whole key tiles every row sees (no mask needed); [lo, full_lo) and
    [full_hi, hi) need the element mask (window edges, the causal diagonal, the ragged last tile).
    Tiles outside [lo, hi) are never visited.
    """
    diag = m0 + N_K - N_Q  # the key on the diagonal of row m0
    return _band(diag, diag + BLOCK_M - 1, N_K, window_left, window_right, BLOCK_N, LEFT, RIGHT)


@triton.jit
def query_range(
    n0, N_Q, N_K, window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
):  # fmt: skip
    """Query tiles that see some key of the key tile [n0, n0 + BLOCK_N), as key_range does for keys.

    Key j is seen by rows j - offset - window_right .. j - offset + window_left. Whole tiles end at
    or before N_Q; a ragged last query tile is an edge tile, whose rows past N_Q are neutralised by
    their loads (LSE = +inf).
    """
    diag = n0 - (N_K - N_Q)  # the query on the diagonal of key n0
    return _band(diag, diag + BLOCK_N - 1, N_Q, window_right, window_left, BLOCK_M, RIGHT, LEFT)


@triton.jit
def band_stretch(i: tl.constexpr, lo, full_lo, full_hi, hi, even_end):
    """[start, end) of stretch i of a band over an axis whose whole tiles end at even_end:
    0 the leading edge and 1 the whole tiles and 2 the trailing edge, all below even_end, so their
    loads need no bounds mask; 3 the ragged last tile, if the band reaches it. Stretches 0, 2, 3
    need the element mask. (A stretch whose end falls before its start is empty.)
    """
    if i == 0:
        return lo, tl.minimum(full_lo, even_end)
    elif i == 1:
        return full_lo, full_hi
    elif i == 2:
        return full_hi, tl.minimum(hi, even_end)
    else:
        return tl.maximum(even_end, lo), hi


@triton.jit
def listed(i: tl.constexpr, FULL_NUM, FULL_IDX, TILE_NUM, TILE_IDX, at, n_tiles):
    """A BlockMask's list i at ``at`` (a query tile's row, or transposed a key tile's column), as
    (pointer to its tile indices, their count): list 0 the full tiles, list 1 the partial ones."""
    if i == 0:
        return FULL_IDX + at * n_tiles, tl.load(FULL_NUM + at)
    else:
        return TILE_IDX + at * n_tiles, tl.load(TILE_NUM + at)


@triton.jit
def tile_start(it, LIST, BLOCK: tl.constexpr, SUB: tl.constexpr):
    """First row of loop step ``it``'s tile: of a band, ``it`` itself; of a BlockMask list (LIST not
    None), whose listed tiles hold SUB kernel tiles of BLOCK rows each, sub-tile it % SUB of listed
    tile it // SUB (one index load per step, so the pipeline runs across listed tiles)."""
    if LIST is None:
        return it
    else:
        return tl.load(LIST + it // SUB) * (SUB * BLOCK) + it % SUB * BLOCK


@triton.jit
def sequence(CU_SEQLENS_Q, CU_SEQLENS_K, b, N_Q, N_K, VARLEN: tl.constexpr):
    """(first query row, first key row, N_Q, N_K) of sequence b: its slice of a packed batch under VARLEN."""
    q_start = 0
    k_start = 0
    if VARLEN:
        q_start = tl.load(CU_SEQLENS_Q + b).to(tl.int64)
        k_start = tl.load(CU_SEQLENS_K + b).to(tl.int64)
        N_Q = (tl.load(CU_SEQLENS_Q + b + 1) - q_start).to(tl.int32)
        N_K = (tl.load(CU_SEQLENS_K + b + 1) - k_start).to(tl.int32)
    return q_start, k_start, N_Q, N_K


@triton.jit
def logits(
    s, q_idx, k_idx, offset, qk_scale, softcap, slope, b, h, N_Q, N_K, SCORE_TENSORS,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr,
):  # fmt: skip
    """Base-2 logits of raw scores s = q.k: score_mod(softcap(softmax_scale * s) + ALiBi), times LOG2E.

    q_idx, k_idx: query / key indices broadcastable to s (either orientation). Also returns
    d logits / d(softmax_scale * s) in natural units (1 - tanh^2 of the softcap times the
    score_mod's derivative) when the backward needs it (SCORE_GRAD), else s.
    qk_scale is softmax_scale * LOG2E; with SOFTCAP (config.softcap_mode), softcap arrives as softmax_scale / softcap.
    """
    deriv = s
    if SOFTCAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1) saturates at both ends but cancels near 0; SOFTCAP 2: the series there
        t = 1.0 - 2.0 / (tl.math.exp2(s * (softcap * 2.0 * LOG2E)) + 1.0)
        if SOFTCAP == 2:
            x = s * softcap
            x2 = x * x
            t = tl.where(x2 < 0.0625, x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0)))), t)
        s = t * (qk_scale / softcap)
        deriv = 1.0 - t * t
    else:
        s = s * qk_scale
    if ALIBI:
        s = s - (slope * LOG2E) * tl.abs(q_idx + offset - k_idx).to(tl.float32)
    if SCORE_MOD is not None:
        # mods see natural-unit scores and in-range indices (ragged padding is clamped, then discarded)
        q_in = tl.minimum(q_idx, N_Q - 1)
        k_in = tl.minimum(k_idx, N_K - 1)
        natural = s * LN2
        if SCORE_GRAD is not None:
            grad = SCORE_GRAD(natural, b.to(tl.int32), h.to(tl.int32), q_in, k_in, *SCORE_TENSORS)
            if SOFTCAP:
                deriv = deriv * grad
            else:
                deriv = grad
        s = SCORE_MOD(natural, b.to(tl.int32), h.to(tl.int32), q_in, k_in, *SCORE_TENSORS) * LOG2E
    return s, deriv


@triton.jit
def tile_mask(
    rows, cols, N_Q, N_K, window_left, window_right, b, h, MASK_TENSORS,
    LEFT: tl.constexpr, RIGHT: tl.constexpr, MASK_MOD: tl.constexpr, APPLY_MOD: tl.constexpr,
):  # fmt: skip
    """[rows, cols] mask of an edge tile: visible() and, for a BlockMask's partial tiles (APPLY_MOD), the
    user's MASK_MOD at in-range indices (ragged padding is clamped; visible() already hides it)."""
    mask = visible(rows, cols, N_Q, N_K, window_left, window_right, LEFT, RIGHT)
    if APPLY_MOD:
        if MASK_MOD is not None:  # a layout without mask_mod lists no partial tile
            q_in = tl.minimum(rows[:, None], N_Q - 1)
            k_in = tl.minimum(cols[None, :], N_K - 1)
            mask = mask & MASK_MOD(b.to(tl.int32), h.to(tl.int32), q_in, k_in, *MASK_TENSORS)
    return mask


@triton.jit
def add_sink(acc, m_i, l_i, sink):
    """A row's online softmax (acc, running max m_i and sum l_i, base 2) with one more logit, ``sink`` (base 2): mass
    in the sum, nothing in acc. A row with no key and no sink (-inf) stays empty (l_i = 0)."""
    m_new = tl.maximum(m_i, sink)
    m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_new)
    return acc * alpha[:, None], m_new, l_i * alpha + tl.math.exp2(sink - m_new)


@triton.jit
def dropout_keep(seed, b, h, q_idx, k_idx, threshold):
    """flashtriton.dropout's keep-mask of (sequence b, query head h) at broadcastable q_idx, k_idx (int32)."""
    zero = q_idx * 0 + k_idx * 0
    r, _, _, _ = tl.philox(seed, k_idx + zero, q_idx + zero, zero + h.to(tl.int32), zero + b.to(tl.int32))
    return (r >> 1).to(tl.int32) >= threshold
