"""Split-KV decoding against a KV cache: the kernels of flash_attn_with_kvcache.

Notation
  B, H, HKV    batch, query heads, key/value heads; GROUP = H // HKV query heads share a K/V head
  N_Q          query positions per sequence (1 when decoding one token)
  N_NEW        new key/value rows appended per sequence (0: none)
  CAPACITY     cache rows a sequence may use: the cache's seqlen, or (paged) the block table's width x PAGE_SIZE
  PAGE_SIZE    rows per page of a paged cache: sequence b's row r lives in page BLOCK_TABLE[b, r // PAGE_SIZE] at
               row r % PAGE_SIZE; a contiguous cache's row r is row r of batch row CACHE_BATCH_IDX[b] (or b).
               A constexpr: the row's page and slot without a runtime division (shifts for powers of two)
  TILE_PAGES   a tile's pages by scalar block-table reads, one per page it holds (PAGE_SIZE and BLOCK_N divide one
               another): the split kernel's tiles start at a page's first row (or a tile's, pages of a tile or more),
               so that each register's page is known at compile time (aligned_slots); else a read per row
  SYNC_TABLE   block-table entries by plain loads, which Triton's pipeliner does not make copies of (table_entries)
  start, end   sequence b's keys are its cache rows [start, CACHE_SEQLENS[b] + N_NEW) within the CAPACITY:
               start = CACHE_LEFTPAD[b] (or 0; clamped at 0), key j is row start + j, N_K of them; the masks are
               params.py's with offset = end - N_Q, end = CACHE_SEQLENS[b] + N_NEW - start (rows past the cache,
               dropped, count)
  D, BLOCK_D   head dim, rounded up to a power of two (columns >= D masked)
  ROWS         GROUP * N_Q packed query rows of one K/V head: row r is query r // GROUP of head hk * GROUP + r % GROUP
  BLOCK_M      packed rows per program; BLOCK_N cache rows per inner step
  SPLITS       programs that share one (b, hk)'s keys: split s takes the s-th of SPLITS chunks of whole tiles of
               [0, N_K) (a chunk past N_K is empty)
  ROTARY_DIM   leading columns rotated by ROT_COS / ROT_SIN (seqlen_ro, ROTARY_DIM / 2) at a row's position (0: no
               rotary); INTERLEAVED pairs columns (2i, 2i + 1), else (i, i + ROTARY_DIM / 2)

Kernels and grids
  append_kv_kernel       (B * HKV, cdiv(N_NEW, BLOCK_N)): new K rows (rotated at positions CACHE_SEQLENS[b] + j) and
                         V rows into cache rows CACHE_SEQLENS[b] + j
  decode_split_kernel    (B * HKV, SPLITS, cdiv(ROWS, BLOCK_M)): one program attends its packed rows (all GROUP
                         heads of a K/V head, so each K/V tile is read once per split) to its split's keys and
                         writes that split's O and LSE: fp32 partials, or with SPLITS = 1 the final ones
  decode_combine_kernel  (B * N_Q * H,): one row's SPLITS partials merged by log-sum-exp into O and LSE

Optional tensors (CACHE_BATCH_IDX, CACHE_LEFTPAD, BLOCK_TABLE, ALIBI_SLOPES, LSE) are None-specialised: Triton
compiles a variant for their presence, as for a tl.constexpr flag.

Numerics: as forward.py, scores in base 2 (softmax_scale * LOG2E folded into qk_scale; the max is taken after the
scale, so any scale's sign works), fp32 running max, sum and accumulator; LSEs are natural-log. A row that sees no key
gets O = 0 and LSE = empty_lse: -inf in a partial (it then weighs nothing in the combine), +inf in a final result.
Rotary runs in fp32 and rounds to the input dtype, before the product.
Offsets: batch, page and head offsets are 64-bit; cache row numbers and positions are int32.

PDL: on Hopper each kernel is launched with programmatic dependent launch, so that its programs are placed while the
kernel before it in the stream finishes (a short decode step's kernels take a few microseconds, and the gap between
two about one): it waits for that kernel, and its writes, before its first memory access (wait_for_previous_grid).
The split kernel lets the next kernel (the combine, when there is one) be placed once its programs are past their
keys; the others leave that to their exit.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .common import LN2, LOG2E, add_sink, logits, visible, wide


@triton.jit
def _pairs(cols, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """(partner column, angle index, sign) of each column: rotated, x[c] becomes
    x[c] * cos[angle] + sign * x[partner] * sin[angle]."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    if INTERLEAVED:
        partner = cols ^ 1
        angle = cols // 2
        sign = tl.where(cols % 2 == 0, -1.0, 1.0)
    else:
        first = cols < HALF
        partner = tl.where(first, cols + HALF, cols - HALF)
        angle = tl.where(first, cols, cols - HALF)
        sign = tl.where(first, -1.0, 1.0)
    return partner, angle, sign


