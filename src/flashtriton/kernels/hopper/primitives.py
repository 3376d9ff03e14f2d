"""What the Gluon kernels share: layouts, the causal band, sequence and tile bounds, barriers, rings of
shared-memory slots and TMA stores.

A (B, N, H, HEAD_D) tensor is read and written through a rank-4 TMA descriptor of its own strides (any whose last
is 1, the rest 16-byte multiples), in blocks of [1, rows, 1, cols]: coordinates [b, row, head, col], ``b`` the batch
(0 for a varlen batch, whose sequences lie along the rows). TMA fills rows past the tensor's N with zeros and drops
stores to them, so a dense sequence may end inside a tile; it does the same with columns past HEAD_D, so a head dim
between the kernels' widths D (64, 128, 256) runs at the next. A block lands in a [rows, cols] shared-memory tile of
the same swizzle (flat_layout): the bytes are the same. Where every batch's rows follow the last's in whole tiles,
the launcher may pass the flat view instead (config.FLAT_VIEW_BANDED): a rank-3 (B * N, H, HEAD_D) descriptor in
blocks of [rows, 1, cols], batch b's rows from b * N on (sequence), its coordinates [row, head, col] (box).

A ring is (tiles, ready, empty): ``tiles`` a tuple of shared-memory arrays of as many slots each, slot s holding
tile s of each; ``ready[s]`` completes a phase when the producer's loads into slot s have landed, ``empty[s]`` when
every consumer warpgroup has released it. Position i of a ring is slot i % slots of lap i // slots: the producer
``fill``s positions in order, each consumer ``take``s and ``give``s them back in the same order.
"""

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .. import config

LN2 = gl.constexpr(0.6931471805599453)  # ln(2): converts a base-2 LSE to natural log
LOG2E = gl.constexpr(1.4426950408889634)  # 1 / ln(2): exp(x) == exp2(x * LOG2E)

# The partitions' warps and registers per thread (config.py says why)
CONSUMER_WARPS = gl.constexpr(config.HOPPER_NUM_WARPS)
PRODUCER_WARPS = gl.constexpr(config.HOPPER_PRODUCER_WARPS)
PRODUCER_REGISTERS = gl.constexpr(config.HOPPER_PRODUCER_REGISTERS)
TWO_CONSUMER_REGISTERS = gl.constexpr(config.HOPPER_CONSUMER_REGISTERS[2])
THREE_CONSUMER_REGISTERS = gl.constexpr(config.HOPPER_CONSUMER_REGISTERS[3])
ROWS_ALIGN = gl.constexpr(config.LSE_ROWS_ALIGN)


