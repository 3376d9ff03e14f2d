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
def visible(rows, cols, N_Q, N_K, CAUSAL: tl.constexpr):
    """[rows, cols] mask of the scores that exist: key in range and, if causal, not in the future."""
    mask = cols[None, :] < N_K
    if CAUSAL:
        mask = mask & (cols[None, :] <= rows[:, None] + (N_K - N_Q))
    return mask


@triton.jit
def key_range(m0, N_Q, N_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Keys that the query tile [m0, m0 + BLOCK_M) attends to, as two ranges.

    [0, full_hi) are whole key tiles every row sees (no mask needed); [full_hi, hi) are the tiles
    that need the element mask (the causal diagonal and the ragged end of the key sequence).
    """
    if CAUSAL:
        # The tile's first row sees keys < m0 + 1 + offset; its last row keys < m0 + BLOCK_M + offset.
        full_hi = tl.minimum(tl.maximum(m0 + 1 + N_K - N_Q, 0), N_K) // BLOCK_N * BLOCK_N
        hi = tl.minimum(tl.maximum(m0 + BLOCK_M + N_K - N_Q, 0), N_K)
    else:
        full_hi = N_K // BLOCK_N * BLOCK_N
        hi = N_K
    return full_hi, hi


@triton.jit
def query_range(n0, N_Q, N_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Queries that see some key of the key tile [n0, n0 + BLOCK_N), as two ranges of query tiles.

    [lo, full_lo) need the causal mask (they straddle the diagonal); [full_lo, hi) see the whole
    key tile. Rows past N_Q in the last tile are neutralised by their loads (LSE = +inf).
    """
    hi = tl.cdiv(N_Q, BLOCK_M) * BLOCK_M
    if CAUSAL:
        offset = N_K - N_Q
        # Row i sees key n0 iff i >= n0 - offset, and the whole tile iff i >= n0 + BLOCK_N - 1 - offset.
        lo = tl.minimum(tl.maximum(n0 - offset, 0) // BLOCK_M * BLOCK_M, hi)
        full_lo = tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - offset, 0), BLOCK_M) * BLOCK_M
        full_lo = tl.maximum(tl.minimum(full_lo, hi), lo)
    else:
        lo = 0
        full_lo = 0
    return lo, full_lo, hi