@triton.jit
def load_rotated(
    row_ptrs, row_ok, cols, positions, ROT_COS, ROT_SIN, seqlen_ro,
    D: tl.constexpr, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """A [rows, BLOCK_D] tile (row_ptrs: [rows, 1] pointers to each row's column 0), its first ROTARY_DIM columns
    rotated at each row's position (one outside the cos / sin table, past it or negative: left as is, nothing read
    outside it)."""
    mask = row_ok[:, None] & (cols[None, :] < D)
    x = tl.load(row_ptrs + cols[None, :], mask=mask, other=0.0)
    if ROTARY_DIM > 0:
        partner, angle, sign = _pairs(cols, ROTARY_DIM, INTERLEAVED)
        inside = (positions >= 0) & (positions < seqlen_ro)
        rotated = mask & (cols[None, :] < ROTARY_DIM) & inside[:, None]
        y = tl.load(row_ptrs + partner[None, :], mask=rotated, other=0.0)
        at = positions[:, None].to(tl.int64) * (ROTARY_DIM // 2) + angle[None, :]
        cos = tl.load(ROT_COS + at, mask=rotated, other=1.0).to(tl.float32)
        sin = tl.load(ROT_SIN + at, mask=rotated, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) * cos + sign[None, :] * y.to(tl.float32) * sin).to(x.dtype)
    return x


@triton.jit
def table_entries(ptrs, SYNC: tl.constexpr):
    """Block-table entries at ptrs (all inside the table). SYNC: by a plain load, which Triton's pipeliner leaves
    alone. Pipelined, it becomes a cp.async committed after the K/V tiles' copies, and as copies complete in the order
    of their commits, every step would wait for all of them: no tile's load would overlap another's work. The
    interpreter runs no inline PTX."""
    if SYNC:
        return tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=True,
                                         pack=1)  # fmt: skip
    else:
        return tl.load(ptrs)