@triton.constexpr_function
def mma_layout(n):
    """A warpgroup's wgmma accumulator layout for tiles n columns wide (64 rows)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@triton.constexpr_function
def operand_layout(n):
    """The register layout of a 16-bit A operand whose product is n columns wide (an MMA's P or dS)."""
    return gl.DotOperandLayout(operand_index=0, parent=mma_layout(n), k_width=2)


@triton.constexpr_function
def flat_layout(desc):
    """The [rows, cols] shared-memory layout of a descriptor's blocks, whose leading dims are 1."""
    layout = desc.layout
    if len(desc.block_type.shape) == 2:
        return layout
    return gl.NVMMASharedLayout(swizzle_byte_width=layout.swizzle_byte_width, element_bitwidth=layout.element_bitwidth,
                                rank=2)  # fmt: skip


@triton.constexpr_function
def block_rows(desc):
    """A descriptor's rows per block (its [1, rows, 1, cols], [rows, 1, cols] or [rows, cols] blocks)."""
    return desc.block_type.shape[-3] if len(desc.block_type.shape) == 4 else desc.block_type.shape[0]


@triton.constexpr_function
def slot_bytes(descs):
    """Bytes that one block of each of descs brings: what a ring slot's ready barrier expects."""
    return sum(desc.block_type.nbytes for desc in descs)


@gluon.jit
def outside_band(first_row, last_row, first_col, last_col, window_left, LEFT: gl.constexpr):
    """Some (row, col) of a tile lies outside the causal band: above the diagonal or, with LEFT, more
    than window_left keys behind its row."""
    out = last_col > first_row
    if LEFT:
        out = out | (last_row - first_col > window_left)
    return out


@gluon.jit
def in_band(rows, cols, window_left, LEFT: gl.constexpr):
    """The causal band's mask of broadcastable row and column indices (either orientation)."""
    keep = cols <= rows
    if LEFT:
        keep = keep & (cols >= rows - window_left)
    return keep


@gluon.jit
def keys_past(x, first_col, n, fill):
    """x (queries x keys, keys from first_col on) with the columns of keys at or past n set to fill."""
    cols = first_col + gl.arange(0, x.shape[1], gl.SliceLayout(0, x.type.layout))
    return gl.where(gl.expand_dims(cols < n, 0), x, fill)


@gluon.jit
def keys_before(x, first_col, n, fill):
    """keys_past where the tile reaches past n (a sequence that ends inside its last key tile), x elsewhere."""
    if first_col + x.shape[1] > n:
        x = keys_past(x, first_col, n, fill)
    return x


@gluon.jit
def band_tile(x, rows, first_col, window_left, fill, LEFT: gl.constexpr):
    """x (queries x keys, keys from first_col on) with its entries outside the causal band set to fill."""
    cols = first_col + gl.arange(0, x.shape[1], gl.SliceLayout(0, x.type.layout))
    return gl.where(in_band(gl.expand_dims(rows, 1), gl.expand_dims(cols, 0), window_left, LEFT), x, fill)


@gluon.jit
def band_only(p_t, rows, keys, window_left, LEFT: gl.constexpr):
    """p_t (keys x queries) with its entries outside the causal band zeroed."""
    return gl.where(in_band(gl.expand_dims(rows, 0), gl.expand_dims(keys, 1), window_left, LEFT), p_t, 0.0)


@gluon.jit
def sequence(CU_SEQLENS, b, N, VARLEN: gl.constexpr, FLAT: gl.constexpr):
    """(sequence b's batch coordinate and first row in the descriptors, its length, its first LSE column). FLAT: the
    descriptors see the batch as one sequence of B * N rows (flat_view), sequence b from row b * N."""
    if VARLEN:
        start = gl.load(CU_SEQLENS + b)
        return b * 0, start, gl.load(CU_SEQLENS + b + 1) - start, start  # b * 0: a tensor, as dense's b
    elif FLAT:
        return b * 0, b * N, N, 0
    else:
        return b, 0, N, 0


@triton.constexpr_function
def flat_view(*descs):
    """Whether descs (None aside) are flat (B * N, H, D) descriptors (blocks [rows, 1, cols]) rather than (B, N, H, D)
    ones: all of them or none, as a kernel addresses them all with one coordinate."""
    ranks = {len(desc.block_type.shape) for desc in descs if desc is not None}
    assert len(ranks) == 1, f"flat and (B, N, H, D) descriptors in one launch: ranks {sorted(ranks)}"
    return ranks == {3}


@gluon.jit
def box(desc, coord):
    """A coordinate [batch, row, head, col] as desc takes it: a flat view's has no batch (sequence() made it 0)."""
    if flat_view(desc):
        return [coord[1], coord[2], coord[3]]
    else:
        return coord


@gluon.jit
def head_program():
    """Which (batch, head) of a grid (tiles, Y, Z) this program computes (kernels/common.py's head_program)."""
    return gl.program_id(1) + gl.program_id(2) * gl.num_programs(1)


@gluon.jit
def rows_start(CU_SEQLENS, b, VARLEN: gl.constexpr):
    """Where sequence b's entries start in the backward's aligned LSE and delta rows (config.LSE_ROWS_ALIGN)."""
    if VARLEN:
        return (gl.cdiv(gl.load(CU_SEQLENS + b), ROWS_ALIGN) + b) * ROWS_ALIGN
    else:
        return 0


@gluon.jit
def keys_of(n, N_K, VARLEN: gl.constexpr):
    """The keys' length beside a sequence of n queries: varlen, n (queries and keys share cu_seqlens); dense, N_K (a
    cross-attention's own, else N)."""
    if VARLEN:
        return n
    else:
        return N_K


@gluon.jit
def query_tile(
    pid_m, b, n_m, N, CU_SEQLENS, CAUSAL: gl.constexpr, VARLEN: gl.constexpr, FLAT: gl.constexpr, ROWS: gl.constexpr
):
    """(first query row in the sequence, then sequence's four) of query tile pid_m of n_m (ROWS rows each) of a head
    of batch b; causal tiles are numbered longest first, so the short ones come last."""
    if CAUSAL:
        pid_m = n_m - 1 - pid_m
    bc, seq0, n, lse0 = sequence(CU_SEQLENS, b, N, VARLEN, FLAT)
    return pid_m * ROWS, bc, seq0, n, lse0


@gluon.jit
def key_tiles(m0, rows, N, window_left, CAUSAL: gl.constexpr, LEFT: gl.constexpr, BLOCK_N: gl.constexpr):
    """(first key, number of BLOCK_N-key tiles) that the query rows [m0, m0 + rows) see."""
    key0 = 0
    n_tiles = gl.cdiv(N, BLOCK_N)
    if LEFT:
        key0 = gl.maximum(m0 - window_left, 0) // BLOCK_N * BLOCK_N
    if CAUSAL:
        n_tiles = gl.cdiv(gl.minimum(m0 + rows, N), BLOCK_N) - key0 // BLOCK_N
    return key0, n_tiles


@triton.constexpr_function
def last_first(causal, left, ragged, consumers, block_m, block_n, asked):
    """Whether a tile's K/V stream starts with its last key tile (step_tile): the one tile whose keys the
    consumers mask, so that only their first step, outside their loop, has a mask's branch (inside it, taken or
    not, such a branch slows the loop: benchmarks/DECISIONS.md, "Users' shapes"). So for a sequence
    without a band that may end inside its last key tile (keys past the end), and, where the caller asks for it
    (asked: the forward's config.HopperForwardConfig.last_first; the dQ kernel always), for a causal tile (no window)
    whose ``consumers`` warpgroups of block_m rows all end in one key tile, their diagonal's. Either way every
    warpgroup that multiplies the tile takes all of its key tiles (the forward's _forward_consumer: own0 is key0 and
    n_own n_tiles), so that producer and consumers agree on the order."""
    causal_tile = causal and not left and consumers * block_m == block_n
    return (ragged and not causal) or (asked and causal_tile)


@gluon.jit
def step_tile(j, n_tiles, ROTATE: gl.constexpr):
    """The key tile (counted from the tile's first) that step j of a K/V stream carries: tile j, or, with ROTATE,
    the last tile first (the one that needs a mask: last_first) and then the others in order."""
    if ROTATE:
        return (j + n_tiles - 1) % n_tiles
    else:
        return j


@gluon.jit
def tiles(desc, n: gl.constexpr):
    """n shared-memory tiles shaped and laid out as desc's blocks ([rows, cols] each)."""
    return gl.allocate_shared_memory(desc.dtype, [n, block_rows(desc), desc.block_type.shape[-1]], flat_layout(desc))


@gluon.jit
def barriers(n: gl.constexpr, count: gl.constexpr):
    """n mbarriers, each completing a phase after ``count`` arrivals (and any bytes a TMA load was expected
    to bring)."""
    bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(n):
        mbarrier.init(bars.index(i), count=count)
    fence_async_shared()
    return bars


@gluon.jit
def ring(slots, consumers: gl.constexpr):
    """The tuple of shared-memory arrays ``slots`` as a ring (tiles, ready, empty) that ``consumers`` warpgroups
    read."""
    n: gl.constexpr = slots[0].shape[0]
    return slots, barriers(n, 1), barriers(n, consumers)


@gluon.jit
def fill(descs, coords, ring, i):
    """Loads each of descs' tiles at its coord into position i of ring, once its consumers have released what the
    slot held a lap before (a fresh barrier counts as having completed the phase before its first, so the first lap
    passes)."""
    bufs, ready, empty = ring
    n: gl.constexpr = bufs[0].shape[0]
    s = i % n
    mbarrier.wait(empty.index(s), ((i // n) & 1) ^ 1)
    bar = ready.index(s)
    mbarrier.expect(bar, slot_bytes(descs))
    for t in gl.static_range(len(descs)):
        tma.async_copy_global_to_shared(descs[t], box(descs[t], coords[t]), bar, bufs[t].index(s))


@gluon.jit
def take(ring, i):
    """Position i's tiles of ring (a tuple, one of each array), once they have landed."""
    bufs, ready, _ = ring
    n: gl.constexpr = bufs[0].shape[0]
    mbarrier.wait(ready.index(i % n), (i // n) & 1)
    return [buf.index(i % n) for buf in bufs]


@gluon.jit
def give(ring, i):
    """This consumer is done with position i of ring."""
    empty = ring[2]
    mbarrier.arrive(empty.index(i % empty.shape[0]), count=1)


@gluon.jit
def at(coord, row):
    """A rank-4 coordinate [b, row, head, col] moved ``row`` rows on."""
    return [coord[0], coord[1] + row, coord[2], coord[3]]


@gluon.jit
def resident(desc, bar, coord, n: gl.constexpr):
    """n consecutive tiles of desc (rows from coord's on, a block each), loaded through TMA onto ``bar``, whose
    expected bytes the caller has set."""
    bufs = tiles(desc, n)
    for w in gl.static_range(n):
        tma.async_copy_global_to_shared(desc, box(desc, at(coord, w * block_rows(desc))), bar, bufs.index(w))
    return bufs


@triton.constexpr_function
def _scalars_layout(warps):
    """Every thread of ``warps`` warps holding the whole of a 4-vector."""
    return gl.BlockedLayout(size_per_thread=[4], threads_per_warp=[32], warps_per_cta=[warps], order=[0])


@gluon.jit
def park(a, b, c, warps: gl.constexpr):
    """Three int32 scalars in shared memory for the partitions to read at their ends (unpark) instead of holding them
    in registers through their loops; stored by the kernel's ``warps`` warps before the partitions start."""
    layout: gl.constexpr = _scalars_layout(warps)
    i = gl.arange(0, 4, layout)
    vector = gl.where(i == 0, a, gl.where(i == 1, b, c))
    smem = gl.allocate_shared_memory(gl.int32, [4], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    smem.store(vector)
    return smem


@gluon.jit
def unpark(smem, warps: gl.constexpr):
    """park's three scalars, read by a partition of ``warps`` warps."""
    layout: gl.constexpr = _scalars_layout(warps)
    i = gl.arange(0, 4, layout)
    vector = smem.load(layout)
    return (
        gl.sum(gl.where(i == 0, vector, 0), axis=0),
        gl.sum(gl.where(i == 1, vector, 0), axis=0),
        gl.sum(gl.where(i == 2, vector, 0), axis=0),
    )


@gluon.jit
def store(desc, value, smem, coord):
    """value to desc's tile at coord through TMA, staged in smem (a buffer the program no longer reads)."""
    smem.store(value.to(desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc, box(desc, coord), smem)
    tma.store_wait(0)


@gluon.jit
def store_rows(ptr, strides, coord, value, n_rows, HEAD_D: gl.constexpr):
    """value ([rows, cols], a wgmma accumulator's layout) to the (B, N, H, HEAD_D) tensor at ptr with strides
    (batch, row, head), at coord, its first n_rows rows only: where a TMA store would write past a varlen sequence's
    end; and its columns before HEAD_D only, as a TMA store drops those of a tile wider than the tensor."""
    layout: gl.constexpr = value.type.layout
    rows = gl.arange(0, value.shape[0], gl.SliceLayout(1, layout))
    cols = gl.arange(0, value.shape[1], gl.SliceLayout(0, layout))
    base = ptr + coord[0].to(gl.int64) * strides[0] + coord[1].to(gl.int64) * strides[1]
    base += coord[2].to(gl.int64) * strides[2]  # a model's (B, H, N, D) storage: heads N * D apart
    offsets = gl.expand_dims(rows.to(gl.int64), 1) * strides[1] + gl.expand_dims(coord[3] + cols, 0)
    mask = gl.expand_dims(rows < n_rows, 1)
    # pieces are at least half a tile and HEAD_D more than half of it: none lies wholly past HEAD_D
    if HEAD_D % value.shape[1] != 0:
        mask = mask & gl.expand_dims(coord[3] + cols < HEAD_D, 0)
    gl.store(base + offsets, value.to(ptr.dtype.element_ty), mask=mask)


@gluon.jit
def stage_out(desc, smem, value, coord):
    """value to desc's tile at coord through smem and a TMA store that runs on (once the previous store from smem has
    read it)."""
    tma.store_wait(0)
    smem.store(value)
    fence_async_shared()
    tma.async_copy_shared_to_global(desc, box(desc, coord), smem)


@gluon.jit
def halves(x):
    """The column halves of a wgmma accumulator tile, while the column's high bit is a register bit of its layout
    (down to 8 columns: the split moves no data)."""
    return gl.split(gl.permute(gl.reshape(x, [x.shape[0], 2, x.shape[1] // 2]), (0, 2, 1)))
