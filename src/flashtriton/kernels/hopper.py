"""Hopper (sm90) kernels in Gluon: warp-specialised forward, dK/dV and dQ for plain dense and causal attention.

The portable Triton kernels (forward.py, backward.py) run one 8-warp program per tile that does its
softmax (or dS) arithmetic between its matrix multiplies, so the tensor cores idle meanwhile
(benchmarks/NOTES.md, ncu). Here a program has three partitions:

  producer   1 warp: streams tiles through TMA into rings of shared-memory slots (``ready[s]`` says a
             slot is full, ``empty[s]`` that every consumer is done with it)
  consumers  2 warpgroups (the forward: 2 or 3) with a tile of their own each, not synchronised with each
             other (except the fused backward's per-step dS exchange and, with the forward's PINGPONG, turns to
             issue MMAs: FlashAttention-3's ping-pong, by named barriers, NOTES 58), so the SM can run one's
             arithmetic beside another's MMAs (wgmma).

Forward: persistent, one program per SM looping over query tiles (causal: those a table from schedule.py
lists for it, so that the programs end about together). The consumers own BLOCK_M query rows
each and stream K/V tiles: S = Q K^T (both from shared memory), P = exp2(S * qk_scale - m), O += P V (P
from registers). S_j is issued with P_{j-1} V_{j-1} and waited for alone, so that the softmax of tile j
could run beside that P V; ptxas places the second wait before the exps all the same (SASS, NOTES 26). K and
V have rings of their own (V_j is read a step after K_j and can do with fewer slots), and each consumer a ring
of Q tiles, so the producer loads the next tile's Q and K/V while the consumers finish the current one.
O goes out through shared memory and a TMA store (at D=256 in two column halves, for want of room), and a causal
tile marked r = 1 (a unit's short tile, or every other tile of a program's table list) hands its row blocks to the
warpgroups in reverse where they see unequal numbers of key tiles.
dK/dV: the consumers own BLOCK_N keys each and stream the (Q, dO) tiles of every query head of their GQA
group, with those rows' LSE and delta (through TMA as well, so the per-step reads are shared-memory loads
issued beside the MMAs): S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q. Fused (the default where
config's fused_span says so), the same kernel also computes dQ += dS K from both consumers' dS^T in shared
memory and adds each step's share into fp32 sums of dQ through TMA reductions (laid out in the accumulator's
fragment order, which a conversion to dQ's dtype undoes): 5 matmuls per tile pair instead of
the pair's 7, in no fixed order of summation. At D=256 a warpgroup has registers for dK and dV of 64 keys x 128
columns only, so the two share their keys and split D (_dkdv_split_consumer): each takes S^T and dP^T for half
of a step's queries and they exchange P^T and dS^T through shared memory.
dQ (deterministic=True, or short spans): laid out as the forward, S = Q K^T, dP = dO V^T, dQ += dS K, with
no atomics, so that backward is bitwise reproducible.

Scope (triton_backend dispatches everything else to the portable kernels): bf16/fp16, head dims with
a config row, no softcap / ALiBi / dropout / block mask / score_mod; no mask, causal, or a causal sliding
window; self-attention (seqlen_q == seqlen_k, or the same cu_seqlens) whose every sequence is a whole
number of the kernels' rows (config's ``rows``); TMA-readable layouts.
"""

import triton
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LN2 = gl.constexpr(0.6931471805599453)
LOG2E = gl.constexpr(1.4426950408889634)


