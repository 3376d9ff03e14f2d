"""Ring attention's accumulation of partial results (distributed/merge.py launches it), one pass over the rows.

A ring step's calls return fp32 partial results; each is folded into the rank's fp32 accumulators. Done with torch's
elementwise ops, a merge reads and writes the accumulator several times (and a gathered call's rows are first
copied out and back); the kernel reads each accumulator row and each partial row once and writes the row once.

Rows: ``ROWS`` (n,) picks the accumulator's rows, and ``COPIES`` tensors ``SRC0``, ``SRC1`` (n,) the partial's rows
that land on them (a gathered call holds up to two copies of a row); None: the identity (the tensors passed are
already the rows' views). Each accumulator row is written by one program, so the result is deterministic.

accumulate_rows_kernel, grid (cdiv(n, BLOCK_R), H, B):
  MERGE   OUT, LSE (fp32; LSE -inf where empty) merged by log-sum-exp with the partials PART, PART_LSE:
          OUT = sum_i exp(LSE_i - LSE) OUT_i over the accumulator and the copies
  else    OUT += the sum of the copies' PART rows (fp32 gradient shares; LSE, PART_LSE None)

Tensors are (B, N, H, D) with a unit last stride; LSEs (B, H, N) (a packed batch: B = 1 views).
"""

import triton
import triton.language as tl

from .common import LOG2E, wide


@triton.jit
def accumulate_rows_kernel(
    OUT, LSE, PART, PART_LSE, ROWS, SRC0, SRC1, n_rows,
    stride_ob, stride_on, stride_oh, stride_lb, stride_lh, stride_ln,
    stride_pb, stride_pn, stride_ph, stride_qb, stride_qh, stride_qn,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, COPIES: tl.constexpr, MERGE: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    h, b = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    ok = r < n_rows
    cols = tl.arange(0, BLOCK_D)
    tile_ok = ok[:, None] & (cols[None, :] < D)
    row, src0, src1 = r, r, r  # no ROWS: the tensors passed are the rows' views
    if ROWS is not None:
        row = tl.load(ROWS + r, mask=ok, other=0)
        src0 = tl.load(SRC0 + r, mask=ok, other=0)
        if COPIES == 2:
            src1 = tl.load(SRC1 + r, mask=ok, other=0)
    out_at = OUT + b * wide(stride_ob) + h * wide(stride_oh) + row[:, None] * wide(stride_on) + cols[None, :]
    part = PART + b * wide(stride_pb) + h * wide(stride_ph) + cols[None, :]
    acc = tl.load(out_at, mask=tile_ok, other=0.0)
    if not MERGE:  # gradient shares: plain sums
        acc += tl.load(part + src0[:, None] * wide(stride_pn), mask=tile_ok, other=0.0)
        if COPIES == 2:
            acc += tl.load(part + src1[:, None] * wide(stride_pn), mask=tile_ok, other=0.0)
        tl.store(out_at, acc, mask=tile_ok)
    else:
        lse_at = LSE + b * wide(stride_lb) + h * wide(stride_lh) + row * wide(stride_ln)
        part_lse = PART_LSE + b * wide(stride_qb) + h * wide(stride_qh)
        lse = tl.load(lse_at, mask=ok, other=float("-inf"))
        lse0 = tl.load(part_lse + src0 * wide(stride_qn), mask=ok, other=float("-inf"))
        m = tl.maximum(lse, lse0)
        if COPIES == 2:
            lse1 = tl.load(part_lse + src1 * wide(stride_qn), mask=ok, other=float("-inf"))
            m = tl.maximum(m, lse1)
        empty = m == float("-inf")
        m = tl.where(empty, 0.0, m)  # an empty row: every weight exp(-inf) = 0, not exp(-inf + inf) = NaN
        w0 = tl.math.exp2((lse0 - m) * LOG2E)
        total = tl.math.exp2((lse - m) * LOG2E)
        acc *= total[:, None]
        acc += tl.load(part + src0[:, None] * wide(stride_pn), mask=tile_ok, other=0.0) * w0[:, None]
        total += w0
        if COPIES == 2:
            w1 = tl.math.exp2((lse1 - m) * LOG2E)
            acc += tl.load(part + src1[:, None] * wide(stride_pn), mask=tile_ok, other=0.0) * w1[:, None]
            total += w1
        scale = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, total))
        tl.store(out_at, acc * scale[:, None], mask=tile_ok)
        tl.store(lse_at, tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, total))), mask=ok)
