"""The Gluon forward on sm90: persistent, warp-specialised.

Notation
  B, H, HKV    batch, query heads, key/value heads; GROUP = H // HKV query heads share a K/V head
  N            sequence length, of queries and keys alike (self-attention); VARLEN: the longest, sequence b being
               rows CU_SEQLENS[b]:CU_SEQLENS[b + 1] of the packed batch. RAGGED: some sequence ends inside a tile
  N_K          the keys' length where it is not N: a dense call without a mask (cross-attention); N otherwise
  D            the tiles' width (64, 128, 256); HEAD_D <= D the tensors' head dim (primitives.py)
  BLOCK_M      query rows of one consumer warpgroup; a tile is CONSUMERS * BLOCK_M rows of one head
  BLOCK_N      keys per streamed K/V tile
  CONSUMERS    consumer warpgroups per program (2 or 3)

Grid: (P,), P at most the SM count: program i runs the query tiles that SCHEDULE lists for it (schedule.py) or, where
SCHEDULE is None, work units i, i + P, ... (_forward_tile), and computes those tiles' O and LSE. Each consumer
warpgroup owns BLOCK_M query rows of a tile and streams the K/V tiles they see: S = Q K^T (both from shared memory),
P = exp2(S * qk_scale - m), O += P V (P from registers). S_j is issued with P_{j-1} V_{j-1} and waited for alone, so
that the softmax of tile j can run beside that P V. K and V have rings of their own (V_j is read a step after K_j
and can do with fewer slots), and each consumer a ring of Q tiles, so the producer loads the next tile's Q and K/V
while the consumers finish the current one. The one key tile of a tile's stream that needs a mask can go first
(last_first: a sequence without a band that ends inside it; a causal tile's diagonal, where the config asks), so that
only the first step masks keys. O goes out through shared memory and a TMA store (at D=256 in two column halves,
for want of room), and a causal tile marked r = 1 hands its row blocks to the warpgroups in reverse where they see
unequal numbers of key tiles.

Numerics: scores in base 2 (qk_scale = softmax_scale * LOG2E), so the running max m is in base-2 units; the running
sum and O's accumulator are fp32; the LSE written out is natural-log. SINKS (H,) fp32 (natural units) or None: each
row's sink is one more logit, folded into m and the sum after the row's last tile (params.py); it multiplies no V row.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma, warpgroup_mma, warpgroup_mma_wait

from .primitives import (
    CONSUMER_WARPS,
    LN2,
    LOG2E,
    PRODUCER_REGISTERS,
    PRODUCER_WARPS,
    THREE_CONSUMER_REGISTERS,
    TWO_CONSUMER_REGISTERS,
    at,
    band_tile,
    fill,
    flat_view,
    give,
    halves,
    key_tiles,
    keys_before,
    keys_of,
    last_first,
    mma_layout,
    operand_layout,
    outside_band,
    query_tile,
    ring,
    stage_out,
    step_tile,
    store_rows,
    take,
    tiles,
)


@gluon.jit
def _row_max(x, TREE: gl.constexpr):
    """gl.max(x, 1), or with TREE over column halves first: Triton reduces a thread's elements of a row in one chain
    of dependent instructions (31 for a row of 128 columns); halving the tile first makes it a tree."""
    rows: gl.constexpr = gl.SliceLayout(1, x.type.layout)
    for _ in gl.static_range(x.shape[1].bit_length() - 4 if TREE else 0):
        lo, hi = halves(x)
        x = gl.maximum(lo, hi)
    return gl.convert_layout(gl.max(x, 1), rows)  # the same rows: no data moves


@gluon.jit
def _row_sum(x, TREE: gl.constexpr):
    """gl.sum(x, 1), as _row_max."""
    rows: gl.constexpr = gl.SliceLayout(1, x.type.layout)
    for _ in gl.static_range(x.shape[1].bit_length() - 4 if TREE else 0):
        lo, hi = halves(x)
        x = lo + hi
    return gl.convert_layout(gl.sum(x, 1), rows)


@gluon.jit
def _online_softmax(scores, m_i, l_i, rows, first_row, first_col, n, qk_scale, window_left, CAUSAL: gl.constexpr,
                    LEFT: gl.constexpr, RAGGED: gl.constexpr, BLOCK_N: gl.constexpr, TREE: gl.constexpr):  # fmt: skip
    """One key tile of the online softmax: (P in log2 units against the new max, new max, new sum, the
    factor alpha that rescales what was accumulated against the old max). TREE: the row reductions as trees.
    Keys past the sequence's n are masked where RAGGED (causal, the rows that are stored see none of them)."""
    if CAUSAL:
        last_row = first_row + scores.shape[0] - 1
        if outside_band(first_row, last_row, first_col, first_col + BLOCK_N - 1, window_left, LEFT):
            scores = band_tile(scores, rows, first_col, window_left, float("-inf"), LEFT)
    elif RAGGED:
        scores = keys_before(scores, first_col, n, float("-inf"))
    m_new = gl.maximum(m_i, _row_max(scores, TREE) * qk_scale)  # the scaled max: interface makes qk_scale > 0
    m_use = m_new
    if LEFT:  # a row may have seen no key yet: its window starts past this tile
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(scores * qk_scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    return p, m_new, l_i * alpha + _row_sum(p, TREE), alpha


@gluon.jit
def _log2(x):
    """log2 by lg2.approx.f32 (absolute error about 2^-22): the exact one cost training forwards 2-4% (DECISIONS)."""
    return gl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _program_tiles(schedule, units, CAUSAL: gl.constexpr):
    """(where this program's list starts, how many tiles it runs): from schedule = (SCHEDULE, m_bits, h_bits), the
    table of schedule.py, or with schedule = () units pid, pid + P, ... of _forward_tile's own order, one or (causal)
    two tiles each."""
    pid = gl.program_id(0)
    if len(schedule) == 0:
        return 0, gl.cdiv(units - pid, gl.num_programs(0)) * (1 + CAUSAL)
    else:
        first = gl.load(schedule[0] + pid)
        return first, gl.load(schedule[0] + pid + 1) - first


@gluon.jit
def _entry(schedule, first, i, count):
    """This program's i-th tile as _forward_tile takes it: the table's entry, or i itself. i is clamped to the
    list, so that a read a tile ahead stays inside it."""
    i = gl.minimum(i, count - 1)
    if len(schedule) == 0:
        return i
    else:
        return gl.load(schedule[0] + gl.num_programs(0) + 1 + first + i)


@gluon.jit
def _forward_tile(e, schedule, n_m, N, N_K, H, CU_SEQLENS, window_left, CAUSAL: gl.constexpr, LEFT: gl.constexpr,
                  VARLEN: gl.constexpr, FLAT: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    """A program's tile e (_entry): (whether it has rows, r, batch, head, first query row in the sequence, the
    sequence's length and its keys', its batch coordinate and first row, its first LSE column, then key_tiles' two).
    r = 1 marks a tile whose warpgroups take their row blocks in reverse (_block_of). Without a table, unit
    e // (1 + CAUSAL) of the program is one query tile; causal, the p-th longest and the p-th shortest query tiles of
    a head (r = 0, 1; one tile in the middle of an odd count), so that every unit has about the same work. With one,
    schedule = (table, m_bits, h_bits) and e is ((((b << h_bits) | h) << m_bits | p) << 1) | r, p counting a head's
    tiles longest first (schedule.py; triton_backend._fields)."""
    if len(schedule) == 0:
        u = gl.program_id(0) + e // (1 + CAUSAL) * gl.num_programs(0)
        r = e % (1 + CAUSAL)
        per_head = n_m
        if CAUSAL:
            per_head = (n_m + 1) // 2
        p = u % per_head
        pid_bh = u // per_head
        pid_m = p + r * (n_m - 1 - 2 * p)  # r = 1: n_m - 1 - p
        is_tile = (r == 0) | (2 * p + 1 < n_m)  # the middle tile's twin is no tile
        b = pid_bh // H
        h = pid_bh % H
    else:  # bit fields, not a runtime division's dependent chain at every tile's start
        _, m_bits, h_bits = schedule
        pid_m = (e >> 1) & ((1 << m_bits) - 1)
        b = e >> (1 + m_bits + h_bits)
        h = (e >> (1 + m_bits)) & ((1 << h_bits) - 1)
        r = e & 1
        is_tile = True  # every entry of the table is one
    m0, bc, seq0, n, lse0 = query_tile(pid_m, b, n_m, N, CU_SEQLENS, CAUSAL, VARLEN, FLAT, ROWS)
    n_k = keys_of(n, N_K, VARLEN)
    key0, n_tiles = key_tiles(m0, ROWS, n_k, window_left, CAUSAL, LEFT, BLOCK_N)
    valid = (m0 < n) & is_tile  # m0 < n: not past a shorter varlen sequence
    return valid, r, b, h, m0, n, n_k, bc, seq0, lse0, key0, n_tiles


@gluon.jit
def _block_of(w, r, consumers: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Which BLOCK_M rows of a tile warpgroup w takes: the w-th or, where a causal tile's warpgroups see different
    numbers of key tiles (the last the most), in a tile marked r = 1 (_forward_tile) the w-th from the end, so that
    over a unit or a program's list every warpgroup sees about as many."""
    if consumers * BLOCK_M > BLOCK_N:
        return w + r * (consumers - 1 - 2 * w)
    return w


@gluon.jit
def _forward_producer(q_desc, k_desc, v_desc, q_rings, k_ring, v_ring, N, N_K, H, GROUP, CU_SEQLENS, units, schedule,
                      n_m, window_left, CAUSAL: gl.constexpr, LEFT: gl.constexpr, VARLEN: gl.constexpr,
                      ROTATE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    """For each of this program's tiles: each warpgroup's Q tile (into that warpgroup's ring of Q tiles; rows
    past a sequence's end too, which that warpgroup skips), then the tile's K and V tiles into their rings in the
    order of step_tile, step j's K with step j-1's V (the consumers read V_j a step after K_j)."""
    it = 0
    done = 0
    first, count = _program_tiles(schedule, units, CAUSAL)
    for i in range(count):
        valid, r, _, h, m0, _, _, bc, seq0, _, key0, n_tiles = _forward_tile(
            _entry(schedule, first, i, count), schedule, n_m, N, N_K, H, CU_SEQLENS, window_left, CAUSAL, LEFT, VARLEN,
            flat_view(q_desc), len(q_rings) * BLOCK_M, BLOCK_N,
        )  # fmt: skip
        if valid:
            for w in gl.static_range(len(q_rings)):
                row = seq0 + m0 + _block_of(w, r, len(q_rings), BLOCK_M, BLOCK_N) * BLOCK_M
                fill((q_desc,), ([bc, row, h, 0],), q_rings[w], done)
            kv = [bc, seq0 + key0, h // GROUP, 0]
            fill((k_desc,), (at(kv, step_tile(0, n_tiles, ROTATE) * BLOCK_N),), k_ring, it)
            for j in range(1, n_tiles):
                fill((k_desc,), (at(kv, step_tile(j, n_tiles, ROTATE) * BLOCK_N),), k_ring, it + j)
                fill((v_desc,), (at(kv, step_tile(j - 1, n_tiles, ROTATE) * BLOCK_N),), v_ring, it + j - 1)
            fill((v_desc,), (at(kv, step_tile(n_tiles - 1, n_tiles, ROTATE) * BLOCK_N),), v_ring, it + n_tiles - 1)
            it += n_tiles
            done += 1


@gluon.jit
def _named_barrier(asm: gl.constexpr, bar):
    """asm (bar.sync or bar.arrive on barrier $1, completing with another warpgroup's: 256 threads) on named barrier
    ``bar``, once per thread of the calling partition, which must be one warpgroup (4 warps, as the forward's
    consumers are). Gluon has no named barriers; the dummy output is inline_asm_elementwise's."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    gl.inline_asm_elementwise(asm + " $1, 256;\n\tmov.b32 $0, 0;", "=r,r", [gl.full([128], bar, gl.int32, one)],
                              dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


# Named barriers of the consumers' turns, TURNS + w for warpgroup w (Triton's own barriers take the low ids).
TURNS = gl.constexpr(8)


@gluon.jit
def _await_turn(turns):
    """With turns = (W, CONSUMERS) (ping-pong), waits until warpgroup W may issue its MMAs; with turns = (), no-op."""
    if len(turns) > 0:
        _named_barrier("bar.sync", TURNS + turns[0])


@gluon.jit
def _hand_turn(turns):
    """With turns = (W, CONSUMERS), gives the next warpgroup (in a ring of CONSUMERS) its turn, once W has issued."""
    if len(turns) > 0:
        _named_barrier("bar.arrive", TURNS + (turns[0] + 1) % turns[1])


@gluon.jit
def _pass(k_ring, v_ring, it, n, turns):
    """Lets n K/V positions from it on go by unread: waits for each tile to land, then releases it. With turns, it
    first takes and hands on a turn for each, as the warpgroups that multiply it do (before the wait: a warpgroup
    that waited for a tile while the others waited for its turn could hold up the slot that tile needs)."""
    for j in range(n):
        _await_turn(turns)
        _hand_turn(turns)
        take(k_ring, it + j)
        give(k_ring, it + j)
        take(v_ring, it + j)
        give(v_ring, it + j)


@gluon.jit
def _attend(q_smem, q_ring, k_ring, v_ring, q_at, it, first_row, key0, n_tiles, n_k, qk_scale, window_left, turns,
            CAUSAL: gl.constexpr, LEFT: gl.constexpr, RAGGED: gl.constexpr, ROTATE: gl.constexpr,
            BLOCK_N: gl.constexpr, D: gl.constexpr, TREE: gl.constexpr):  # fmt: skip
    """One warpgroup's query rows (Q in q_smem, position q_at of q_ring) against n_tiles (K, V) tiles from position it
    of their rings on, in the order of step_tile, keys past n_k masked: (O unnormalised, row max, row sum).
    Step j's S = Q K_j^T is issued together with step j-1's O += P V_{j-1}, and the softmax of S_j comes between the
    waits for the two (which ptxas moves to before the exps). K_j goes back once S_j is done, V_j once P V_j is, and Q
    once every S is, before the last P V. With turns (_await_turn), the first S and each step's S and P V are issued
    in the warpgroup's turn, so that the warpgroups' softmaxes run beside each other's MMAs (FlashAttention-3's
    ping-pong); the last P V, as there, in none."""
    BLOCK_M: gl.constexpr = q_smem.shape[0]
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    o_layout: gl.constexpr = mma_layout(D)
    p_layout: gl.constexpr = operand_layout(D)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_smem.dtype

    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    rows = first_row + gl.arange(0, BLOCK_M, rows_s)
    k = take(k_ring, it)[0]
    _await_turn(turns)
    scores = warpgroup_mma(q_smem, k.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    _hand_turn(turns)
    scores = warpgroup_mma_wait(0, deps=(scores, q_smem, k))[0]
    give(k_ring, it)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, rows_s)
    first_col = key0 + step_tile(0, n_tiles, ROTATE) * BLOCK_N
    p, m_i, l_i, alpha = _online_softmax(scores, m_i, gl.zeros([BLOCK_M], gl.float32, rows_s), rows, first_row,
                                         first_col, n_k, qk_scale, window_left, CAUSAL, LEFT, RAGGED, BLOCK_N,
                                         TREE)  # fmt: skip
    p = gl.convert_layout(p.to(dtype), p_layout)
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    for j in range(1, n_tiles):
        k = take(k_ring, it + j)[0]
        _await_turn(turns)
        scores = warpgroup_mma(q_smem, k.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        v = take(v_ring, it + j - 1)[0]
        acc = warpgroup_mma(p, v, acc, is_async=True)
        _hand_turn(turns)
        scores = warpgroup_mma_wait(1, deps=(scores, q_smem, k))[0]  # S_j done; P V_{j-1} may still run
        give(k_ring, it + j)
        p_next, m_i, l_i, alpha = _online_softmax(
            scores, m_i, l_i, rows, first_row, key0 + step_tile(j, n_tiles, ROTATE) * BLOCK_N, n_k, qk_scale,
            window_left, CAUSAL and not ROTATE, LEFT, RAGGED and not ROTATE, BLOCK_N, TREE,
        )  # fmt: skip
        acc = warpgroup_mma_wait(0, deps=(acc, p, v))[0]
        give(v_ring, it + j - 1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p = gl.convert_layout(p_next.to(dtype), p_layout)
    give(q_ring, q_at)
    v = take(v_ring, it + n_tiles - 1)[0]
    acc = warpgroup_mma(p, v, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, v))[0]
    give(v_ring, it + n_tiles - 1)
    return acc, m_i, l_i


@gluon.jit
def _forward_consumer(shared, q_ring, W: gl.constexpr, CAUSAL: gl.constexpr, LEFT: gl.constexpr,
                      VARLEN: gl.constexpr, FLAT: gl.constexpr, RAGGED: gl.constexpr, ROTATE: gl.constexpr,
                      CONSUMERS: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, HEAD_D: gl.constexpr,
                      TREE: gl.constexpr, PINGPONG: gl.constexpr):  # fmt: skip
    """Warpgroup W's rows of each of this program's tiles (its Q tiles come through q_ring). It multiplies only
    the key tiles its rows see (causal, a tile of three warpgroups' rows streams more than its first warpgroup
    needs) and lets the others go by, as it does a whole tile whose rows start past the sequence's end. The
    epilogue stores O straight from registers or, with outputs' o_store = (o_desc, a tile per warpgroup),
    through shared memory and a TMA store that runs on while the next tile starts (a register store writes each
    row's columns in 16-byte pieces, 8 rows per instruction), except where a varlen sequence ends inside the rows.
    shared: what every consumer takes, (outputs, k_ring, v_ring, N, N_K, H, CU_SEQLENS, units, schedule, n_m, qk_scale,
    window_left, sinks), outputs being (O, its (batch, row, head) strides, o_store, lse_out), lse_out (LSE, its batch
    and head strides) or () where no LSE is asked for, sinks (SINKS,) or () for none."""
    outputs, k_ring, v_ring, N, N_K, H, CU_SEQLENS, units, schedule, n_m, qk_scale, window_left, sinks = shared
    O, o_strides, o_store, lse_out = outputs
    BLOCK_M: gl.constexpr = q_ring[0][0].shape[1]
    o_layout: gl.constexpr = mma_layout(D)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    rows_s: gl.constexpr = gl.SliceLayout(1, mma_layout(BLOCK_N))
    turns = ()
    if PINGPONG:  # every warpgroup takes a turn for each K/V tile of a tile, whether it multiplies it or not
        turns = (W, CONSUMERS)
        if W == CONSUMERS - 1:
            _hand_turn(turns)  # warpgroup 0 goes first
    it = 0
    done = 0
    first, count = _program_tiles(schedule, units, CAUSAL)
    e = _entry(schedule, first, 0, count)
    for i in range(count):
        e_next = _entry(schedule, first, i + 1, count)  # a tile ahead: off the tile's start
        valid, r, b, h, m0, n, n_k, bc, seq0, lse0, key0, n_tiles = _forward_tile(
            e, schedule, n_m, N, N_K, H, CU_SEQLENS, window_left, CAUSAL, LEFT, VARLEN, FLAT, CONSUMERS * BLOCK_M,
            BLOCK_N,
        )  # fmt: skip
        if valid:
            first_row = m0 + _block_of(W, r, CONSUMERS, BLOCK_M, BLOCK_N) * BLOCK_M
            own0, n_own = key_tiles(first_row, BLOCK_M, n_k, window_left, CAUSAL, LEFT, BLOCK_N)
            lead = (own0 - key0) // BLOCK_N
            if first_row >= n:
                lead = n_tiles
                n_own = 0
            q_smem = take(q_ring, done)[0]
            _pass(k_ring, v_ring, it, lead, turns)
            if n_own > 0:
                acc, m_i, l_i = _attend(q_smem, q_ring, k_ring, v_ring, done, it + lead, first_row, own0, n_own, n_k,
                                        qk_scale, window_left, turns, CAUSAL, LEFT, RAGGED, ROTATE, BLOCK_N, D,
                                        TREE)  # fmt: skip
                scale = 1.0 / l_i
                if len(sinks) > 0:  # one more logit: into the max and the sum; O's rescale joins the reciprocal
                    sink = gl.load(sinks[0] + h) * LOG2E  # read here: held across the loop it spills at D=256
                    m_new = gl.maximum(m_i, sink)  # every stored row has seen a key: m_i is finite
                    alpha = gl.exp2(m_i - m_new)
                    l_i = l_i * alpha + gl.exp2(sink - m_new)
                    scale = alpha / l_i
                    m_i = m_new
                # times the row's reciprocal: a division per element costs two instructions, not one
                acc = acc * gl.expand_dims(gl.convert_layout(scale, rows_o), 1)
                if len(lse_out) > 0:
                    LSE, stride_lb, stride_lh = lse_out
                    lse = LSE + b * stride_lb + h * stride_lh + lse0 + first_row
                    rows = gl.arange(0, BLOCK_M, rows_s)
                    gl.store(lse + rows, (m_i + _log2(l_i)) * LN2, mask=first_row + rows < n)
                coord = [bc, seq0 + first_row, h, 0]
                if len(o_store) > 0 and not (VARLEN and RAGGED and first_row + BLOCK_M > n):
                    o_desc, o_bufs = o_store
                    o_smem = o_bufs.index(W)
                    piece: gl.constexpr = o_desc.block_type.shape[-1]
                    out = acc.to(o_desc.dtype)
                    if piece == D:
                        stage_out(o_desc, o_smem, out, coord)
                    else:  # two column halves through the one tile
                        lo, hi = halves(out)
                        stage_out(o_desc, o_smem, lo, coord)
                        stage_out(o_desc, o_smem, hi, [bc, seq0 + first_row, h, piece])
                else:
                    store_rows(O, o_strides, coord, acc, n - first_row, HEAD_D)
            else:
                give(q_ring, done)
            _pass(k_ring, v_ring, it + lead + n_own, n_tiles - lead - n_own, turns)
            it += n_tiles
            done += 1
        e = e_next
    if len(o_store) > 0:
        tma.store_wait(0)


@gluon.jit
def attention_forward_sm90_kernel(
    q_desc, k_desc, v_desc, o_desc, O, stride_ob, stride_om, stride_oh, LSE, stride_lb, stride_lh, SINKS, N, N_K, H,
    GROUP, qk_scale, window_left, CU_SEQLENS, units, SCHEDULE, m_bits, h_bits, CAUSAL: gl.constexpr, LEFT: gl.constexpr,
    VARLEN: gl.constexpr, RAGGED: gl.constexpr, CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, D: gl.constexpr, HEAD_D: gl.constexpr, Q_STAGES: gl.constexpr, STAGES: gl.constexpr,
    TREE_ROWS: gl.constexpr, PINGPONG: gl.constexpr, LAST_FIRST: gl.constexpr,
):  # fmt: skip
    """Persistent: program i of P runs the tiles that SCHEDULE lists for it (schedule.py, each entry's batch, head
    and tile in bit fields m_bits and h_bits wide: _forward_tile) or, where SCHEDULE is None, units i, i + P, ... of
    ``units`` (_forward_tile), a tile being CONSUMERS * BLOCK_M query rows of one head (2 or 3 consumer warpgroups
    of BLOCK_M rows each).
    q/k/v_desc: (B, N, H, HEAD_D) tensors (primitives.py), blocks of [1, rows, 1, D] (D >= HEAD_D), or their flat
    (B * N, H, HEAD_D) views, blocks of [rows, 1, D] (all of them, or none): B sequences of N rows (k, v: N_K rows,
    where the caller asks for no mask and sees the flat views only for N_K = N), or with VARLEN one batch row,
    sequence b at rows CU_SEQLENS[b]:CU_SEQLENS[b + 1] (N the longest, N_K unread);
    RAGGED: some sequence, of queries or keys, is not a whole number of tiles. O: the output, (B, N, H, HEAD_D) with
    those strides, stored from registers, or through o_desc (blocks of BLOCK_M rows, D or D / 2 columns) when that
    is not None; LSE: each row's natural-log LSE, or None where the caller needs none; SINKS: (H,) fp32 logits, one
    more per row, or None. Rings of shared memory: Q_STAGES tiles per consumer warpgroup, STAGES K tiles and STAGES
    V tiles. CAUSAL: query i sees keys j <= i, and with LEFT only j >= i - window_left. TREE_ROWS: the softmax's row
    max and sum as trees (_row_max). PINGPONG: the consumers issue their MMAs in turns (_await_turn). LAST_FIRST:
    causal tiles stream their diagonal key tile first where they can (last_first)."""
    FLAT: gl.constexpr = flat_view(q_desc, k_desc, v_desc, o_desc)
    ROTATE: gl.constexpr = last_first(CAUSAL, LEFT, RAGGED, CONSUMERS, BLOCK_M, BLOCK_N, LAST_FIRST)
    k_ring = ring((tiles(k_desc, STAGES),), CONSUMERS)
    v_ring = ring((tiles(v_desc, STAGES),), CONSUMERS)
    q0 = ring((tiles(q_desc, Q_STAGES),), 1)
    q1 = ring((tiles(q_desc, Q_STAGES),), 1)
    n_m = gl.cdiv(N, CONSUMERS * BLOCK_M)
    o_store = ()  # (a worker partition's arguments cannot be None)
    schedule = ()
    if SCHEDULE is not None:
        schedule = (SCHEDULE, m_bits, h_bits)
    if o_desc is not None:
        o_store = (o_desc, tiles(o_desc, CONSUMERS))
    lse_out = ()
    if LSE is not None:
        lse_out = (LSE, stride_lb, stride_lh)
    sinks = ()
    if SINKS is not None:
        sinks = (SINKS,)
    outputs = (O, (stride_ob, stride_om, stride_oh), o_store, lse_out)
    shared = (outputs, k_ring, v_ring, N, N_K, H, CU_SEQLENS, units, schedule, n_m, qk_scale, window_left, sinks)
    if CONSUMERS == 2:
        gl.warp_specialize(
            [
                (_forward_consumer, (shared, q0, 0, CAUSAL, LEFT, VARLEN, FLAT, RAGGED, ROTATE, CONSUMERS, BLOCK_N, D,
                                     HEAD_D, TREE_ROWS, PINGPONG)),
                (_forward_consumer, (shared, q1, 1, CAUSAL, LEFT, VARLEN, FLAT, RAGGED, ROTATE, CONSUMERS, BLOCK_N, D,
                                     HEAD_D, TREE_ROWS, PINGPONG)),
                (_forward_producer, (q_desc, k_desc, v_desc, (q0, q1), k_ring, v_ring, N, N_K, H, GROUP, CU_SEQLENS,
                                     units, schedule, n_m, window_left, CAUSAL, LEFT, VARLEN, ROTATE, BLOCK_M,
                                     BLOCK_N)),
            ],
            [CONSUMER_WARPS, PRODUCER_WARPS],
            [TWO_CONSUMER_REGISTERS, PRODUCER_REGISTERS],
        )  # fmt: skip
    else:
        q2 = ring((tiles(q_desc, Q_STAGES),), 1)
        gl.warp_specialize(
            [
                (_forward_consumer, (shared, q0, 0, CAUSAL, LEFT, VARLEN, FLAT, RAGGED, ROTATE, CONSUMERS, BLOCK_N, D,
                                     HEAD_D, TREE_ROWS, PINGPONG)),
                (_forward_consumer, (shared, q1, 1, CAUSAL, LEFT, VARLEN, FLAT, RAGGED, ROTATE, CONSUMERS, BLOCK_N, D,
                                     HEAD_D, TREE_ROWS, PINGPONG)),
                (_forward_consumer, (shared, q2, 2, CAUSAL, LEFT, VARLEN, FLAT, RAGGED, ROTATE, CONSUMERS, BLOCK_N, D,
                                     HEAD_D, TREE_ROWS, PINGPONG)),
                (_forward_producer, (q_desc, k_desc, v_desc, (q0, q1, q2), k_ring, v_ring, N, N_K, H, GROUP,
                                     CU_SEQLENS, units, schedule, n_m, window_left, CAUSAL, LEFT, VARLEN, ROTATE,
                                     BLOCK_M, BLOCK_N)),
            ],
            [CONSUMER_WARPS, CONSUMER_WARPS, PRODUCER_WARPS],
            [THREE_CONSUMER_REGISTERS, THREE_CONSUMER_REGISTERS, PRODUCER_REGISTERS],
        )  # fmt: skip