@triton.constexpr_function
def _mma_layout(n):
    """A warpgroup's wgmma accumulator layout for tiles n columns wide (64 rows)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@triton.constexpr_function
def _operand_layout(n):
    """The register layout of a 16-bit A operand whose product is n columns wide (an MMA's P or dS)."""
    return gl.DotOperandLayout(operand_index=0, parent=_mma_layout(n), k_width=2)


@gluon.jit
def _outside_band(first_row, last_row, first_col, last_col, window_left, LEFT: gl.constexpr):
    """Some (row, col) of a tile lies outside the causal band: above the diagonal or, with LEFT, more
    than window_left keys behind its row."""
    out = last_col > first_row
    if LEFT:
        out = out | (last_row - first_col > window_left)
    return out


@gluon.jit
def _in_band(rows, cols, window_left, LEFT: gl.constexpr):
    """The causal band's mask of broadcastable row and column indices (either orientation)."""
    keep = cols <= rows
    if LEFT:
        keep = keep & (cols >= rows - window_left)
    return keep


@gluon.jit
def _band_only(p_t, rows, keys, window_left, LEFT: gl.constexpr):
    """p_t (keys x queries) with its entries outside the causal band zeroed."""
    return gl.where(_in_band(gl.expand_dims(rows, 0), gl.expand_dims(keys, 1), window_left, LEFT), p_t, 0.0)


@gluon.jit
def _sequence(CU_SEQLENS, b, N, VARLEN: gl.constexpr):
    """(first row of sequence b in the (rows, heads * D) views, its length, its first LSE column)."""
    if VARLEN:
        start = gl.load(CU_SEQLENS + b)
        return start, gl.load(CU_SEQLENS + b + 1) - start, start
    else:
        return b * N, N, 0


@gluon.jit
def _query_tile(pid_m, b, n_m, N, CU_SEQLENS, CAUSAL: gl.constexpr, VARLEN: gl.constexpr, ROWS: gl.constexpr):
    """(first query row in the sequence, then _sequence's three) of query tile pid_m of n_m (ROWS rows each) of a head
    of batch b; causal tiles are numbered longest first, so the short ones come last."""
    if CAUSAL:
        pid_m = n_m - 1 - pid_m
    seq0, n, lse0 = _sequence(CU_SEQLENS, b, N, VARLEN)
    return pid_m * ROWS, seq0, n, lse0


@gluon.jit
def _key_tiles(m0, rows, N, window_left, CAUSAL: gl.constexpr, LEFT: gl.constexpr, BLOCK_N: gl.constexpr):
    """(first key, number of BLOCK_N-key tiles) that the query rows [m0, m0 + rows) see."""
    key0 = 0
    n_tiles = N // BLOCK_N
    if LEFT:
        key0 = gl.maximum(m0 - window_left, 0) // BLOCK_N * BLOCK_N
    if CAUSAL:
        n_tiles = gl.cdiv(gl.minimum(m0 + rows, N), BLOCK_N) - key0 // BLOCK_N
    return key0, n_tiles


@gluon.jit
def _tiles(desc, n: gl.constexpr):
    """n shared-memory tiles shaped and laid out as desc's blocks."""
    return gl.allocate_shared_memory(desc.dtype, [n, desc.block_type.shape[0], desc.block_type.shape[1]], desc.layout)


@gluon.jit
def _barriers(n: gl.constexpr, count: gl.constexpr):
    """n mbarriers, each completing a phase after ``count`` arrivals (and any bytes a TMA load was expected
    to bring)."""
    bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(n):
        mbarrier.init(bars.index(i), count=count)
    fence_async_shared()
    return bars


@gluon.jit
def _shared(a_desc, b_desc, STAGES: gl.constexpr):
    """The backward kernels' ring: STAGES shared-memory slots, each for one a_desc and one b_desc tile, with
    barriers ``ready[s]`` (the producer's loads into slot s have landed) and ``empty[s]`` (both consumer
    warpgroups are done with slot s: two arrivals)."""
    return _tiles(a_desc, STAGES), _tiles(b_desc, STAGES), _barriers(STAGES, 1), _barriers(STAGES, 2)


@gluon.jit
def _resident(desc, bar, row, col, n: gl.constexpr):
    """n consecutive tiles of desc (rows ``row`` on, a block each), loaded through TMA onto ``bar``, whose
    expected bytes the caller has set."""
    bufs = _tiles(desc, n)
    for w in gl.static_range(n):
        tma.async_copy_global_to_shared(desc, [row + w * desc.block_type.shape[0], col], bar, bufs.index(w))
    return bufs


@gluon.jit
def _store(desc, value, smem, row, col):
    """value to desc's tile at (row, col) through TMA, staged in smem (a buffer the program no longer reads)."""
    smem.store(value.to(desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc, [row, col], smem)
    tma.store_wait(0)


@gluon.jit
def _stage_out(desc, smem, value, coord):
    """value to desc's tile at coord through smem and a TMA store that runs on (once the previous store from smem has
    read it)."""
    tma.store_wait(0)
    smem.store(value)
    fence_async_shared()
    tma.async_copy_shared_to_global(desc, coord, smem)


@builtin
def _tma_add(desc, coord, src, _semantic=None):
    """desc's tile at coord += src (shared memory), by a TMA reduction (cp.reduce.async.bulk.tensor). Triton 3.6's
    Gluon has the op (ttng.async_tma_reduce) but no wrapper for it; completes as a TMA store (tma.store_wait)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)


@gluon.jit
def _stream(k_desc, v_desc, k_bufs, v_bufs, ready, empty, kv_row, col, n_tiles, it0,
            BLOCK_N: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """Loads n_tiles (K, V) tiles from row kv_row on into the ring, the first at ring position it0."""
    for j in range(n_tiles):
        it = it0 + j
        s = it % STAGES
        # a fresh barrier counts as having completed the phase before its first: the first lap passes
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        bar = ready.index(s)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + j * BLOCK_N, col], bar, k_bufs.index(s))
        tma.async_copy_global_to_shared(v_desc, [kv_row + j * BLOCK_N, col], bar, v_bufs.index(s))


@gluon.jit
def _halves(x):
    """The column halves of a wgmma accumulator tile, while the column's high bit is a register bit of its layout
    (down to 8 columns: the split moves no data)."""
    return gl.split(gl.permute(gl.reshape(x, [x.shape[0], 2, x.shape[1] // 2]), (0, 2, 1)))


@gluon.jit
def _row_max(x, TREE: gl.constexpr):
    """gl.max(x, 1), or with TREE over column halves first: Triton reduces a thread's elements of a row in one chain
    of dependent instructions (31 for a row of 128 columns); halving the tile first makes it a tree (NOTES 51)."""
    rows: gl.constexpr = gl.SliceLayout(1, x.type.layout)
    for _ in gl.static_range(x.shape[1].bit_length() - 4 if TREE else 0):
        lo, hi = _halves(x)
        x = gl.maximum(lo, hi)
    return gl.convert_layout(gl.max(x, 1), rows)  # the same rows: no data moves


@gluon.jit
def _row_sum(x, TREE: gl.constexpr):
    """gl.sum(x, 1), as _row_max."""
    rows: gl.constexpr = gl.SliceLayout(1, x.type.layout)
    for _ in gl.static_range(x.shape[1].bit_length() - 4 if TREE else 0):
        lo, hi = _halves(x)
        x = lo + hi
    return gl.convert_layout(gl.sum(x, 1), rows)


@gluon.jit
def _online_softmax(scores, m_i, l_i, rows, first_row, first_col, qk_scale, window_left, CAUSAL: gl.constexpr,
                    LEFT: gl.constexpr, BLOCK_N: gl.constexpr, TREE: gl.constexpr):  # fmt: skip
    """One key tile of the online softmax: (P in log2 units against the new max, new max, new sum, the
    factor alpha that rescales what was accumulated against the old max). TREE: the row reductions as trees."""
    if CAUSAL:
        last_row = first_row + scores.shape[0] - 1
        if _outside_band(first_row, last_row, first_col, first_col + BLOCK_N - 1, window_left, LEFT):
            cols = first_col + gl.arange(0, BLOCK_N, gl.SliceLayout(0, scores.type.layout))
            keep = _in_band(gl.expand_dims(rows, 1), gl.expand_dims(cols, 0), window_left, LEFT)
            scores = gl.where(keep, scores, float("-inf"))
    m_new = gl.maximum(m_i, _row_max(scores, TREE) * qk_scale)  # the scaled max: validation makes qk_scale > 0
    m_use = m_new
    if LEFT:  # a row may have seen no key yet: its window starts past this tile
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(scores * qk_scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    return p, m_new, l_i * alpha + _row_sum(p, TREE), alpha


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
def _forward_tile(e, schedule, n_m, N, H, CU_SEQLENS, window_left, CAUSAL: gl.constexpr, LEFT: gl.constexpr,
                  VARLEN: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    """A program's tile e (_entry): (whether it has rows, r, batch, head, first query row in the sequence, the
    sequence's length, its first row, its first LSE column, then _key_tiles' two). r = 1 marks a tile whose
    warpgroups take their row blocks in reverse (_block_of). Without a table, unit e // (1 + CAUSAL) of the
    program is one query tile; causal, the p-th longest and the p-th shortest query tiles of a head (r = 0, 1;
    one tile in the middle of an odd count), so that every unit has about the same work. With one, schedule =
    (table, m_bits, h_bits) and e is ((((b << h_bits) | h) << m_bits | p) << 1) | r, p counting a head's tiles longest
    first (schedule.py; triton_backend._fields)."""
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
    else:  # bit fields, not a runtime division's dependent chain at every tile's start (NOTES 57)
        _, m_bits, h_bits = schedule
        pid_m = (e >> 1) & ((1 << m_bits) - 1)
        b = e >> (1 + m_bits + h_bits)
        h = (e >> (1 + m_bits)) & ((1 << h_bits) - 1)
        r = e & 1
        is_tile = True  # every entry of the table is one
    m0, seq0, n, lse0 = _query_tile(pid_m, b, n_m, N, CU_SEQLENS, CAUSAL, VARLEN, ROWS)
    key0, n_tiles = _key_tiles(m0, ROWS, n, window_left, CAUSAL, LEFT, BLOCK_N)
    valid = (m0 < n) & is_tile  # m0 < n: not past a shorter varlen sequence
    return valid, r, b, h, m0, n, seq0, lse0, key0, n_tiles


@gluon.jit
def _block_of(w, r, consumers: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Which BLOCK_M rows of a tile warpgroup w takes: the w-th or, where a causal tile's warpgroups see different
    numbers of key tiles (the last the most), in a tile marked r = 1 (_forward_tile) the w-th from the end, so that
    over a unit or a program's list every warpgroup sees about as many."""
    if consumers * BLOCK_M > BLOCK_N:
        return w + r * (consumers - 1 - 2 * w)
    return w


@gluon.jit
def _fill(desc, coord, ring, i):
    """Loads desc's tile at coord into position i of ring = (tiles, ready, empty), once its consumers have
    released what the position held a lap before (a fresh barrier counts as having completed the phase before
    its first, so the first lap passes)."""
    bufs, ready, empty = ring
    n: gl.constexpr = bufs.shape[0]
    s = i % n
    mbarrier.wait(empty.index(s), ((i // n) & 1) ^ 1)
    mbarrier.expect(ready.index(s), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, coord, ready.index(s), bufs.index(s))


@gluon.jit
def _take(ring, i):
    """Position i's tile of ring = (tiles, ready, empty), once it has landed."""
    bufs, ready, _ = ring
    n: gl.constexpr = bufs.shape[0]
    mbarrier.wait(ready.index(i % n), (i // n) & 1)
    return bufs.index(i % n)


@gluon.jit
def _give(ring, i):
    """This consumer is done with position i of ring."""
    empty = ring[2]
    mbarrier.arrive(empty.index(i % empty.shape[0]), count=1)


@gluon.jit
def _ring(bufs, consumers: gl.constexpr):
    """(tiles, ready, empty): the tiles bufs as a ring that ``consumers`` warpgroups read."""
    return bufs, _barriers(bufs.shape[0], 1), _barriers(bufs.shape[0], consumers)


@gluon.jit
def _forward_producer(q_desc, k_desc, v_desc, q_rings, k_ring, v_ring, N, H, GROUP, CU_SEQLENS, units, schedule,
                      n_m, window_left, CAUSAL: gl.constexpr, LEFT: gl.constexpr, VARLEN: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr):  # fmt: skip
    """For each of this program's tiles: each warpgroup's Q tile (into that warpgroup's ring of Q tiles; rows
    past a sequence's end too, which that warpgroup skips), then the tile's K and V tiles into their rings, K_j
    with V_{j-1} (the consumers read V_j a step after K_j)."""
    it = 0
    done = 0
    first, count = _program_tiles(schedule, units, CAUSAL)
    for i in range(count):
        valid, r, _, h, m0, _, seq0, _, key0, n_tiles = _forward_tile(
            _entry(schedule, first, i, count), schedule, n_m, N, H, CU_SEQLENS, window_left, CAUSAL, LEFT, VARLEN,
            len(q_rings) * BLOCK_M, BLOCK_N,
        )  # fmt: skip
        if valid:
            for w in gl.static_range(len(q_rings)):
                row = seq0 + m0 + _block_of(w, r, len(q_rings), BLOCK_M, BLOCK_N) * BLOCK_M
                _fill(q_desc, [row, h * D], q_rings[w], done)
            kv_row = seq0 + key0
            col = (h // GROUP) * D
            _fill(k_desc, [kv_row, col], k_ring, it)
            for j in range(1, n_tiles):
                _fill(k_desc, [kv_row + j * BLOCK_N, col], k_ring, it + j)
                _fill(v_desc, [kv_row + (j - 1) * BLOCK_N, col], v_ring, it + j - 1)
            _fill(v_desc, [kv_row + (n_tiles - 1) * BLOCK_N, col], v_ring, it + n_tiles - 1)
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
        _take(k_ring, it + j)
        _give(k_ring, it + j)
        _take(v_ring, it + j)
        _give(v_ring, it + j)


@gluon.jit
def _attend(q_smem, q_ring, k_ring, v_ring, q_at, it, first_row, key0, n_tiles, qk_scale, window_left, turns,
            CAUSAL: gl.constexpr, LEFT: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
            TREE: gl.constexpr):  # fmt: skip
    """One warpgroup's query rows (Q in q_smem, position q_at of q_ring) against n_tiles (K, V) tiles from
    position it of their rings on: (O unnormalised, row max, row sum). Tile j's S = Q K_j^T is issued together
    with tile j-1's O += P V_{j-1}, and the softmax of S_j comes between the waits for the two (which ptxas
    moves to before the exps: benchmarks/NOTES.md 26). K_j goes back once S_j is done, V_j once P V_j is, and
    Q once every S is, before the last P V. With turns (_await_turn), the first S and each step's S and P V are
    issued in the warpgroup's turn, so that the warpgroups' softmaxes run beside each other's MMAs
    (FlashAttention-3's ping-pong); the last P V, as there, in none."""
    BLOCK_M: gl.constexpr = q_smem.shape[0]
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(D)
    p_layout: gl.constexpr = _operand_layout(D)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_smem.dtype

    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    rows = first_row + gl.arange(0, BLOCK_M, rows_s)
    k = _take(k_ring, it)
    _await_turn(turns)
    scores = warpgroup_mma(q_smem, k.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    _hand_turn(turns)
    scores = warpgroup_mma_wait(0, deps=(scores, q_smem, k))[0]
    _give(k_ring, it)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, rows_s)
    p, m_i, l_i, alpha = _online_softmax(scores, m_i, gl.zeros([BLOCK_M], gl.float32, rows_s), rows, first_row, key0,
                                         qk_scale, window_left, CAUSAL, LEFT, BLOCK_N, TREE)  # fmt: skip
    p = gl.convert_layout(p.to(dtype), p_layout)
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    for j in range(1, n_tiles):
        k = _take(k_ring, it + j)
        _await_turn(turns)
        scores = warpgroup_mma(q_smem, k.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        v = _take(v_ring, it + j - 1)
        acc = warpgroup_mma(p, v, acc, is_async=True)
        _hand_turn(turns)
        scores = warpgroup_mma_wait(1, deps=(scores, q_smem, k))[0]  # S_j done; P V_{j-1} may still run
        _give(k_ring, it + j)
        p_next, m_i, l_i, alpha = _online_softmax(
            scores, m_i, l_i, rows, first_row, key0 + j * BLOCK_N, qk_scale, window_left, CAUSAL, LEFT, BLOCK_N, TREE
        )
        acc = warpgroup_mma_wait(0, deps=(acc, p, v))[0]
        _give(v_ring, it + j - 1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p = gl.convert_layout(p_next.to(dtype), p_layout)
    _give(q_ring, q_at)
    v = _take(v_ring, it + n_tiles - 1)
    acc = warpgroup_mma(p, v, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, v))[0]
    _give(v_ring, it + n_tiles - 1)
    return acc, m_i, l_i


@gluon.jit
def _forward_consumer(shared, q_ring, W: gl.constexpr, CAUSAL: gl.constexpr, LEFT: gl.constexpr,
                      VARLEN: gl.constexpr, CONSUMERS: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                      TREE: gl.constexpr, PINGPONG: gl.constexpr):  # fmt: skip
    """Warpgroup W's rows of each of this program's tiles (its Q tiles come through q_ring). It multiplies only
    the key tiles its rows see (causal, a tile of three warpgroups' rows streams more than its first warpgroup
    needs) and lets the others go by, as it does a whole tile whose rows start past the sequence's end. The
    epilogue stores O straight from registers or, with outputs' o_store = (o_desc, a tile per warpgroup),
    through shared memory and a TMA store that runs on while the next tile starts (a register store writes each
    row's columns in 16-byte pieces, 8 rows per instruction: about 1.5 us per tile at D=128, NOTES 34).
    shared: what every consumer takes, (outputs, k_ring, v_ring, N, H, CU_SEQLENS, units, schedule, n_m, qk_scale,
    window_left), outputs being (O, its row stride, o_store, lse_out), lse_out (LSE, its batch and head strides)
    or () where no LSE is asked for."""
    outputs, k_ring, v_ring, N, H, CU_SEQLENS, units, schedule, n_m, qk_scale, window_left = shared
    O, stride_o, o_store, lse_out = outputs
    BLOCK_M: gl.constexpr = q_ring[0].shape[1]
    o_layout: gl.constexpr = _mma_layout(D)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    rows_s: gl.constexpr = gl.SliceLayout(1, _mma_layout(BLOCK_N))
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
        e_next = _entry(schedule, first, i + 1, count)  # a tile ahead: off the tile's start (not measured alone)
        valid, r, b, h, m0, n, seq0, lse0, key0, n_tiles = _forward_tile(
            e, schedule, n_m, N, H, CU_SEQLENS, window_left, CAUSAL, LEFT, VARLEN, CONSUMERS * BLOCK_M, BLOCK_N
        )
        if valid:
            first_row = m0 + _block_of(W, r, CONSUMERS, BLOCK_M, BLOCK_N) * BLOCK_M
            own0, n_own = _key_tiles(first_row, BLOCK_M, n, window_left, CAUSAL, LEFT, BLOCK_N)
            lead = (own0 - key0) // BLOCK_N
            if first_row >= n:
                lead = n_tiles
                n_own = 0
            q_smem = _take(q_ring, done)
            _pass(k_ring, v_ring, it, lead, turns)
            if n_own > 0:
                acc, m_i, l_i = _attend(q_smem, q_ring, k_ring, v_ring, done, it + lead, first_row, own0, n_own,
                                        qk_scale, window_left, turns, CAUSAL, LEFT, BLOCK_N, D, TREE)  # fmt: skip
                # times the row's reciprocal: a division per element costs two instructions, not one
                acc = acc * gl.expand_dims(gl.convert_layout(1.0 / l_i, rows_o), 1)
                if len(lse_out) > 0:
                    LSE, stride_lb, stride_lh = lse_out
                    lse = LSE + b * stride_lb + h * stride_lh + lse0 + first_row
                    gl.store(lse + gl.arange(0, BLOCK_M, rows_s), (m_i + gl.log2(l_i)) * LN2)
                if len(o_store) > 0:
                    o_desc, o_bufs = o_store
                    o_smem = o_bufs.index(W)
                    piece: gl.constexpr = o_desc.block_type.shape[1]
                    out = acc.to(o_desc.dtype)
                    if piece == D:
                        _stage_out(o_desc, o_smem, out, [seq0 + first_row, h * D])
                    else:  # two column halves through the one tile (register bits: the split moves no data)
                        lo, hi = gl.split(gl.permute(gl.reshape(out, [BLOCK_M, 2, piece]), (0, 2, 1)))
                        _stage_out(o_desc, o_smem, lo, [seq0 + first_row, h * D])
                        _stage_out(o_desc, o_smem, hi, [seq0 + first_row, h * D + piece])
                else:
                    out = O + (seq0 + first_row).to(gl.int64) * stride_o + h * D
                    out += gl.expand_dims(gl.arange(0, BLOCK_M, rows_o), 1) * stride_o
                    cols = gl.arange(0, D, gl.SliceLayout(0, o_layout))
                    gl.store(out + gl.expand_dims(cols, 0), acc.to(q_smem.dtype))
            else:
                _give(q_ring, done)
            _pass(k_ring, v_ring, it + lead + n_own, n_tiles - lead - n_own, turns)
            it += n_tiles
            done += 1
        e = e_next
    if len(o_store) > 0:
        tma.store_wait(0)


@gluon.jit
def attention_forward_sm90_kernel(
    q_desc, k_desc, v_desc, o_desc, O, stride_o, LSE, stride_lb, stride_lh, N, H, GROUP, qk_scale, window_left,
    CU_SEQLENS, units, SCHEDULE, m_bits, h_bits, CAUSAL: gl.constexpr, LEFT: gl.constexpr, VARLEN: gl.constexpr,
    CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, Q_STAGES: gl.constexpr,
    STAGES: gl.constexpr, TREE_ROWS: gl.constexpr, PINGPONG: gl.constexpr,
):  # fmt: skip
    """Persistent: program i of P runs the tiles that SCHEDULE lists for it (schedule.py, each entry's batch, head
    and tile in bit fields m_bits and h_bits wide: _forward_tile) or, where SCHEDULE is None, units i, i + P, ... of
    ``units`` (_forward_tile), a tile being CONSUMERS * BLOCK_M query rows of one head (2 or 3 consumer warpgroups
    of BLOCK_M rows each).
    q/k/v_desc: (rows, heads * D) views, blocks of [rows, D]: B sequences of N rows, or with VARLEN sequence b
    at rows CU_SEQLENS[b]:CU_SEQLENS[b + 1] (N the longest), each a whole number of BLOCK_M and of BLOCK_N
    rows; O: the output, rows stride_o apart in that view, stored from registers, or through o_desc (the same
    view, blocks of [BLOCK_M, D]) when that is not None; LSE: each row's natural-log LSE, or None where the caller
    needs none. Rings of shared memory: Q_STAGES tiles per consumer warpgroup, STAGES K tiles and STAGES V tiles.
    CAUSAL: query i sees keys j <= i, and with LEFT only j >= i - window_left. TREE_ROWS: the softmax's row max and
    sum as trees (_row_max). PINGPONG: the consumers issue their MMAs in turns (_await_turn)."""
    k_ring = _ring(_tiles(k_desc, STAGES), CONSUMERS)
    v_ring = _ring(_tiles(v_desc, STAGES), CONSUMERS)
    q0 = _ring(_tiles(q_desc, Q_STAGES), 1)
    q1 = _ring(_tiles(q_desc, Q_STAGES), 1)
    n_m = gl.cdiv(N, CONSUMERS * BLOCK_M)
    o_store = ()  # (a worker partition's arguments cannot be None)
    schedule = ()
    if SCHEDULE is not None:
        schedule = (SCHEDULE, m_bits, h_bits)
    if o_desc is not None:
        o_store = (o_desc, _tiles(o_desc, CONSUMERS))
    lse_out = ()
    if LSE is not None:
        lse_out = (LSE, stride_lb, stride_lh)
    outputs = (O, stride_o, o_store, lse_out)
    shared = (outputs, k_ring, v_ring, N, H, CU_SEQLENS, units, schedule, n_m, qk_scale, window_left)
    # 64K registers per SM: 232 per thread for each of two consumer warpgroups, 160 for three
    if CONSUMERS == 2:
        gl.warp_specialize(
            [
                (_forward_consumer, (shared, q0, 0, CAUSAL, LEFT, VARLEN, CONSUMERS, BLOCK_N, D, TREE_ROWS, PINGPONG)),
                (_forward_consumer, (shared, q1, 1, CAUSAL, LEFT, VARLEN, CONSUMERS, BLOCK_N, D, TREE_ROWS, PINGPONG)),
                (_forward_producer, (q_desc, k_desc, v_desc, (q0, q1), k_ring, v_ring, N, H, GROUP, CU_SEQLENS, units,
                                     schedule, n_m, window_left, CAUSAL, LEFT, VARLEN, BLOCK_M, BLOCK_N, D)),
            ],
            [4, 1],
            [232, 24],
        )  # fmt: skip
    else:
        q2 = _ring(_tiles(q_desc, Q_STAGES), 1)
        gl.warp_specialize(
            [
                (_forward_consumer, (shared, q0, 0, CAUSAL, LEFT, VARLEN, CONSUMERS, BLOCK_N, D, TREE_ROWS, PINGPONG)),
                (_forward_consumer, (shared, q1, 1, CAUSAL, LEFT, VARLEN, CONSUMERS, BLOCK_N, D, TREE_ROWS, PINGPONG)),
                (_forward_consumer, (shared, q2, 2, CAUSAL, LEFT, VARLEN, CONSUMERS, BLOCK_N, D, TREE_ROWS, PINGPONG)),
                (_forward_producer, (q_desc, k_desc, v_desc, (q0, q1, q2), k_ring, v_ring, N, H, GROUP, CU_SEQLENS,
                                     units, schedule, n_m, window_left, CAUSAL, LEFT, VARLEN, BLOCK_M, BLOCK_N, D)),
            ],
            [4, 4, 1],
            [160, 160, 24],
        )  # fmt: skip


@gluon.jit
def _dkdv_producer(q_desc, do_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty,
                   q_row, first_col, lse_row, stride_lh, n_steps, GROUP, BLOCK_M: gl.constexpr, D: gl.constexpr,
                   STAGES: gl.constexpr):  # fmt: skip
    """Streams (Q, dO, LSE, delta) tiles n_steps per query head of the GQA group, from query row q_row (LSE
    entry lse_row) on."""
    nbytes: gl.constexpr = (
        q_desc.block_type.nbytes + do_desc.block_type.nbytes + lse_desc.block_type.nbytes + delta_desc.block_type.nbytes
    )
    for g in range(GROUP):
        for j in range(n_steps):
            it = g * n_steps + j
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(q_desc, [q_row + j * BLOCK_M, first_col + g * D], bar, q_bufs.index(s))
            tma.async_copy_global_to_shared(do_desc, [q_row + j * BLOCK_M, first_col + g * D], bar, do_bufs.index(s))
            row = lse_row + g * stride_lh + j * BLOCK_M
            tma.async_copy_global_to_shared(lse_desc, [row], bar, lse_bufs.index(s))
            tma.async_copy_global_to_shared(delta_desc, [row], bar, delta_bufs.index(s))


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
    """A warpgroup's [64, n] wgmma accumulator (_mma_layout(n)) relabelled, with no data movement, as [64 * n / COLS,
    COLS] in fragment order: the value at (row 16w + 8h + r, column 8j + 2c + e), for (w, h, r, j, c, e) in
    (4, 2, 8, n / 8, 4, 2), at flat position ((w * n / 8 + j) * 32 + 4r + c) * 4 + 2h + e. A thread's four values of
    a column group (rows r, r + 8, columns 2c, 2c + 1) lie side by side, so the tile stores to an unswizzled buffer in
    16-byte pieces, a warp's 512 contiguous bytes at a time (no bank conflicts; NOTES 67-68)."""
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
    _tma_add(dq_desc, [coord[0] // dq.shape[0] * dq_smem.shape[0], coord[1] // dq.shape[1] * COLS], dq_smem)


@gluon.jit
def _piece_add(desc, coord, value, smem):
    """desc's tile at coord += value, by a TMA reduction staged in smem (a tile nothing else reads or writes until
    the caller's tma.store_wait)."""
    smem.store(value)
    fence_async_shared()
    _tma_add(desc, coord, smem)


@gluon.jit
def _dkdv_consumer(dk_desc, dv_desc, dq_sums, k_bufs, v_bufs, q_bufs, do_bufs, lse_bufs, delta_bufs, kv_bar, ready,
                   empty, kv_row, kv_col, n0, first_query, q_row, q_col, n_steps, GROUP, qk_scale, softmax_scale,
                   window_left, W: gl.constexpr, FUSED: gl.constexpr, DQ_LATE: gl.constexpr,
                   READ_AHEAD: gl.constexpr, CAUSAL: gl.constexpr, LEFT: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """Warpgroup W's BLOCK_N keys (rows kv_row + W * BLOCK_N on; n0 + W * BLOCK_N on in the sequence): for
    each streamed query tile, S^T = K Q^T and dP^T = V dO^T (both from shared memory), then dV += P^T dO and
    dK += dS^T Q with P^T and dS^T from registers.

    FUSED, with dq_sums = (dq_desc, ds_bufs, ds_ready, dq_bufs): also dQ += dS K for the tile, added into
    dq_desc's fp32 rows by TMA reductions. Both warpgroups put their dS^T in shared memory (ds_bufs: [parity]
    [warpgroup]; step i's go to parity (i + 1) % 2 and complete ds_ready's phase i + 1, a phase 0 of both
    warpgroups' arrivals before the first step), and warpgroup W multiplies the dS of all 2 * BLOCK_N keys
    into the W-th half of dQ's columns, staged in dq_bufs[W]. DQ_LATE: that multiply is issued a step late,
    beside the next step's S^T and dP^T, so that a warpgroup does not wait on the other's dS while its tensor
    cores could work (phase 0 then brings zeros for step 0 to multiply)."""
    s_layout: gl.constexpr = _mma_layout(BLOCK_M)
    o_layout: gl.constexpr = _mma_layout(D)
    a_layout: gl.constexpr = _operand_layout(D)
    queries: gl.constexpr = gl.SliceLayout(0, s_layout)
    half: gl.constexpr = D // 2
    LATE: gl.constexpr = FUSED and DQ_LATE
    DQ_GROUPS: gl.constexpr = 2 if LATE else 0  # the late dQ's wgmma groups, in flight beside a step's own
    k_smem = k_bufs.index(W)
    v_smem = v_bufs.index(W)
    first_key = n0 + W * BLOCK_N
    dtype: gl.constexpr = k_smem.dtype

    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    zero_q = gl.zeros([BLOCK_M, half], gl.float32, _mma_layout(half))
    dk = gl.zeros([BLOCK_N, D], gl.float32, o_layout)
    dv = gl.zeros([BLOCK_N, D], gl.float32, o_layout)
    keys = first_key + gl.arange(0, BLOCK_N, gl.SliceLayout(1, s_layout))
    dq_at = [q_row, q_col + W * half]  # LATE: where the dQ in flight goes (step 0's zeros: anywhere)
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
            s = it % STAGES
            q0 = first_query + j * BLOCK_M
            rows = q0 + gl.arange(0, BLOCK_M, queries)
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            q = q_bufs.index(s)
            do = do_bufs.index(s)
            if READ_AHEAD:  # before the wgmmas, whose operand reads would queue these loads behind them (NOTES 40)
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
                if FUSED or _outside_band(q0, q0 + BLOCK_M - 1, first_key, first_key + BLOCK_N - 1, window_left, LEFT):
                    p_t = _band_only(p_t, rows, keys, window_left, LEFT)
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
                dq_at = [q_row + j * BLOCK_M, q_col + g * D + W * half]
                dk, dv = warpgroup_mma_wait(0, deps=(dk, dv, q, do))[:2]
            elif FUSED:
                fence_async_shared()
                mbarrier.arrive(ds_ready.index((it + 1) % 2), count=1)
                dq, ds0, ds1 = _dq_issue(dq_sums, k_bufs, it + 1, zero_q, W)
                dk, dv, dq = warpgroup_mma_wait(0, deps=(dk, dv, dq, q, do, ds0, ds1))[:3]
                _dq_add(dq_sums, dq, [q_row + j * BLOCK_M, q_col + g * D + W * half], softmax_scale, W)
            else:
                dk, dv = warpgroup_mma_wait(0, deps=(dk, dv, q, do))[:2]
            mbarrier.arrive(empty.index(s), count=1)

    steps = n_steps * GROUP
    if LATE:  # the last step's dQ
        dq, ds0, ds1 = _dq_issue(dq_sums, k_bufs, steps, zero_q, W)
        _dq_add(dq_sums, warpgroup_mma_wait(0, deps=(dq, ds0, ds1))[0], dq_at, softmax_scale, W)
    # K and V are no longer read (the other warpgroup's dQ too is done with this K): their buffers stage dK
    # and dV for the TMA stores
    if FUSED:
        mbarrier.arrive(ds_ready.index((steps + 1) % 2), count=1)
        mbarrier.wait(ds_ready.index((steps + 1) % 2), ((steps + 1) // 2) & 1)
    _store(dk_desc, dk * softmax_scale, k_smem, kv_row + W * BLOCK_N, kv_col)
    _store(dv_desc, dv, v_smem, kv_row + W * BLOCK_N, kv_col)


@gluon.jit
def _exchange(bars, it):
    """This warpgroup's stores for step it are in shared memory (fenced for the tensor cores); waits until the
    other's are too: phase it // 2 of bars[it % 2], two arrivals."""
    fence_async_shared()
    bar = bars.index(it % 2)
    mbarrier.arrive(bar, count=1)
    mbarrier.wait(bar, (it // 2) & 1)


@gluon.jit
def _dkdv_split_consumer(dk_desc, dv_desc, dq_desc, k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, pt_bufs,
                         dst_bufs, p_ready, ds_ready, kv_bar, ready, empty, kv_row, kv_col, first_key, first_query,
                         q_row, q_col, n_steps, GROUP, qk_scale, softmax_scale, window_left, W: gl.constexpr,
                         CAUSAL: gl.constexpr, LEFT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         D: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
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
    s_layout: gl.constexpr = _mma_layout(QH)
    o_layout: gl.constexpr = _mma_layout(DH)
    queries: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = k_smem.dtype
    # the (Q, dO) slots as [slot, column half] tiles of dQ's fp32 pieces
    pieces: gl.constexpr = [STAGES * 2, BLOCK_M, DH // 2]
    do_pieces = do_bufs._reinterpret(gl.float32, pieces, dq_desc.layout)
    q_pieces = q_bufs._reinterpret(gl.float32, pieces, dq_desc.layout)

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
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            q = q_bufs.index(s)
            do = do_bufs.index(s)
            lse2 = lse_bufs.index(s).slice(W * QH, QH).load(queries) * LOG2E
            delta = delta_bufs.index(s).slice(W * QH, QH).load(queries)
            s_t = warpgroup_mma(k_smem, q.slice(W * QH, QH).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dp_t = warpgroup_mma(v_smem, do.slice(W * QH, QH).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s_t = warpgroup_mma_wait(1, deps=(s_t, k_smem, q))[0]
            if it > 0:  # the step before's reductions have long read its slot: it goes back (NOTES 50)
                tma.store_wait(0)
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
            p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse2, 0))
            if CAUSAL:  # every step: a branch here could make ptxas serialise the wgmmas (C7512)
                rows = first_query + j * BLOCK_M + W * QH + gl.arange(0, QH, queries)
                p_t = _band_only(p_t, rows, keys, window_left, LEFT)
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
            lo, hi = gl.split(gl.permute(gl.reshape(dq * softmax_scale, [BLOCK_M, 2, DH // 2]), (0, 2, 1)))
            at = q_row + j * BLOCK_M
            col = q_col + g * D + W * DH
            _piece_add(dq_desc, [at, col], lo, do_pieces.index(2 * s + W))  # this dV is done with those columns
            dk = warpgroup_mma_wait(0, deps=(dk, q))[0]
            _piece_add(dq_desc, [at, col + DH // 2], hi, q_pieces.index(2 * s + W))  # and this dK

    # (the last step's slot is not needed again.) Once the other warpgroup too is done with K and V, their tiles stage
    # this one's dK and dV columns
    _exchange(p_ready, GROUP * n_steps)
    _store(dk_desc, dk * softmax_scale, k_cols, kv_row, kv_col + W * DH)
    _store(dv_desc, dv, v_smem.slice(W * DH, DH, dim=1), kv_row, kv_col + W * DH)


@gluon.jit
def attention_backward_dkdv_sm90_kernel(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, lse_desc, delta_desc, stride_lb, stride_lh, N, H,
    GROUP, qk_scale, softmax_scale, window_left, CU_SEQLENS, order_heads,
    CAUSAL: gl.constexpr, LEFT: gl.constexpr, VARLEN: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    D: gl.constexpr, STAGES: gl.constexpr, DQ_LATE: gl.constexpr, READ_AHEAD: gl.constexpr, SPLIT_D: gl.constexpr,
):  # fmt: skip
    """Grid (N / KEYS * B * HKV,): dK, dV of KEYS keys of one K/V head, two consumer warpgroups and a producer warp
    streaming the (Q, dO, LSE, delta) tiles of the GQA group; lse/delta_desc: LSE and DELTA as flat vectors, in
    blocks of BLOCK_M entries. The warpgroups take BLOCK_N keys each (KEYS = 2 * BLOCK_N) or, SPLIT_D, the same
    KEYS = BLOCK_N keys and half of D's columns each (_dkdv_split_consumer). k/v_desc: blocks of BLOCK_N x D;
    dk/dv_desc: of BLOCK_N x D, or D / 2 when SPLIT_D. dq_desc: None, or the fp32 sums to which these keys' dQ
    shares are added (TMA reductions): laid out as _dq_add says, or, SPLIT_D, (B * N, H * D) rows in blocks of
    BLOCK_M x D / 4."""
    KEYS: gl.constexpr = BLOCK_N if SPLIT_D else 2 * BLOCK_N
    # programs in groups of order_heads K/V heads, each group's key blocks in order: its first blocks (causal: the
    # longest) before the next
    n_blocks = gl.cdiv(N, KEYS)
    pid = gl.program_id(0)
    group0 = pid // (order_heads * n_blocks) * order_heads
    in_group = gl.minimum(order_heads, gl.num_programs(0) // n_blocks - group0)
    pid_n = (pid - group0 * n_blocks) // in_group
    pid_bh = group0 + (pid - group0 * n_blocks) % in_group
    hkv = H // GROUP
    b = pid_bh // hkv
    hk = pid_bh % hkv
    n0 = pid_n * KEYS
    seq0, N, lse0 = _sequence(CU_SEQLENS, b, N, VARLEN)
    if VARLEN:
        if n0 >= N:
            return
    kv_row = seq0 + n0
    kv_col = hk * D

    q_bufs, do_bufs, ready, empty = _shared(q_desc, do_desc, STAGES)
    kv_bar = _barriers(1, 1).index(0)  # the resident K and V tiles have landed
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], lse_desc.layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], delta_desc.layout)
    mbarrier.expect(kv_bar, KEYS // BLOCK_N * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    k_bufs = _resident(k_desc, kv_bar, kv_row, kv_col, KEYS // BLOCK_N)
    v_bufs = _resident(v_desc, kv_bar, kv_row, kv_col, KEYS // BLOCK_N)
    FUSED: gl.constexpr = dq_desc is not None
    dq_sums = ()  # (a worker partition's arguments cannot be None)
    if FUSED and not SPLIT_D:  # dQ's target; dS^T tiles [step parity][warpgroup]; their barriers; staging tiles
        ds_bufs = gl.allocate_shared_memory(q_desc.dtype, [4, BLOCK_N, BLOCK_M], q_desc.layout)
        dq_sums = (dq_desc, ds_bufs, _barriers(2, 2), _tiles(dq_desc, 2))

    first_query = 0
    last_query = N
    if CAUSAL:  # queries before the first key see none of these keys
        first_query = n0
    if LEFT:  # nor do queries more than window_left after the last
        last_query = gl.minimum(gl.cdiv(n0 + KEYS + window_left, BLOCK_M) * BLOCK_M, N)
    n_steps = (last_query - first_query) // BLOCK_M
    h0 = hk * GROUP
    lse_row = b * stride_lb + h0 * stride_lh + lse0 + first_query  # of LSE and DELTA, as flat vectors
    q_row = seq0 + first_query
    # the producer's arguments
    streams = (q_desc, do_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, q_row,
               h0 * D, lse_row, stride_lh, n_steps, GROUP, BLOCK_M, D, STAGES)  # fmt: skip
    if SPLIT_D:
        # P^T and dS^T tiles [step parity], each warpgroup's queries side by side; a barrier pair for each
        pt_bufs = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_N, BLOCK_M], q_desc.layout)
        dst_bufs = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_N, BLOCK_M], q_desc.layout)
        p_ready = _barriers(2, 2)
        ds_ready = _barriers(2, 2)
        gl.warp_specialize(
            [
                (_dkdv_split_consumer, (dk_desc, dv_desc, dq_desc, k_bufs.index(0), v_bufs.index(0), q_bufs,
                                        do_bufs, lse_bufs, delta_bufs, pt_bufs, dst_bufs, p_ready, ds_ready, kv_bar,
                                        ready, empty, kv_row, kv_col, n0, first_query, q_row, h0 * D, n_steps,
                                        GROUP, qk_scale, softmax_scale, window_left, 0, CAUSAL, LEFT, BLOCK_M,
                                        BLOCK_N, D, STAGES)),
                (_dkdv_split_consumer, (dk_desc, dv_desc, dq_desc, k_bufs.index(0), v_bufs.index(0), q_bufs,
                                        do_bufs, lse_bufs, delta_bufs, pt_bufs, dst_bufs, p_ready, ds_ready, kv_bar,
                                        ready, empty, kv_row, kv_col, n0, first_query, q_row, h0 * D, n_steps,
                                        GROUP, qk_scale, softmax_scale, window_left, 1, CAUSAL, LEFT, BLOCK_M,
                                        BLOCK_N, D, STAGES)),
                (_dkdv_producer, streams),
            ],
            [4, 1],
            [232, 24],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (_dkdv_consumer, (dk_desc, dv_desc, dq_sums, k_bufs, v_bufs, q_bufs, do_bufs, lse_bufs, delta_bufs,
                                  kv_bar, ready, empty, kv_row, kv_col, n0, first_query, q_row, h0 * D, n_steps,
                                  GROUP, qk_scale, softmax_scale, window_left, 0, FUSED, DQ_LATE, READ_AHEAD, CAUSAL,
                                  LEFT, BLOCK_M, BLOCK_N, D, STAGES)),
                (_dkdv_consumer, (dk_desc, dv_desc, dq_sums, k_bufs, v_bufs, q_bufs, do_bufs, lse_bufs, delta_bufs,
                                  kv_bar, ready, empty, kv_row, kv_col, n0, first_query, q_row, h0 * D, n_steps,
                                  GROUP, qk_scale, softmax_scale, window_left, 1, FUSED, DQ_LATE, READ_AHEAD, CAUSAL,
                                  LEFT, BLOCK_M, BLOCK_N, D, STAGES)),
                (_dkdv_producer, streams),
            ],
            [4, 1],
            [232, 24],
        )  # fmt: skip


@gluon.jit
def _dq_consumer(dq_desc, q_smem, do_smem, k_bufs, v_bufs, q_bar, ready, empty, lse_ptr, delta_ptr, o_ptr,
                 dlse_ptr, stride_o, out_row, col, first_row, key0, n_tiles, qk_scale, softmax_scale, window_left,
                 CAUSAL: gl.constexpr, LEFT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 D: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """One warpgroup's BLOCK_M query rows: first delta = rowsum(dO * O) - dLSE (the portable path's
    preprocess kernel; stored for the dK/dV kernel), then for each streamed key tile S = Q K^T and
    dP = dO V^T (from shared memory), and dQ += dS K with dS from registers."""
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(D)
    a_layout: gl.constexpr = _operand_layout(D)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_smem.dtype

    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    dq = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    rows = first_row + gl.arange(0, BLOCK_M, rows_s)
    lse2 = gl.expand_dims(gl.load(lse_ptr + gl.arange(0, BLOCK_M, rows_s)) * LOG2E, 1)
    tile: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    offsets = gl.expand_dims(gl.arange(0, BLOCK_M, gl.SliceLayout(1, tile)), 1) * stride_o
    o = gl.load(o_ptr + offsets + gl.expand_dims(gl.arange(0, D, gl.SliceLayout(0, tile)), 0)).to(gl.float32)
    mbarrier.wait(q_bar, 0)
    delta = gl.convert_layout(gl.sum(o * do_smem.load(tile).to(gl.float32), 1), rows_s)
    delta = delta - gl.load(dlse_ptr + gl.arange(0, BLOCK_M, rows_s))
    gl.store(delta_ptr + gl.arange(0, BLOCK_M, rows_s), delta)
    delta = gl.expand_dims(delta, 1)
    for j in range(n_tiles):
        s = j % STAGES
        mbarrier.wait(ready.index(s), (j // STAGES) & 1)
        k = k_bufs.index(s)
        v = v_bufs.index(s)
        scores = warpgroup_mma(q_smem, k.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_smem, v.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        scores = warpgroup_mma_wait(1, deps=(scores, q_smem, k))[0]
        p = gl.exp2(scores * qk_scale - lse2)
        if CAUSAL:
            first_col = key0 + j * BLOCK_N
            if _outside_band(first_row, first_row + BLOCK_M - 1, first_col, first_col + BLOCK_N - 1, window_left, LEFT):
                cols = first_col + gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
                p = gl.where(_in_band(gl.expand_dims(rows, 1), gl.expand_dims(cols, 0), window_left, LEFT), p, 0.0)
        dp = warpgroup_mma_wait(0, deps=(dp, do_smem, v))[0]
        ds = gl.convert_layout((p * (dp - delta)).to(dtype), a_layout)
        dq = warpgroup_mma(ds, k, dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq, k))[0]
        mbarrier.arrive(empty.index(s), count=1)

    _store(dq_desc, dq * softmax_scale, q_smem, out_row, col)


@gluon.jit
def attention_backward_dq_sm90_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_desc, LSE, DELTA, O, DLSE, stride_o, stride_lb, stride_lh, N, H, GROUP,
    qk_scale, softmax_scale, window_left, CU_SEQLENS,
    CAUSAL: gl.constexpr, LEFT: gl.constexpr, VARLEN: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    D: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """Grid (N / (2 * BLOCK_M), B * H): dQ (and delta) of 2 * BLOCK_M query rows, laid out as the forward's
    program; O: the forward's output, rows stride_o apart in the (rows, heads * D) view."""
    b = gl.program_id(1) // H
    h = gl.program_id(1) % H
    m0, seq0, N, lse0 = _query_tile(gl.program_id(0), b, gl.num_programs(0), N, CU_SEQLENS, CAUSAL, VARLEN, 2 * BLOCK_M)
    if m0 >= N:  # past the end of a shorter varlen sequence
        return
    q_col = h * D
    q_row = seq0 + m0

    k_bufs, v_bufs, ready, empty = _shared(k_desc, v_desc, STAGES)
    q_bar = _barriers(1, 1).index(0)  # the resident Q and dO tiles have landed
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes)
    q_bufs = _resident(q_desc, q_bar, q_row, q_col, 2)
    do_bufs = _resident(do_desc, q_bar, q_row, q_col, 2)

    key0, n_tiles = _key_tiles(m0, 2 * BLOCK_M, N, window_left, CAUSAL, LEFT, BLOCK_N)
    row = b * stride_lb + h * stride_lh + lse0 + m0  # of LSE, DLSE and DELTA
    o = O + q_row.to(gl.int64) * stride_o + q_col
    gl.warp_specialize(
        [
            (_dq_consumer, (dq_desc, q_bufs.index(0), do_bufs.index(0), k_bufs, v_bufs, q_bar, ready, empty,
                            LSE + row, DELTA + row, o, DLSE + row, stride_o, q_row, q_col, m0, key0, n_tiles,
                            qk_scale, softmax_scale, window_left, CAUSAL, LEFT, BLOCK_M, BLOCK_N, D, STAGES)),
            (_dq_consumer, (dq_desc, q_bufs.index(1), do_bufs.index(1), k_bufs, v_bufs, q_bar, ready, empty,
                            LSE + row + BLOCK_M, DELTA + row + BLOCK_M, o + BLOCK_M * stride_o,
                            DLSE + row + BLOCK_M, stride_o, q_row + BLOCK_M, q_col, m0 + BLOCK_M, key0, n_tiles,
                            qk_scale, softmax_scale, window_left, CAUSAL, LEFT, BLOCK_M, BLOCK_N, D, STAGES)),
            (_stream, (k_desc, v_desc, k_bufs, v_bufs, ready, empty, seq0 + key0, (h // GROUP) * D, n_tiles, 0,
                       BLOCK_N, STAGES)),
        ],
        [4, 1],
        [232, 24],
    )  # fmt: skip
