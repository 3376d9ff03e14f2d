"""The Gluon dK/dV kernel on sm90, warp-specialised, and with it (fused) dQ by TMA reductions.

Notation
  B, H, HKV    batch, query heads, key/value heads; GROUP = H // HKV query heads share a K/V head
  N            sequence length, of queries and keys alike (self-attention); VARLEN: the longest, sequence b being
               rows CU_SEQLENS[b]:CU_SEQLENS[b + 1] of the packed batch. RAGGED: some sequence ends inside a tile
  N_K          the keys' length: N, or apart from it in a dense call without a mask (cross-attention)
  D            the tiles' width (64, 128, 256); HEAD_D <= D the tensors' head dim (primitives.py)
  BLOCK_M      query rows per streamed step
  BLOCK_N      keys of one consumer warpgroup (SPLIT_D: of both, each taking D / 2 columns)
  KEYS         keys per program: 2 * BLOCK_N, or BLOCK_N with SPLIT_D

Grid: (cdiv(N_K, KEYS) * B * HKV,), in groups of order_heads K/V heads, each group's key blocks in order (causal: the
longest first). One program computes dK and dV of KEYS keys of one K/V head: its two consumer warpgroups keep K and
V resident and stream the (Q, dO, LSE, delta) tiles of every query head of the GQA group, S^T = K Q^T,
dP^T = V dO^T, dV += P^T dO, dK += dS^T Q. LSE and delta come through TMA as well, so that a step's reads of them
are shared-memory loads issued beside the MMAs. Fused (dq_desc not None), the same kernel also computes dQ += dS K
from both consumers' dS^T in shared memory and adds each step's share into fp32 sums of dQ through TMA reductions
(laid out in the accumulator's fragment order, which a conversion to dQ's dtype undoes): 5 matmuls per tile pair
instead of the dK/dV and dQ kernels' 7, in no fixed order of summation. At D=256 a warpgroup has registers for dK and
dV of 64 keys x 128 columns only, so the two share their keys and split D (SPLIT_D: _dkdv_split_consumer).

Numerics: P^T = exp2(S^T * qk_scale - LSE * LOG2E), the forward's natural-log LSE taken to base 2; dK, dV and the
dQ sums accumulate in fp32, dK and dQ times softmax_scale.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..triton_compat import reinterpret, tma_add
from .primitives import (
    CONSUMER_WARPS,
    LOG2E,
    PRODUCER_REGISTERS,
    PRODUCER_WARPS,
    band_only,
    barriers,
    fill,
    flat_layout,
    flat_view,
    give,
    halves,
    keys_of,
    mma_layout,
    operand_layout,
    outside_band,
    park,
    resident,
    ring,
    rows_start,
    sequence,
    store,
    store_rows,
    take,
    tiles,
    unpark,
)


@gluon.jit
def _dkdv_producer(q_desc, do_desc, lse_desc, delta_desc, steps, q, lse_row, stride_lh, n_steps, GROUP,
                   BLOCK_M: gl.constexpr):  # fmt: skip
    """Streams (Q, dO, LSE, delta) tiles into the ring ``steps``, n_steps per query head of the GQA group, from
    coordinate q (of the group's first head; LSE entry lse_row) on."""
    for g in range(GROUP):
        for j in range(n_steps):
            it = g * n_steps + j
            row = [q[0], q[1] + j * BLOCK_M, q[2] + g, 0]
            lse = lse_row + g * stride_lh + j * BLOCK_M
            fill((q_desc, do_desc, lse_desc, delta_desc), (row, row, [lse], [lse]), steps, it)


@gluon.jit
def _dq_issue(dq_sums, k_bufs, c, zero_q, W: gl.constexpr):
    """Once both warpgroups' dS^T of completion c of ds_ready are in ds_bufs[c % 2]: issues warpgroup W's share of
    dQ = dS K over both warpgroups' keys (the W-th half of its columns). Returns (dQ's accumulator, the dS tiles)."""
    _, ds_bufs, ds_ready, _ = dq_sums
    half: gl.constexpr = zero_q.shape[1]
    mbarrier.wait(ds_ready.index(c % 2), (c // 2) & 1)
    ds0 = ds_bufs.index(2 * (c % 2)).permute((1, 0))
    ds1 = ds_bufs.index(2 * (c % 2) + 1).permute((1, 0))
    dq = warpgroup_mma(ds0, k_bufs.index(0).slice(W * half, half, dim=1), zero_q, use_acc=False, is_async=True)
    dq = warpgroup_mma(ds1, k_bufs.index(1).slice(W * half, half, dim=1), dq, is_async=True)
    return dq, ds0, ds1


@gluon.jit
def _fragments(acc, COLS: gl.constexpr):
    """A warpgroup's [64, n] wgmma accumulator (mma_layout(n)) relabelled, with no data movement, as [64 * n / COLS,
    COLS] in fragment order: the value at (row 16w + 8h + r, column 8j + 2c + e), for (w, h, r, j, c, e) in
    (4, 2, 8, n / 8, 4, 2), at flat position ((w * n / 8 + j) * 32 + 4r + c) * 4 + 2h + e. A thread's four values of
    a column group (rows r, r + 8, columns 2c, 2c + 1) lie side by side, so the tile stores to an unswizzled buffer in
    16-byte pieces, a warp's 512 contiguous bytes at a time (no bank conflicts)."""
    J: gl.constexpr = acc.shape[1] // 8
    frag = gl.permute(gl.reshape(acc, [4, 2, 8, J, 4, 2]), (0, 3, 2, 4, 1, 5))
    return gl.reshape(frag, [acc.shape[0] * acc.shape[1] // COLS, COLS])


@gluon.jit
def _dq_add(dq_sums, dq, coord, softmax_scale, W: gl.constexpr):
    """dQ's tile of rows [coord[0], + 64) and columns [coord[1], + n) += dq * softmax_scale ([64, n]), by a TMA
    reduction staged in dq_bufs[W]. dq_desc reads the fp32 sums as (row tile, fragment row) x (column tile,
    fragment column): each tile's values in _fragments' order (backward.py's dQ conversion puts them back)."""
    dq_desc, _, _, dq_bufs = dq_sums
    dq_smem = dq_bufs.index(W)
    tma.store_wait(0)  # the previous reduction has read dq_smem
    COLS: gl.constexpr = dq_smem.shape[1]
    dq_smem.store(_fragments(dq * softmax_scale, COLS))
    fence_async_shared()
    tma_add(dq_desc, [coord[0] // dq.shape[0] * dq_smem.shape[0], coord[1] // dq.shape[1] * COLS], dq_smem)


@gluon.jit
def _piece_add(desc, coord, value, smem):
    """desc's tile at coord += value, by a TMA reduction staged in smem (a tile nothing else reads or writes until
    the caller's tma.store_wait)."""
    smem.store(value)
    fence_async_shared()
    tma_add(desc, coord, smem)


@gluon.jit
def _ragged(p_t, rows, keys, n, n_k, ROWS: gl.constexpr, KEYS: gl.constexpr):
    """p_t (keys x queries) with the entries of queries past n (ROWS) or keys past n_k (KEYS) zeroed. Varlen,
    both: their rows are the next sequence's. A dense sequence's query rows past n need none: Q, dO are TMA's zeros
    there and LSE, delta zeros, so P = 1 and dS = 0 (causal, the band excludes its keys past n for the rows before
    n). Its keys past n_k do, unmasked: a row's P = exp(-LSE) there overflows where LSE is very negative, and
    dS = -P delta times K's zeros is then NaN in dQ."""
    if ROWS and KEYS:
        p_t = gl.where(gl.expand_dims(keys < n_k, 1) & gl.expand_dims(rows < n, 0), p_t, 0.0)
    elif KEYS:
        p_t = gl.where(gl.expand_dims(keys < n_k, 1), p_t, 0.0)
    return p_t


@gluon.jit
def _store_keys(key_descs, outs, which: gl.constexpr, value, smem, coord, rows_left, VARLEN: gl.constexpr,
                RAGGED: gl.constexpr, HEAD_D: gl.constexpr):  # fmt: skip
    """dK or dV's tile at coord: through TMA (key_descs[which], staged in smem), or from registers where there are
    no key_descs (fp32 results) or a varlen sequence ends inside it (outs[which]: the tensor and its strides;
    rows_left: the sequence's rows from coord on)."""
    if len(key_descs) == 0 or (VARLEN and RAGGED and rows_left < value.shape[0]):
        store_rows(outs[which][0], outs[which][1], coord, value, rows_left, HEAD_D)
    else:
        store(key_descs[which], value, smem, coord)


@gluon.jit
def _dkdv_consumer(key_descs, dq_sums, k_bufs, v_bufs, steps, kv_bar, kv_at, outs, n0, n, n_k, first_query, sums_row,
                   q_col, n_steps, GROUP, qk_scale, softmax_scale, window_left, W: gl.constexpr, FUSED: gl.constexpr,
                   DQ_LATE: gl.constexpr, READ_AHEAD: gl.constexpr, CAUSAL: gl.constexpr, LEFT: gl.constexpr,
                   VARLEN: gl.constexpr, RAGGED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   D: gl.constexpr, HEAD_D: gl.constexpr):  # fmt: skip
    """Warpgroup W's BLOCK_N keys (n0 + W * BLOCK_N on among n_k, against n queries; kv_at: the program's parked (batch,
    first key row, K/V head) coordinate in the descriptors):
    for each query tile of the ring ``steps``, S^T = K Q^T and dP^T = V dO^T (both from shared memory), then
    dV += P^T dO and dK += dS^T Q with P^T and dS^T from registers. key_descs, outs: _store_keys'; sums_row, q_col:
    the first query tile's coordinate in the dQ sums.

    FUSED, with dq_sums = (dq_desc, ds_bufs, ds_ready, dq_bufs): also dQ += dS K for the tile, added into
    dq_desc's fp32 rows by TMA reductions. Both warpgroups put their dS^T in shared memory (ds_bufs: [parity]
    [warpgroup]; step i's go to parity (i + 1) % 2 and complete ds_ready's phase i + 1, a phase 0 of both
    warpgroups' arrivals before the first step), and warpgroup W multiplies the dS of all 2 * BLOCK_N keys
    into the W-th half of dQ's columns, staged in dq_bufs[W]. DQ_LATE: that multiply is issued a step late,
    beside the next step's S^T and dP^T, so that a warpgroup does not wait on the other's dS while its tensor
    cores could work (phase 0 then brings zeros for step 0 to multiply)."""
    s_layout: gl.constexpr = mma_layout(BLOCK_M)
    o_layout: gl.constexpr = mma_layout(D)
    a_layout: gl.constexpr = operand_layout(D)
    queries: gl.constexpr = gl.SliceLayout(0, s_layout)
    half: gl.constexpr = D // 2
    LATE: gl.constexpr = FUSED and DQ_LATE
    DQ_GROUPS: gl.constexpr = 2 if LATE else 0  # the late dQ's wgmma groups, in flight beside a step's own
    k_smem = k_bufs.index(W)
    v_smem = v_bufs.index(W)
    first_key = n0 + W * BLOCK_N
    dtype: gl.constexpr = k_smem.dtype
    _, _, lse_bufs, delta_bufs = steps[0]
    STAGES: gl.constexpr = lse_bufs.shape[0]

    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    zero_q = gl.zeros([BLOCK_M, half], gl.float32, mma_layout(half))
    dk = gl.zeros([BLOCK_N, D], gl.float32, o_layout)
    dv = gl.zeros([BLOCK_N, D], gl.float32, o_layout)
    keys = first_key + gl.arange(0, BLOCK_N, gl.SliceLayout(1, s_layout))
    dq_at = [sums_row, q_col + W * half]  # LATE: where the dQ in flight goes (step 0's zeros: anywhere)
    if FUSED:
        ds_ready = dq_sums[2]
        if LATE:
            dq_sums[1].index(W).store(gl.zeros([BLOCK_N, BLOCK_M], dtype, s_layout))
            fence_async_shared()
        mbarrier.arrive(ds_ready.index(0), count=1)
    mbarrier.wait(kv_bar, 0)
    for g in range(GROUP):
        for j in range(n_steps):
            it = g * n_steps + j
            s = it % STAGES  # the step's slot, whose LSE and delta are read where they are needed
            q0 = first_query + j * BLOCK_M
            rows = q0 + gl.arange(0, BLOCK_M, queries)
            q, do = take(steps, it)[:2]
            if READ_AHEAD:  # before the wgmmas, whose operand reads would queue these loads behind them
                lse2 = lse_bufs.index(s).load(queries) * LOG2E
                delta = delta_bufs.index(s).load(queries)
            s_t = warpgroup_mma(k_smem, q.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dp_t = warpgroup_mma(v_smem, do.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            if LATE:  # the previous step's dQ
                dq, ds0, ds1 = _dq_issue(dq_sums, k_bufs, it, zero_q, W)
            if not READ_AHEAD:
                lse2 = lse_bufs.index(s).load(queries) * LOG2E
            s_t = warpgroup_mma_wait(1 + DQ_GROUPS, deps=(s_t, k_smem, q))[0]
            p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse2, 0))
            if CAUSAL:
                # FUSED: every step, as a branch here makes ptxas serialise the fused kernel's wgmmas (C7512)
                if FUSED or outside_band(q0, q0 + BLOCK_M - 1, first_key, first_key + BLOCK_N - 1, window_left, LEFT):
                    p_t = band_only(p_t, rows, keys, window_left, LEFT)
            p_t = _ragged(p_t, rows, keys, n, n_k, VARLEN and RAGGED, RAGGED and (VARLEN or not CAUSAL))
            dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), a_layout), do, dv, is_async=True)
            if not READ_AHEAD:
                delta = delta_bufs.index(s).load(queries)
            dp_t = warpgroup_mma_wait(1 + DQ_GROUPS, deps=(dp_t, v_smem, do))[0]
            ds_t = (p_t * (dp_t - gl.expand_dims(delta, 0))).to(dtype)
            if FUSED:
                # both warpgroups are past the dQ that read this parity last (they waited for the other's phase)
                dq_sums[1].index(2 * ((it + 1) % 2) + W).store(ds_t)
            dk = warpgroup_mma(gl.convert_layout(ds_t, a_layout), q, dk, is_async=True)
            if LATE:
                # _dq_add's fence covers the dS^T store too: one wait for both to land
                _dq_add(dq_sums, warpgroup_mma_wait(2, deps=(dq, ds0, ds1))[0], dq_at, softmax_scale, W)
                mbarrier.arrive(ds_ready.index((it + 1) % 2), count=1)
                dq_at = [sums_row + j * BLOCK_M, q_col + g * D + W * half]
                dk, dv = warpgroup_mma_wait(0, deps=(dk, dv, q, do))[:2]
            elif FUSED:
                fence_async_shared()
                mbarrier.arrive(ds_ready.index((it + 1) % 2), count=1)
                dq, ds0, ds1 = _dq_issue(dq_sums, k_bufs, it + 1, zero_q, W)
                dk, dv, dq = warpgroup_mma_wait(0, deps=(dk, dv, dq, q, do, ds0, ds1))[:3]
                _dq_add(dq_sums, dq, [sums_row + j * BLOCK_M, q_col + g * D + W * half], softmax_scale, W)
            else:
                dk, dv = warpgroup_mma_wait(0, deps=(dk, dv, q, do))[:2]
            give(steps, it)

    n_all = n_steps * GROUP
    if LATE:  # the last step's dQ
        dq, ds0, ds1 = _dq_issue(dq_sums, k_bufs, n_all, zero_q, W)
        _dq_add(dq_sums, warpgroup_mma_wait(0, deps=(dq, ds0, ds1))[0], dq_at, softmax_scale, W)
    # K and V are no longer read (the other warpgroup's dQ too is done with this K): their buffers stage dK
    # and dV for the TMA stores
    if FUSED:
        mbarrier.arrive(ds_ready.index((n_all + 1) % 2), count=1)
        mbarrier.wait(ds_ready.index((n_all + 1) % 2), ((n_all + 1) // 2) & 1)
    bc, row, hk = unpark(kv_at, CONSUMER_WARPS)
    coord = [bc, row + W * BLOCK_N, hk, 0]
    _store_keys(key_descs, outs, 0, dk * softmax_scale, k_smem, coord, n_k - first_key, VARLEN, RAGGED, HEAD_D)
    _store_keys(key_descs, outs, 1, dv, v_smem, coord, n_k - first_key, VARLEN, RAGGED, HEAD_D)


@gluon.jit
def _exchange(bars, it):
    """This warpgroup's stores for step it are in shared memory (fenced for the tensor cores); waits until the
    other's are too: phase it // 2 of bars[it % 2], two arrivals."""
    fence_async_shared()
    bar = bars.index(it % 2)
    mbarrier.arrive(bar, count=1)
    mbarrier.wait(bar, (it // 2) & 1)


@gluon.jit
def _dkdv_split_consumer(key_descs, dq_desc, k_smem, v_smem, steps, pt_bufs, dst_bufs, p_ready, ds_ready,
                         kv_bar, kv_at, outs, first_key, n, n_k, first_query, sums_row, q_col, n_steps, GROUP,
                         qk_scale,
                         softmax_scale, window_left, W: gl.constexpr, CAUSAL: gl.constexpr, LEFT: gl.constexpr,
                         VARLEN: gl.constexpr, RAGGED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         D: gl.constexpr, HEAD_D: gl.constexpr):  # fmt: skip
    """Warpgroup W's half of D's columns for the program's BLOCK_N keys, which both warpgroups share: at D = 256 a
    warpgroup's registers hold dK and dV for 64 keys x 128 columns, not 256. Per streamed query tile it takes S^T
    and dP^T for its half of the tile's queries (K, V, Q, dO from shared memory) and puts P^T and dS^T there
    (pt_bufs, dst_bufs: [step parity], the halves side by side); once the other warpgroup's halves are there too
    (p_ready, ds_ready), dV += P^T dO and dK += dS^T Q over all the tile's queries for its columns, and dQ = dS K
    for its columns, added into dq_desc's fp32 rows by two TMA reductions of D / 4 columns. Shared memory has no
    room for their staging tiles beside two (Q, dO) slots: they go through this warpgroup's columns of the step's
    dO and Q tiles, which only its own dV and dK read after the exchange (NVMMA tiles keep each 128-byte column
    block whole, so a half of D's columns is one contiguous 16 KB); the slot goes back a step later, once they have
    been read."""
    QH: gl.constexpr = BLOCK_M // 2  # this warpgroup's queries of a tile
    DH: gl.constexpr = D // 2  # and columns
    s_layout: gl.constexpr = mma_layout(QH)
    o_layout: gl.constexpr = mma_layout(DH)
    queries: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = k_smem.dtype
    q_bufs, do_bufs, _, _ = steps[0]
    STAGES: gl.constexpr = q_bufs.shape[0]
    # the (Q, dO) slots as [slot, column half] tiles of dQ's fp32 pieces
    pieces: gl.constexpr = [STAGES * 2, BLOCK_M, DH // 2]
    do_pieces = reinterpret(do_bufs, gl.float32, pieces, dq_desc.layout)
    q_pieces = reinterpret(q_bufs, gl.float32, pieces, dq_desc.layout)

    zero_s = gl.zeros([BLOCK_N, QH], gl.float32, s_layout)
    zero_o = gl.zeros([BLOCK_M, DH], gl.float32, o_layout)
    dk = gl.zeros([BLOCK_N, DH], gl.float32, o_layout)
    dv = gl.zeros([BLOCK_N, DH], gl.float32, o_layout)
    keys = first_key + gl.arange(0, BLOCK_N, gl.SliceLayout(1, s_layout))
    k_cols = k_smem.slice(W * DH, DH, dim=1)
    mbarrier.wait(kv_bar, 0)
    for g in range(GROUP):
        for j in range(n_steps):
            it = g * n_steps + j
            s = it % STAGES
            q, do, lse_smem, delta_smem = take(steps, it)
            lse2 = lse_smem.slice(W * QH, QH).load(queries) * LOG2E
            delta = delta_smem.slice(W * QH, QH).load(queries)
            s_t = warpgroup_mma(k_smem, q.slice(W * QH, QH).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dp_t = warpgroup_mma(v_smem, do.slice(W * QH, QH).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s_t = warpgroup_mma_wait(1, deps=(s_t, k_smem, q))[0]
            if it > 0:  # the step before's reductions have long read its slot: it goes back
                tma.store_wait(0)
                give(steps, it + STAGES - 1)  # position it - 1 (plus a lap: a remainder of a non-negative number)
            p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse2, 0))
            rows = first_query + j * BLOCK_M + W * QH + gl.arange(0, QH, queries)
            if CAUSAL:  # every step: a branch here could make ptxas serialise the wgmmas (C7512)
                p_t = band_only(p_t, rows, keys, window_left, LEFT)
            p_t = _ragged(p_t, rows, keys, n, n_k, RAGGED, RAGGED)  # D=256: without the row masks it ran slower
            pt = pt_bufs.index(it % 2)
            pt.slice(W * QH, QH, dim=1).store(p_t.to(dtype))
            _exchange(p_ready, it)
            dv = warpgroup_mma(pt, do.slice(W * DH, DH, dim=1), dv, is_async=True)
            dp_t = warpgroup_mma_wait(1, deps=(dp_t, v_smem, do))[0]
            dst = dst_bufs.index(it % 2)
            dst.slice(W * QH, QH, dim=1).store((p_t * (dp_t - gl.expand_dims(delta, 0))).to(dtype))
            _exchange(ds_ready, it)  # both warpgroups' S^T and dP^T are done: only dV and dK read Q and dO now
            dq = warpgroup_mma(dst.permute((1, 0)), k_cols, zero_o, use_acc=False, is_async=True)
            dk = warpgroup_mma(dst, q.slice(W * DH, DH, dim=1), dk, is_async=True)
            dv, dq = warpgroup_mma_wait(1, deps=(dv, dq, pt, dst, do, k_cols))[:2]
            lo, hi = halves(dq * softmax_scale)
            row = sums_row + j * BLOCK_M
            col = q_col + g * D + W * DH
            _piece_add(dq_desc, [row, col], lo, do_pieces.index(2 * s + W))  # this dV is done with those columns
            dk = warpgroup_mma_wait(0, deps=(dk, q))[0]
            _piece_add(dq_desc, [row, col + DH // 2], hi, q_pieces.index(2 * s + W))  # and this dK

    # (the last step's slot is not needed again.) Once the other warpgroup too is done with K and V, their tiles stage
    # this one's dK and dV columns
    _exchange(p_ready, GROUP * n_steps)
    bc, row, hk = unpark(kv_at, CONSUMER_WARPS)
    coord = [bc, row, hk, W * DH]
    _store_keys(key_descs, outs, 0, dk * softmax_scale, k_cols, coord, n_k - first_key, VARLEN, RAGGED, HEAD_D)
    _store_keys(key_descs, outs, 1, dv, v_smem.slice(W * DH, DH, dim=1), coord, n_k - first_key, VARLEN, RAGGED,
                HEAD_D)  # fmt: skip


@gluon.jit
def attention_backward_dkdv_sm90_kernel(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, DK, stride_dkb, stride_dkm, stride_dkh, DV, stride_dvb,
    stride_dvm, stride_dvh, dq_desc, sums_rows, lse_desc, delta_desc, stride_lb, stride_lh, N, N_K, H, GROUP, qk_scale,
    softmax_scale, window_left, CU_SEQLENS, order_heads,
    CAUSAL: gl.constexpr, LEFT: gl.constexpr, VARLEN: gl.constexpr, RAGGED: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, D: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, DQ_LATE: gl.constexpr,
    READ_AHEAD: gl.constexpr, SPLIT_D: gl.constexpr, WORKER_REGISTERS: gl.constexpr,
):  # fmt: skip
    """Grid (cdiv(N_K, KEYS) * B * HKV,): dK, dV of KEYS keys of one K/V head, two consumer warpgroups and a producer
    warp streaming the (Q, dO, LSE, delta) tiles of the GQA group through a ring of STAGES slots; lse/delta_desc: LSE
    and DELTA in their aligned rows (strides stride_lb, stride_lh; primitives.rows_start) as flat vectors, in blocks
    of BLOCK_M entries. The warpgroups take BLOCK_N keys each (KEYS = 2 * BLOCK_N)
    or, SPLIT_D, the same KEYS = BLOCK_N keys and half of D's columns each (_dkdv_split_consumer). k/v_desc: blocks
    of BLOCK_N x D; dk/dv_desc: of BLOCK_N x D, or D / 2 when SPLIT_D, or both None: dK and dV stored from registers
    (fp32 results, for which the K and V tiles that stage a TMA store have no room). dq_desc: None, or the fp32 sums
    to which these keys' dQ shares are added (TMA reductions), sums_rows rows per batch: laid out as _dq_add says,
    or, SPLIT_D, (B * sums_rows, H * D) in blocks of BLOCK_M x D / 4. DK, DV: dK and dV again, with their strides,
    for the register stores of a varlen sequence's last keys or of fp32 results (_store_keys). D: the tiles' width,
    HEAD_D <= D the tensors' (primitives.py). WORKER_REGISTERS: the worker consumer warpgroup's (setmaxnreg)."""
    KEYS: gl.constexpr = BLOCK_N if SPLIT_D else 2 * BLOCK_N
    # programs in groups of order_heads K/V heads, each group's key blocks in order: its first blocks (causal: the
    # longest) before the next
    n_blocks = gl.cdiv(N_K, KEYS)
    pid = gl.program_id(0)
    group0 = pid // (order_heads * n_blocks) * order_heads
    in_group = gl.minimum(order_heads, gl.num_programs(0) // n_blocks - group0)
    pid_n = (pid - group0 * n_blocks) // in_group
    pid_bh = group0 + (pid - group0 * n_blocks) % in_group
    hkv = H // GROUP
    b = pid_bh // hkv
    hk = pid_bh % hkv
    n0 = pid_n * KEYS
    bc, seq0, N, _ = sequence(CU_SEQLENS, b, N, VARLEN, flat_view(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc))
    n_k = keys_of(N, N_K, VARLEN)
    if VARLEN:
        if n0 >= N:
            return
    kv = [bc, seq0 + n0, hk, 0]
    outs = ()  # (only where _store_keys stores from registers: registers the consumers need otherwise)
    if (VARLEN and RAGGED) or dk_desc is None:
        outs = ((DK, (stride_dkb, stride_dkm, stride_dkh)), (DV, (stride_dvb, stride_dvm, stride_dvh)))
    key_descs = ()  # (a worker partition's arguments cannot be None)
    if dk_desc is not None:
        key_descs = (dk_desc, dv_desc)

    q_bufs = tiles(q_desc, STAGES)
    do_bufs = tiles(do_desc, STAGES)
    steps = ring((q_bufs, do_bufs), 2)
    kv_bar = barriers(1, 1).index(0)  # the resident K and V tiles have landed
    # LSE and delta land in the ring's slots too (allocated after its barriers: the layout the kernel was tuned with)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], lse_desc.layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], delta_desc.layout)
    steps = ((q_bufs, do_bufs, lse_bufs, delta_bufs), steps[1], steps[2])
    mbarrier.expect(kv_bar, KEYS // BLOCK_N * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    k_bufs = resident(k_desc, kv_bar, kv, KEYS // BLOCK_N)
    v_bufs = resident(v_desc, kv_bar, kv, KEYS // BLOCK_N)
    # the consumers' dK/dV coordinate waits in shared memory instead of in registers through their step loops
    # (measured faster for causal dK/dV: DECISIONS, "parked")
    kv_at = park(bc, seq0 + n0, hk, CONSUMER_WARPS)
    FUSED: gl.constexpr = dq_desc is not None
    dq_sums = ()  # (a worker partition's arguments cannot be None)
    if FUSED and not SPLIT_D:  # dQ's target; dS^T tiles [step parity][warpgroup]; their barriers; staging tiles
        ds_bufs = gl.allocate_shared_memory(q_desc.dtype, [4, BLOCK_N, BLOCK_M], flat_layout(q_desc))
        dq_sums = (dq_desc, ds_bufs, barriers(2, 2), tiles(dq_desc, 2))

    first_query = 0
    last_query = N
    if CAUSAL:  # queries before the first key see none of these keys
        first_query = n0
    if LEFT:  # nor do queries more than window_left after the last
        last_query = gl.minimum(gl.cdiv(n0 + KEYS + window_left, BLOCK_M) * BLOCK_M, N)
    n_steps = gl.cdiv(last_query - first_query, BLOCK_M)
    h0 = hk * GROUP
    # of LSE and DELTA, as flat vectors in their aligned rows
    lse_row = b * stride_lb + h0 * stride_lh + rows_start(CU_SEQLENS, b, VARLEN) + first_query
    q_row = seq0 + first_query
    sums_row = q_row if VARLEN else b * sums_rows + first_query  # a batch's sums start at b * sums_rows, either view
    producer = (q_desc, do_desc, lse_desc, delta_desc, steps, [bc, q_row, h0, 0], lse_row, stride_lh, n_steps, GROUP,
                BLOCK_M)  # fmt: skip
    if SPLIT_D:
        # P^T and dS^T tiles [step parity], each warpgroup's queries side by side; a barrier pair for each
        pt_bufs = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_N, BLOCK_M], flat_layout(q_desc))
        dst_bufs = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_N, BLOCK_M], flat_layout(q_desc))
        p_ready = barriers(2, 2)
        ds_ready = barriers(2, 2)
        gl.warp_specialize(
            [
                (_dkdv_split_consumer, (key_descs, dq_desc, k_bufs.index(0), v_bufs.index(0), steps, pt_bufs,
                                        dst_bufs, p_ready, ds_ready, kv_bar, kv_at, outs, n0, N, n_k, first_query,
                                        sums_row, h0 * D, n_steps, GROUP, qk_scale, softmax_scale, window_left, 0,
                                        CAUSAL, LEFT, VARLEN, RAGGED, BLOCK_M, BLOCK_N, D, HEAD_D)),
                (_dkdv_split_consumer, (key_descs, dq_desc, k_bufs.index(0), v_bufs.index(0), steps, pt_bufs,
                                        dst_bufs, p_ready, ds_ready, kv_bar, kv_at, outs, n0, N, n_k, first_query,
                                        sums_row, h0 * D, n_steps, GROUP, qk_scale, softmax_scale, window_left, 1,
                                        CAUSAL, LEFT, VARLEN, RAGGED, BLOCK_M, BLOCK_N, D, HEAD_D)),
                (_dkdv_producer, producer),
            ],
            [CONSUMER_WARPS, PRODUCER_WARPS],
            [WORKER_REGISTERS, PRODUCER_REGISTERS],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (_dkdv_consumer, (key_descs, dq_sums, k_bufs, v_bufs, steps, kv_bar, kv_at, outs, n0, N, n_k,
                                  first_query, sums_row, h0 * D, n_steps, GROUP, qk_scale, softmax_scale, window_left,
                                  0, FUSED, DQ_LATE, READ_AHEAD, CAUSAL, LEFT, VARLEN, RAGGED, BLOCK_M, BLOCK_N, D,
                                  HEAD_D)),
                (_dkdv_consumer, (key_descs, dq_sums, k_bufs, v_bufs, steps, kv_bar, kv_at, outs, n0, N, n_k,
                                  first_query, sums_row, h0 * D, n_steps, GROUP, qk_scale, softmax_scale, window_left,
                                  1, FUSED, DQ_LATE, READ_AHEAD, CAUSAL, LEFT, VARLEN, RAGGED, BLOCK_M, BLOCK_N, D,
                                  HEAD_D)),
                (_dkdv_producer, producer),
            ],
            [CONSUMER_WARPS, PRODUCER_WARPS],
            [WORKER_REGISTERS, PRODUCER_REGISTERS],
        )  # fmt: skip