@triton.jit
def cache_slots(rows, b, cache_b, BLOCK_TABLE, stride_tb, PAGE_SIZE: tl.constexpr, SYNC_TABLE: tl.constexpr, CAPACITY):
    """(block, row within it) of sequence b's cache rows ``rows``: a page and its row through BLOCK_TABLE, an entry
    read per row, or batch row cache_b and the row itself. The block is 64-bit (it multiplies the block stride).
    Entries are read clamped to the table: rows outside the capacity are masked by the caller (cache_seqlens are
    unchecked)."""
    if BLOCK_TABLE is not None:
        last = CAPACITY // PAGE_SIZE - 1
        page = table_entries(BLOCK_TABLE + b * stride_tb + tl.minimum(tl.maximum(rows // PAGE_SIZE, 0), last),
                             SYNC_TABLE)  # fmt: skip
        return page.to(tl.int64), rows % PAGE_SIZE
    else:
        return tl.zeros_like(rows).to(tl.int64) + cache_b, rows


@triton.jit
def aligned_slots(first, b, BLOCK_TABLE, stride_tb, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                  SYNC_TABLE: tl.constexpr, CAPACITY):  # fmt: skip
    """(block, row within it, rows to add) of the BLOCK_N cache rows from row ``first``, a multiple of PAGE_SIZE or of
    BLOCK_N, whichever is smaller (the one divides the other): a scalar block-table read per page the tile holds,
    each row's page chosen by its place in the tile alone, so that the compiler resolves it per register; the rows
    within the page as the tile's own, the page's first row of the tile apart (``first % PAGE_SIZE``, a scalar): fewer
    instructions in the key loop than an entry read and an offset computed per row (DECISIONS, "Decoding")."""
    table = BLOCK_TABLE + b * stride_tb
    last = CAPACITY // PAGE_SIZE - 1
    at = first // PAGE_SIZE
    r = tl.arange(0, BLOCK_N)
    page = tl.zeros_like(r) + table_entries(table + tl.minimum(at, last), SYNC_TABLE)
    for i in tl.static_range(1, BLOCK_N // PAGE_SIZE):
        page = tl.where(r >= i * PAGE_SIZE, table_entries(table + tl.minimum(at + i, last), SYNC_TABLE), page)
    if PAGE_SIZE < BLOCK_N:
        return page.to(tl.int64), r % PAGE_SIZE, 0
    else:
        return page.to(tl.int64), r, first % PAGE_SIZE


@triton.jit
def wait_for_previous_grid(PDL: tl.constexpr):
    """Under programmatic dependent launch, waits for the kernel before this one in the stream to finish (its writes
    visible after): a kernel's first step, before any memory access."""
    if PDL:
        gdc_wait()


@triton.jit
def _cache_row(CACHE_BATCH_IDX, b):
    """The contiguous cache's batch row of sequence b."""
    if CACHE_BATCH_IDX is not None:
        return tl.load(CACHE_BATCH_IDX + b).to(tl.int64)
    else:
        return b


@triton.jit(do_not_specialize=["N_NEW", "CAPACITY", "seqlen_ro"])
def append_kv_kernel(
    K_NEW, V_NEW, K, V, CACHE_SEQLENS, CACHE_BATCH_IDX,
    stride_nb, stride_nn, stride_nh, stride_wb, stride_wn, stride_wh,
    stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    BLOCK_TABLE, stride_tb, PAGE_SIZE: tl.constexpr, CAPACITY,
    ROT_COS, ROT_SIN, seqlen_ro,
    N_NEW, HKV,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_grid(PDL)
    pid = tl.program_id(0)  # B * HKV on x, which takes more than y's 65535
    b = (pid // HKV).to(tl.int64)
    hk = (pid % HKV).to(tl.int64)
    stride_nn, stride_wn, stride_kn, stride_vn = wide(stride_nn), wide(stride_wn), wide(stride_kn), wide(stride_vn)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    first = tl.load(CACHE_SEQLENS + b) + tl.program_id(1) * BLOCK_N
    rows = first + tl.arange(0, BLOCK_N)
    # rows past the cache are dropped: cache_seqlens are device values, checked nowhere else
    ok = (j < N_NEW) & (rows >= 0) & (rows < CAPACITY)
    cols = tl.arange(0, BLOCK_D)
    block, slot = cache_slots(rows, b, _cache_row(CACHE_BATCH_IDX, b), BLOCK_TABLE, stride_tb, PAGE_SIZE, False,
                              CAPACITY)  # fmt: skip
    mask = ok[:, None] & (cols[None, :] < D)
    k_src = K_NEW + b * stride_nb + hk * stride_nh + j[:, None] * stride_nn
    k = load_rotated(k_src, ok, cols, rows, ROT_COS, ROT_SIN, seqlen_ro, D, ROTARY_DIM, INTERLEAVED)
    k_dst = K + block[:, None] * stride_kb + slot[:, None] * stride_kn + hk * stride_kh + cols[None, :]
    tl.store(k_dst, k.to(K.dtype.element_ty), mask=mask)
    v = tl.load(V_NEW + b * stride_wb + hk * stride_wh + j[:, None] * stride_wn + cols[None, :], mask=mask)
    v_dst = V + block[:, None] * stride_vb + slot[:, None] * stride_vn + hk * stride_vh + cols[None, :]
    tl.store(v_dst, v.to(V.dtype.element_ty), mask=mask)


@triton.jit(
    do_not_specialize=[
        "CAPACITY", "seqlen_ro", "N_Q", "N_NEW", "SPLITS", "window_left", "window_right", "rotary_step", "lse_start"
    ]
)  # fmt: skip
def decode_split_kernel(
    Q, K, V, O, LSE, CACHE_SEQLENS, CACHE_BATCH_IDX, CACHE_LEFTPAD, ALIBI_SLOPES, SINKS,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_os, stride_ob, stride_om, stride_oh,
    stride_ls, stride_lb, stride_lh, stride_lm, lse_start,
    BLOCK_TABLE, stride_tb, PAGE_SIZE: tl.constexpr, TILE_PAGES: tl.constexpr, SYNC_TABLE: tl.constexpr, CAPACITY,
    ROT_COS, ROT_SIN, seqlen_ro,
    N_Q, N_NEW, H, HKV,
    GROUP, SPLITS, qk_scale, softcap, window_left, window_right, rotary_step, empty_lse,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LEFT: tl.constexpr, RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ROTARY_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """rotary_step: 1 rotates query i at CACHE_SEQLENS[b] + i, 0 every query at CACHE_SEQLENS[b] (flash_attn's rule,
    interface.py). LSE's entries start at its element lse_start (the partials' LSEs follow their O in one
    allocation). SINKS: (H,) fp32 logits that join each row's softmax (params.py), given only with SPLITS = 1 (split
    partials leave them to the combine). UPCAST: products in fp32 (Triton's interpreter computes bf16 tl.dot
    wrongly)."""
    wait_for_previous_grid(PDL)
    ALIBI: tl.constexpr = ALIBI_SLOPES is not None
    pid = tl.program_id(0)
    b = (pid // HKV).to(tl.int64)
    hk = (pid % HKV).to(tl.int64)
    split = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    stride_qm, stride_kn, stride_vn, stride_om = wide(stride_qm), wide(stride_kn), wide(stride_vn), wide(stride_om)
    stride_os = wide(stride_os)  # the splits' partials: (SPLITS, B, N_Q, H, D) fp32 may pass 2**31 elements

    seqlen = tl.load(CACHE_SEQLENS + b)
    start = 0
    if CACHE_LEFTPAD is not None:
        start = tl.maximum(tl.load(CACHE_LEFTPAD + b), 0)  # a negative one (unchecked device data) counts as 0
    N_K = tl.maximum(tl.minimum(seqlen + N_NEW, CAPACITY) - start, 0)
    cache_b = _cache_row(CACHE_BATCH_IDX, b)

    rows = m0 + tl.arange(0, BLOCK_M)
    i = rows // GROUP
    h = hk * GROUP + rows % GROUP
    row_ok = rows < N_Q * GROUP
    cols = tl.arange(0, BLOCK_D)
    q_ptrs = Q + b * stride_qb + i[:, None] * stride_qm + h[:, None] * stride_qh
    q = load_rotated(q_ptrs, row_ok, cols, seqlen + i * rotary_step, ROT_COS, ROT_SIN, seqlen_ro, D, ROTARY_DIM,
                     INTERLEAVED)  # fmt: skip
    if UPCAST:
        q = q.to(tl.float32)
    slope = 0.0
    if ALIBI:
        slope = tl.load(ALIBI_SLOPES + b * H + h, mask=row_ok, other=0.0)[:, None]

    # this split's keys, narrowed to the window band of the tile's queries (masks below keep it exact)
    chunk = tl.cdiv(tl.cdiv(N_K, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, N_K)
    end = seqlen + N_NEW - start  # keys as appended: rows dropped past the cache move no mask (offset = end - N_Q)
    offset = end - N_Q
    if RIGHT:
        last = tl.minimum((m0 + BLOCK_M - 1) // GROUP, N_Q - 1)
        hi = tl.minimum(hi, last + offset + window_right + 1)
    if LEFT:
        lo = tl.maximum(lo, m0 // GROUP + offset - window_left)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo_tile = lo
    if TILE_PAGES:  # the first tile from its page's (or a tile's) first row: keys below lo are masked
        lo_tile = lo - (start + lo) % min(PAGE_SIZE, BLOCK_N)
    for n0 in tl.range(lo_tile, hi, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        if TILE_PAGES:
            key_ok = (keys >= lo) & (keys < hi)
            block, slot, skew = aligned_slots(start + n0, b, BLOCK_TABLE, stride_tb, PAGE_SIZE, BLOCK_N, SYNC_TABLE,
                                              CAPACITY)  # fmt: skip
        else:
            key_ok = keys < hi
            block, slot = cache_slots(start + keys, b, cache_b, BLOCK_TABLE, stride_tb, PAGE_SIZE, SYNC_TABLE,
                                      CAPACITY)  # fmt: skip
            skew = 0
        kv_mask = key_ok[:, None] & (cols[None, :] < D)
        # pointer steps in this order: the page's (scalar where uniform), then the loop-invariant rest, which Triton
        # folds into one offset and hoists (summed first, the rows' offset would be added per row each tile)
        k = tl.load(K + (block * stride_kb + skew * stride_kn)[:, None] + slot[:, None] * stride_kn + hk * stride_kh
                    + cols[None, :], mask=kv_mask, other=0.0)  # fmt: skip
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s, _ = logits(s, i[:, None], keys[None, :], offset, qk_scale, softcap, slope, b, h, N_Q, N_K, (),
                      SOFTCAP, ALIBI, None, None)  # fmt: skip
        mask = key_ok[None, :] & visible(i, keys, N_Q, end, window_left, window_right, LEFT, RIGHT)
        s = tl.where(mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with no visible key so far keeps m = -inf; shift it by 0 instead (no inf - inf)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + (block * stride_vb + skew * stride_vn)[:, None] + slot[:, None] * stride_vn + hk * stride_vh
                    + cols[None, :], mask=kv_mask, other=0.0)  # fmt: skip
        if UPCAST:
            v = v.to(tl.float32)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    if PDL:  # the next kernel's programs may be placed once every program is past its keys; not at the start,
        gdc_launch_dependents()  # where they took SMs from the calls after it (DECISIONS, "Decoding")
    if SINKS is not None:
        acc, m_i, l_i = add_sink(acc, m_i, l_i, tl.load(SINKS + h, mask=row_ok, other=float("-inf")) * LOG2E)
    # epilogue: rows that saw no key (nor a sink) get O = 0 and LSE = empty_lse (-inf partial, +inf final)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, empty_lse, (m_i + tl.math.log2(l_safe)) * LN2)
    out = acc / l_safe[:, None]
    o_ptrs = O + split * stride_os + b * stride_ob + i[:, None] * stride_om + h[:, None] * stride_oh + cols[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (cols[None, :] < D))
    if LSE is not None:
        lse_at = LSE + lse_start + split.to(tl.int64) * stride_ls + b * stride_lb + h * stride_lh + i * stride_lm
        tl.store(lse_at, lse, mask=row_ok)


@triton.jit(do_not_specialize=["ROWS", "N_Q", "H", "SPLITS"])
def decode_combine_kernel(
    PARTS, O, LSE, SINKS, ROWS, N_Q, H, SPLITS, empty_lse,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Row r = (b * N_Q + i) * H + h of O (contiguous (B, N_Q, H, D)) from PARTS: the partials O_s (SPLITS, ROWS, D),
    then their LSE_s (SPLITS, ROWS). O = sum_s exp(LSE_s - LSE) O_s with LSE = log(sum_s exp(LSE_s) +
    exp(SINKS[h])) (no SINKS: no term); a row empty in every split, with no sink, gets O = 0 and LSE = empty_lse."""
    wait_for_previous_grid(PDL)
    r = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < SPLITS
    part = splits.to(tl.int64) * ROWS + r
    lse = tl.load(PARTS + SPLITS.to(tl.int64) * ROWS * D + part, mask=split_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    if SINKS is not None:
        sink = tl.load(SINKS + r % H)
        m = tl.maximum(m, sink)
    empty = m == float("-inf")
    weights = tl.math.exp2((lse - tl.where(empty, 0.0, m)) * LOG2E)  # an empty split's -inf weighs 0
    total = tl.sum(weights, 0)
    if SINKS is not None:
        total += tl.math.exp2((sink - tl.where(empty, 0.0, m)) * LOG2E)
    cols = tl.arange(0, BLOCK_D)
    o = tl.load(PARTS + part[:, None] * D + cols[None, :], mask=split_ok[:, None] & (cols[None, :] < D), other=0.0)
    out = tl.sum(weights[:, None] * o, 0) / tl.where(empty, 1.0, total)
    tl.store(O + r * D + cols, out.to(O.dtype.element_ty), mask=cols < D)
    if LSE is not None:
        b = r // (N_Q * H)
        i = r // H % N_Q
        h = r % H
        tl.store(LSE + (b * H + h) * N_Q + i, tl.where(empty, empty_lse, m + tl.log(tl.where(empty, 1.0, total))))
