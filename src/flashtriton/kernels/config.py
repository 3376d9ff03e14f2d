"""Launch parameters for every kernel, in one table.

A config is looked up by (arch, head-dim bucket, dtype) and the length of its loops: the forward
by ``span``, about how many keys a query row sees (short bands, e.g. a window of 1k or 2k-token
causal documents, prefer smaller tiles: more programs per SM hide each one's start and end), the
backward by the same span, ``windowed`` (the band has a left bound), ``causal``, ``varlen`` and
``sparse`` (a BlockMask, whose span is its mean listed keys).
``tma``: the streamed tiles come through the copy engine (tensor descriptors) where the layout allows.
``arch`` is ``"sm90"`` for Hopper, ``"cuda"`` for any other CUDA GPU, and ``"interpreter"`` for
Triton's CPU interpreter, where tiles are small so that tiny test shapes still span several tiles
and reach every boundary path.
The sm90 rows won sweeps on H100 and H200 GPUs (benchmarks/DECISIONS.md keeps the measurements); each row's
comment says why it won. Banded and unbanded spans may take different rows (the Gluon forward's short
band, the portable D=128 backward's _SM90_CAUSAL_BACKWARD). The table for other CUDA GPUs is an
unmeasured starting point that only fits shared memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

# Smallest tile edge tl.dot accepts.
MIN_BLOCK = 16


@dataclass(frozen=True)
class ForwardConfig:
    block_m: int  # query rows per program
    block_n: int  # key rows per inner step
    num_warps: int
    num_stages: int
    # pipeline depth of a band's edge loops (a few masked tiles each); None: num_stages
    edge_stages: int | None = None
    tma: bool = False  # whole K/V tiles through the copy engine (sm90+) instead of pointer loads
    # per-thread register cap (Triton's maxnreg) for kernels without score modifiers or dropout (``plain``):
    # two 8-warp programs per SM need <= 128
    max_registers: int | None = None


@dataclass(frozen=True)
class BackwardConfig:
    # dK/dV kernel: a program owns block_n_kv keys and streams queries block_m_kv at a time.
    block_m_kv: int
    block_n_kv: int
    # dQ kernel: a program owns block_m_q queries and streams keys block_n_q at a time.
    block_m_q: int
    block_n_q: int
    num_warps: int
    stages_kv: int  # software-pipeline depth of the dK/dV kernel
    stages_q: int  # and of the dQ kernel
    edge_stages: int | None = None  # as ForwardConfig's, in both kernels
    tma: bool = False  # as ForwardConfig's: streamed Q/dO (dK/dV) and K/V (dQ) tiles
    warps_q: int | None = None  # the dQ kernel's num_warps (None: num_warps)


# The Gluon kernels' partitions (kernels/hopper/). Every kernel launches with num_warps = HOPPER_NUM_WARPS, its
# default partition being one consumer warpgroup (wgmma's 4 warps); the other consumer warpgroups and the producer
# warp, which only issues TMA loads, are worker partitions. Registers per thread of each worker (setmaxnreg), out of
# the SM's 64K: 232 for each of two consumer warpgroups, 160 for each of three.
HOPPER_NUM_WARPS = 4
HOPPER_PRODUCER_WARPS = 1
HOPPER_PRODUCER_REGISTERS = 24
HOPPER_CONSUMER_REGISTERS = {2: 232, 3: 160}  # by the kernel's consumer warpgroups


@dataclass(frozen=True)
class HopperForwardConfig:
    """The Gluon sm90 forward (kernels/hopper/forward.py)."""

    block_m: int  # query rows per consumer warpgroup
    block_n: int  # keys per K/V tile
    stages: int  # K/V tiles in flight (slots of the shared-memory rings: the forward's K ring and its V ring)
    stage_o: bool = False  # the forward's O through shared memory and a TMA store (consumers * block_m * D more of it)
    consumers: int = 2  # the forward's consumer warpgroups (2 or 3; the backward's dQ kernel has two)
    q_stages: int = 1  # the forward's Q tiles per consumer warpgroup (2: the next tile's Q loads a tile ahead)
    o_pieces: int = 1  # stage_o: O goes out in this many column pieces (1 or 2) through a tile as much narrower
    tree_rows: bool = False  # the forward's row max and sum as trees of column halves, not chains
    pingpong: bool = False  # the forward's consumers issue their MMAs in turns (named barriers, FA3's ping-pong)
    # causal: each tile streams its diagonal key tile first, where all its warpgroups' rows end in that one tile, so
    # that the consumers' loop has no mask (kernels/hopper/primitives.py, last_first; a dense sequence that ends
    # inside a tile always streams its last tile first; under a window's left bound the kernel ignores it)
    last_first: bool = False

    @property
    def rows(self) -> int:
        """Sequences of whole multiples of this many rows (a warpgroup's, a K/V tile's) need no RAGGED masks."""
        return math.lcm(self.block_m, self.block_n)


@dataclass(frozen=True)
class HopperBackwardConfig:
    """The Gluon sm90 backward: one dK/dV kernel that also adds up dQ (fp32 TMA reductions), or, deterministic,
    the dQ kernel (which also computes delta) and the dK/dV kernel after it."""

    dq: HopperForwardConfig | None  # the deterministic dQ kernel's tiles, laid out as the forward's; None: no such
    # kernel (deterministic and short spans run the portable kernels)
    block_m: int  # dK/dV: query rows per streamed step
    block_n: int  # dK/dV: keys per consumer warpgroup; a program has two (split_d: both take the same keys)
    stages: int  # dK/dV: (Q, dO) tiles in flight; fused, its dS and dQ tiles take 64 KB more (D=128: 3 fit; 2 win)
    fused_span: int  # the fused kernel from this span on (triton_backend._span; varlen: the longest sequence's)
    dq_late: bool = False  # fused: a step's dQ multiply is issued beside the next step's S^T and dP^T
    read_ahead: bool = False  # dK/dV: a step's LSE and delta are read before its wgmmas are issued (more registers)
    split_d: bool = False  # fused only: each consumer warpgroup takes half of D's columns (P^T, dS^T shared)
    order_programs: int = 0  # causal dK/dV: programs in groups of whole K/V heads, about this many programs (at
    # most ORDER_HEADS heads), each group's longest key blocks first; 0: one head at a time
    # dK/dV without a band: the worker consumer warpgroup's registers (setmaxnreg; the default one gets the rest)
    unbanded_registers: int = HOPPER_CONSUMER_REGISTERS[2]

    def dkdv_registers(self, banded: bool) -> int:
        """The dK/dV kernel's worker consumer warpgroup's registers: banded calls keep the two-consumer budget."""
        return HOPPER_CONSUMER_REGISTERS[2] if banded else self.unbanded_registers

    @property
    def keys(self) -> int:
        """Keys per dK/dV program."""
        return self.block_n if self.split_d else 2 * self.block_n

    @property
    def rows(self) -> int:
        """Sequences of whole multiples of this many rows (both kernels' programs and tiles) need no RAGGED masks."""
        rows = math.lcm(self.block_m, self.keys)
        return rows if self.dq is None else math.lcm(rows, 2 * self.dq.block_m, self.dq.block_n)


# The most K/V heads in one group of order_programs.
ORDER_HEADS = 16

# Calls without a band whose batches' rows follow one another in whole tiles (contiguous (B, N, H, D), say) reach the
# Gluon kernels as one sequence of B * N rows, through rank-3 (B * N, H, D) descriptors (triton_backend._flat): faster
# than rank-4 (B, N, H, D) ones there; causal calls ran slower with them (benchmarks/DECISIONS.md, "flat view").
FLAT_VIEW_BANDED = False

# Rows of the preprocessing kernel (delta = rowsum(dO * O)) per program.
PREPROCESS_BLOCK_M = 64

# The Gluon dK/dV kernel reads LSE and delta through TMA, whose boxes must start 16-byte aligned: its backward keeps
# them in rows of whole LSE_ROWS_ALIGN-entry tiles (a varlen sequence b's from LSE_ROWS_ALIGN * (cdiv(cu[b],
# LSE_ROWS_ALIGN) + b) on), written by the pass that computes delta.
LSE_ROWS_ALIGN = 64

# Columns per program of the dQ conversion from row-major fp32 sums (D=256's split kernel): half the registers of a
# [64, 128] tile, for a memory-bound kernel that wants occupancy (benchmarks/DECISIONS.md).
DQ_CONVERT_COLS = 64

# fp32 values per row of the fused Hopper backward's dQ reductions in fragment order (hopper/dkdv.py's _fragments),
# through an unswizzled tile: 1 KB rows beat 128-byte swizzled ones on causal spans, at some cost at D=128 dense
DQ_FRAGMENT_COLS = 256

_INTERPRETER_FORWARD = ForwardConfig(block_m=16, block_n=16, num_warps=1, num_stages=1, tma=True)
_INTERPRETER_BACKWARD = BackwardConfig(16, 16, 16, 16, num_warps=1, stages_kv=1, stages_q=1, tma=True)

# (max head dim, forward, backward) for 2-byte dtypes; the first row whose head dim fits wins. Triton 3.6's ptxas
# crashes (SIGSEGV) on some TMA kernels whose loops differ in pipeline depth by one (main 3 / edges 2, or main 2 /
# ragged tile 1): TMA rows keep edge_stages None or 1 below 3 stages. The dQ kernel with 128 x 32 tiles at 4 warps and
# 2 TMA stages made illegal shared-memory accesses on an H100 at D=128: no row takes that combination.
_SM90_TABLE: tuple[tuple[int, ForwardConfig, BackwardConfig], ...] = (
    (
        64,
        # pointer loads: TMA was level for this forward; two 8-warp programs per SM under the 128-register cap
        ForwardConfig(128, 64, 8, 3, max_registers=128),
        # TMA beat pointer loads; dQ at 128-row tiles and 8 warps, the dK/dV kernel at 4
        BackwardConfig(64, 64, 128, 64, 4, 2, 3, tma=True, warps_q=8),
    ),
    (
        128,
        # TMA: K/V tiles through the copy engine beat pointer loads, forward and backward
        ForwardConfig(128, 128, 8, 3, tma=True),
        BackwardConfig(64, 128, 128, 64, 8, 3, 3, edge_stages=1, tma=True),
    ),
    (
        256,
        # TMA: D=256's pointer loads spilled, forward and backward
        ForwardConfig(128, 64, 8, 2, edge_stages=1, tma=True),
        # dQ at 4 warps: a fifth faster here (D=128's and the short bands' dQ lose at 4)
        BackwardConfig(64, 64, 64, 64, 8, 2, 2, 1, tma=True, warps_q=4),
    ),
)
# sm90 backwards of causal-like bands (right bound only), by head dim. D=128: 64 keys per dK/dV program at 4 warps
# (dQ at 8) beat both the dense row's TMA tiles and pointer loads with 2-stage edges.
_SM90_CAUSAL_BACKWARD = {128: BackwardConfig(32, 64, 128, 64, 4, 3, 3, tma=True, warps_q=8)}
# sm90 forwards for spans up to SHORT_SPAN keys, by head dim: smaller tiles, so that more programs per SM hide each
# one's start and end (measured at D=128: faster for a causal window of 1024, 2k-token documents and N=512, slower
# for dense N=2k; the threshold lies between).
SHORT_SPAN = 1536
_SM90_SHORT_FORWARD = {128: ForwardConfig(64, 64, 4, 3, tma=True)}
# sm90 backwards for short spans of windowed, varlen or sparse bands (the kernel variants that spill most): dK/dV
# streams 32 query rows per step, which dense short sequences and long spans lose with.
_SM90_SHORT_BACKWARD = {128: BackwardConfig(32, 128, 128, 64, 8, 2, 3, tma=True)}

# A head dim between the Gluon tables' widths (64, 128, 256) runs at the next (hopper_width), over the tensors' own D:
# TMA zero-fills the columns past it on loads and drops them on stores.
HOPPER_MIN_HEAD_DIM = 32  # at or below it the portable kernels are faster (DECISIONS: "Head dims between")

# The Gluon forward on sm90 (kernels/hopper/forward.py), by width: faster than the portable kernel at every span.
# O goes out through shared memory and a TMA store (stage_o) at every head dim.
_SM90_HOPPER_FORWARD = {
    # three K/V slots, the staged O and a second Q tile per warpgroup (the next tile's Q loads a tile ahead) all fit
    64: HopperForwardConfig(64, 128, 3, stage_o=True, q_stages=2),
    # two K and two V slots: a third K slot's room holds the staged O and a second Q tile per warpgroup, which gain more
    128: HopperForwardConfig(64, 128, 2, stage_o=True, q_stages=2),
    # 64-key tiles; two K/V slots leave room to stage O in column halves only; MMAs in turns (pingpong) win at D=256
    256: HopperForwardConfig(64, 64, 2, stage_o=True, o_pieces=2, pingpong=True),
}
# Spans of WIDE_SPAN keys or more (WIDE_BAND_SPAN under a causal or window bound, whose span is half of N), by head
# dim. D=64 with three consumer warpgroups: more MMAs in flight for D=64's short tiles; at short spans a 192-row tile's
# third warpgroup idles on a head's last tile, and a causal tile's warpgroups see unequal numbers of keys. D=128 has
# neither the registers nor the shared memory for a third.
# unbanded: the three issue their MMAs in turns (pingpong), which gain from a span of 1k
_SM90_HOPPER_FORWARD_WIDE = {64: HopperForwardConfig(64, 128, 3, stage_o=True, consumers=3, q_stages=2, pingpong=True)}
# banded: without turns, which lose there
_SM90_HOPPER_FORWARD_WIDE_BAND = {64: HopperForwardConfig(64, 128, 3, stage_o=True, consumers=3, q_stages=2)}
WIDE_SPAN = 1024
WIDE_BAND_SPAN = 4096
# Banded spans of LONG_BAND_SPAN keys or more (causal N from 2047; windows launch without it): the diagonal key tile
# first (last_first), which takes the mask's branch out of the consumers' loop but exposes the masked softmax of a
# tile's first step, beside no P V. That gains for D=128's long tiles only: spans of 512 (causal N=1024) were mixed
# and D=64's softmax-heavy steps lost (DECISIONS, "Users' shapes")
_SM90_HOPPER_FORWARD_LONG_BAND = {128: HopperForwardConfig(64, 128, 2, stage_o=True, q_stages=2, last_first=True)}
LONG_BAND_SPAN = 1024
# No row takes tree_rows: the row max and sum as chains were faster on the H200 (trees remain an autotune candidate).
# Banded spans of SHORT_BAND_SPAN keys or fewer (causal N=512): 64-key tiles, whose diagonal tiles waste half as much;
# at longer spans they lose, as they do unbanded.
_SM90_HOPPER_FORWARD_SHORT_BAND = {
    # six slots of the 64-key tiles: as many bytes in flight as the 128-key row's three
    64: HopperForwardConfig(64, 64, 6, stage_o=True, q_stages=2),
    # three K slots: four are level, two slower
    128: HopperForwardConfig(64, 64, 3, stage_o=True, q_stages=2),
}
SHORT_BAND_SPAN = 256

# The causal forward's schedule (schedule.py): a query tile costs the keys its longest warpgroup streams plus about
# SCHEDULE_TILE_KEYS keys' worth of start and end (per FLOP the D=64 forward is 10% slower at N=1k, 8 key tiles per
# query tile, than at 16k, 128); heads are balanced in batches of about SCHEDULE_BATCH_ROUNDS tiles per program (one
# round beat two and the kernel's own pairs).
SCHEDULE_TILE_KEYS = 96
SCHEDULE_BATCH_ROUNDS = 1
# Beyond this many query tiles the kernel's own pairs run without a table: a table of 2**17 tiles takes about 0.1 s of
# Python to build, and the pairs' last round is then under 0.2% of the work.
SCHEDULE_MAX_TILES = 2**17

# The Gluon backward on sm90 (kernels/hopper/dkdv.py, dq.py), by head dim. From a span of fused_span keys on, one
# dK/dV kernel also adds up dQ by TMA reductions (5 matmuls per tile pair, not 7); below it the dQ kernel and then
# dK/dV win. Causal dK/dV programs go in groups of about order_programs programs of whole heads, each group's longest
# key blocks first, so that the grid's last programs are short ones (larger groups read Q and dO from DRAM more than
# once).
_SM90_HOPPER_BACKWARD = {
    # dQ's multiply a step late and LSE/delta read ahead of the wgmmas keep the tensor cores fed; fused from span 512
    # without a band, 240 worker registers make D=64's and D=128's dK/dV faster (DECISIONS: "dK/dV without a band")
    64: HopperBackwardConfig(
        HopperForwardConfig(64, 128, 2),
        64,
        64,
        3,
        512,
        dq_late=True,
        read_ahead=True,
        order_programs=256,
        unbanded_registers=240,
    ),
    # no registers for D=64's dq_late or read_ahead (they spill); two (Q, dO) slots beat three; fused from span 2048
    128: HopperBackwardConfig(
        HopperForwardConfig(64, 128, 2), 64, 64, 2, 2048, order_programs=128, unbanded_registers=240
    ),
    # registers for dK, dV of 64 keys x 128 columns: the warpgroups split D (split_d); fused at every span, no dQ
    # kernel; causal key blocks in groups of about 32 programs (DECISIONS: "Backward configs against the causal ...")
    256: HopperBackwardConfig(None, 64, 64, 2, 0, split_d=True, order_programs=32),
}

# Other CUDA GPUs (smaller shared memory than Hopper): conservative tiles.
_CUDA_TABLE: tuple[tuple[int, ForwardConfig, BackwardConfig], ...] = (
    (64, ForwardConfig(128, 64, 4, 2), BackwardConfig(32, 64, 64, 32, 4, 2, 2)),
    (128, ForwardConfig(64, 64, 4, 2), BackwardConfig(32, 64, 64, 32, 4, 1, 1)),
    (256, ForwardConfig(64, 32, 4, 1), BackwardConfig(16, 32, 32, 16, 4, 1, 1)),
)


# Softcaps above this take tanh's series near 0 (kernels/common.py logits), as fp32 inputs always do: the exp2 form's
# logit error grows with the cap, and the series costs 16-bit calls time (DECISIONS, "Forward: portable Triton kernels")
SOFTCAP_SERIES_ABOVE = 128.0


def softcap_mode(softcap: float, dtype: torch.dtype) -> int:
    """The kernels' SOFTCAP flag for inputs of ``dtype``: 0 no softcap; 1 tanh by exp2; 2 with its series near 0
    (fp32, or a cap past SOFTCAP_SERIES_ABOVE)."""
    if softcap <= 0:
        return 0
    return 2 if dtype == torch.float32 or softcap > SOFTCAP_SERIES_ABOVE else 1


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (n >= 1): triton.next_power_of_2 is a constexpr function, slower on the host."""
    return 1 << (n - 1).bit_length()


def block_d(head_dim: int) -> int:
    """Head dims that are not a power of two are padded (and masked) up to one."""
    return max(MIN_BLOCK, next_power_of_2(head_dim))


def _row(arch: str, head_dim: int) -> tuple[int, ForwardConfig, BackwardConfig]:
    table = _SM90_TABLE if arch == "sm90" else _CUDA_TABLE
    padded = block_d(head_dim)
    for row in table:
        if padded <= row[0]:
            return row
    raise ValueError(f"no launch config for head dim {head_dim}")


def _halve_for_fp32(cfg, dtype: torch.dtype):
    """fp32 tiles take twice the shared memory; halve the streamed tile edge. fp32 (not a fast path,
    and unmeasured) runs with pointer loads and one warp count."""
    if dtype != torch.float32:
        return cfg
    if isinstance(cfg, ForwardConfig):
        return ForwardConfig(cfg.block_m, max(MIN_BLOCK, cfg.block_n // 2), cfg.num_warps, 1, 1)
    return BackwardConfig(
        max(MIN_BLOCK, cfg.block_m_kv // 2),
        cfg.block_n_kv,
        cfg.block_m_q,
        max(MIN_BLOCK, cfg.block_n_q // 2),
        cfg.num_warps,
        stages_kv=1,
        stages_q=1,
        edge_stages=1,
    )


def forward_config(arch: str, head_dim: int, dtype: torch.dtype, span: int, plain: bool = True) -> ForwardConfig:
    """``plain``: no softcap, ALiBi, dropout or score_mod (they need registers a cap would spill)."""
    if arch == "interpreter":
        return _INTERPRETER_FORWARD
    bucket, cfg, _ = _row(arch, head_dim)
    if arch == "sm90" and span <= SHORT_SPAN:
        cfg = _SM90_SHORT_FORWARD.get(bucket, cfg)
    if not plain:
        cfg = replace(cfg, max_registers=None)
    return _halve_for_fp32(cfg, dtype)


def hopper_width(head_dim: int) -> int | None:
    """The Gluon kernels' tile width (their D) for a head dim, or None where they do not run: its block_d, the
    width the portable kernels pad it to (the preprocess kernel zeroes the fused backward's dQ sums that wide)."""
    return block_d(head_dim) if HOPPER_MIN_HEAD_DIM < head_dim <= 256 else None


def hopper_forward_config(
    arch: str, head_dim: int, dtype: torch.dtype, *, banded: bool, left_bounded: bool, span: int
) -> HopperForwardConfig | None:
    """The Gluon forward's config, or None where it does not run (forward_config's kernel does). ``banded``: a
    causal or window bound; ``left_bounded``: a window's left bound, whose key tiles keep their order (one kernel
    variant); ``span``: keys per query row (varlen: the longest sequence's)."""
    width = hopper_width(head_dim)
    if arch != "sm90" or dtype == torch.float32 or width is None:
        return None
    if banded and span <= SHORT_BAND_SPAN:
        return _SM90_HOPPER_FORWARD_SHORT_BAND.get(width, _SM90_HOPPER_FORWARD[width])
    if banded and span >= WIDE_BAND_SPAN and width in _SM90_HOPPER_FORWARD_WIDE_BAND:
        return _SM90_HOPPER_FORWARD_WIDE_BAND[width]
    if banded and span >= LONG_BAND_SPAN and not left_bounded:
        return _SM90_HOPPER_FORWARD_LONG_BAND.get(width, _SM90_HOPPER_FORWARD[width])
    if not banded and span >= WIDE_SPAN:
        return _SM90_HOPPER_FORWARD_WIDE.get(width, _SM90_HOPPER_FORWARD[width])
    return _SM90_HOPPER_FORWARD[width]


def hopper_backward_config(arch: str, head_dim: int, dtype: torch.dtype) -> HopperBackwardConfig | None:
    """The Gluon backward's config, or None where it does not run (backward_config's kernels do)."""
    width = hopper_width(head_dim)
    return _SM90_HOPPER_BACKWARD.get(width) if arch == "sm90" and dtype != torch.float32 else None


def backward_config(
    arch: str,
    head_dim: int,
    dtype: torch.dtype,
    *,
    span: int,
    windowed: bool,
    causal: bool,
    varlen: bool,
    sparse: bool,
) -> BackwardConfig:
    """``windowed``: the band has a left bound; ``causal``: only a right bound (causal or alike);
    ``sparse``: a BlockMask's tile lists, whose span is their mean."""
    if arch == "interpreter":
        return _INTERPRETER_BACKWARD
    bucket, _, cfg = _row(arch, head_dim)
    if arch == "sm90":
        # sparse: suits band-like masks (documents); scattered random tiles lose with it
        short_band = span <= SHORT_SPAN and (windowed or varlen or sparse)
        short = _SM90_SHORT_BACKWARD.get(bucket) if short_band else None
        if short is not None:
            cfg = short
        elif causal:
            cfg = _SM90_CAUSAL_BACKWARD.get(bucket, cfg)
        elif windowed:
            # A left bound adds the dK/dV kernel's second edge loop, which spills at 3 stages.
            cfg = replace(cfg, stages_kv=min(cfg.stages_kv, 2), edge_stages=None)
    return _halve_for_fp32(cfg, dtype)


# Opt-in autotuning of the forward (autotune.py, FLASHTRITON_AUTOTUNE=1) times these beside the table's choice, on a
# call's own inputs: the portable kernel's tiles of benchmarks/tune.py's sweep (fewer: a first call compiles each),
# and the Gluon kernel's rows of the other span bands plus the table's row with a K/V slot more or fewer, with its
# consumers' turns switched, and with its row reductions as trees or chains switched. Candidates that do not compile
# or fit the GPU's shared memory are skipped. The backward is not tuned: one of its sweep's tiles faulted on an H100.
AUTOTUNE_WARMUP_MS = 10
AUTOTUNE_REP_MS = 40
AUTOTUNE_MARGIN = 0.02  # a candidate replaces the table's config only when this much faster
AUTOTUNE_TOLERANCE = 2**-6  # outputs match within this share of their largest magnitude (bf16: two ulps at the top)
_FORWARD_TILES = ((128, 64, 8), (128, 32, 4), (64, 64, 4), (64, 32, 4), (128, 128, 8))  # block_m, block_n, warps


def forward_candidates(arch: str, head_dim: int, dtype: torch.dtype, table: ForwardConfig) -> list[ForwardConfig]:
    """The portable forward's configs that autotuning tries beside ``table`` (in the interpreter one, so that tests
    reach the tuner at tiny sizes)."""
    if arch == "interpreter":
        return [replace(table, block_n=2 * table.block_n)]
    stages = 2 if block_d(head_dim) <= 128 else 1
    tiles = [(m, n, w, s) for m, n, w in _FORWARD_TILES for s in (stages, stages + 1)]
    return [
        _halve_for_fp32(
            replace(table, block_m=m, block_n=n, num_warps=w, num_stages=s, edge_stages=None, max_registers=None), dtype
        )
        for m, n, w, s in tiles
    ]


def hopper_forward_candidates(head_dim: int, table: HopperForwardConfig) -> list[HopperForwardConfig]:
    """The Gluon forward's configs that autotuning tries beside ``table``."""
    bands = (
        _SM90_HOPPER_FORWARD,
        _SM90_HOPPER_FORWARD_WIDE,
        _SM90_HOPPER_FORWARD_WIDE_BAND,
        _SM90_HOPPER_FORWARD_LONG_BAND,
        _SM90_HOPPER_FORWARD_SHORT_BAND,
    )
    width = hopper_width(head_dim)
    rows = [band[width] for band in bands if width in band]
    slots = [replace(table, stages=table.stages + d) for d in (-1, 1) if table.stages + d >= 2]
    flags = ("pingpong", "tree_rows", "last_first")
    return [*rows, *slots, *(replace(table, **{flag: not getattr(table, flag)}) for flag in flags)]


# Tiles of the PyTorch (CPU) path: large enough for efficient matmuls, small enough that the
# per-tile score matrix stays a few MiB per (batch, head).
TORCH_BLOCK_M = 256
TORCH_BLOCK_N = 512


# Split-KV decoding (kernels/decode.py, flash_attn_with_kvcache); benchmarks/DECISIONS.md has what was measured.
@dataclass(frozen=True)
class DecodeConfig:
    block_m: int  # packed query rows (the query heads of one K/V head x the query positions) per program
    block_n: int  # cache rows streamed per inner step
    num_warps: int
    num_stages: int
    splits: int  # programs sharing one (sequence, K/V head)'s keys; 1: one pass, no combine
    tile_pages: bool = False  # paged: a tile's pages by scalar block-table reads, not an entry per row (decode.py)
    # the split kernel's registers per thread at most, where it would take more (launch.RegisterCap); None: no cap
    max_registers: int | None = None
    pdl: bool = False  # programmatic dependent launch (kernels/decode.py): Hopper's, not the interpreter's


DECODE_MAX_BLOCK_M = 64  # packed rows per program; a call with more (long seqlen_q x GROUP) runs several row tiles
DECODE_MAX_SPLITS = 128  # the most splits: the combine reads one partial row per split


@dataclass(frozen=True)
class DecodeWave:
    """How a split grid fills the SMs: a grid of up to per_sm unsplit programs per SM is split until it holds per_sm
    per SM (a tile per split at least), at ``stages`` pipeline stages; a larger one runs at ``unsplit_stages``,
    unsplit, or with ``fill`` split into waves that keep that share of the SMs busy (full_waves)."""

    per_sm: int
    stages: int
    unsplit_stages: int
    fill: float | None = None
    resident: int | None = None  # programs per SM that the register cap keeps room for (None: per_sm)


# A split grid is one wave that loads every SM alike (programs of one call stream equal shares, so an SM holding one
# more than another finishes last): 2 programs per SM at 3 stages (3 fit an H100/H200 SM at D=128); a grid already
# past that runs unsplit at 2 stages (5 fit). Paged caches: 4 per SM at 2 stages (at most 128 registers each:
# wave_registers; seqlen_q 4 causal takes 160 without a cap); on Hopper from a padded head dim of 128 on, where its
# splits get DECODE_DEEP_MIN_TILES tiles each, the deep wave: 2 per SM at 3 stages, whose unsplit grids keep the
# paged wave's 4 per SM (so its cap). D=64's 128-row tiles, a block-table entry each, ran slower in it. The wide tiles
# fit one program per SM. A grid between whole counts per SM, or one past a wave, ran slower; a short cache's splits
# of one tile each beat longer ones (measured at D=64 and 128; benchmarks/decode_tune.py --sweep; DECISIONS,
# "Decoding")
DECODE_WAVE = DecodeWave(per_sm=2, stages=3, unsplit_stages=2)
DECODE_WAVE_PAGED = DecodeWave(per_sm=4, stages=2, unsplit_stages=2)
DECODE_WAVE_PAGED_DEEP = DecodeWave(per_sm=2, stages=3, unsplit_stages=2, resident=4)
DECODE_DEEP_MIN_TILES = 8  # shorter splits ran slower in the deep wave (DECISIONS, "Decoding")
DECODE_WAVE_WIDE = DecodeWave(per_sm=1, stages=3, unsplit_stages=3, fill=0.95)  # wide tiles: _wide_tiles
DECODE_COMBINE_WARPS = 4
SM_REGISTERS = 65536  # 32-bit registers of an SM (every CUDA GPU from sm_50 on)
MAX_REGISTERS = 255  # of a thread
# The ring's merges (kernels/merge.py): elementwise passes over fp32 rows, a program's tile of this many elements
MERGE_TILE_ELEMENTS = 4096
MERGE_WARPS = 4
# Paged caches whose pages and tiles divide one another read a tile's pages (a scalar block-table read each, the tiles
# aligned to pages) instead of each row's entry: faster or level at every shape measured, up to the 8 reads of D=64's
# tiles of 128 over pages of 16 (DECISIONS, "Decoding"); pages smaller still read an entry per row
DECODE_TILE_PAGES_MAX_READS = 8
INTERPRETER_SMS = 4  # the SM count the interpreter's split choice assumes (small grids of two tiles or more split)
# (max head dim, block_n, num_warps) for 2-byte dtypes on CUDA GPUs, 16 KB K and V tiles each; fp32 halves block_n
_DECODE_TABLE = ((64, 128, 4), (128, 64, 4), (256, 32, 4))
# Hopper, 2-byte dtypes: 32 KB K/V tiles (block_n, num_warps by padded head dim), one program per SM at 3 stages
# (128 KB or more of shared memory, more than other GPUs' blocks get). At D=128 for contiguous caches whose unsplit
# grid fits one program per SM; at D=64 for grids past DECODE_WAVE's over caches of DECODE_WIDE_MIN_CAPACITY rows or
# more (measured faster at 32k and 128k rows, slower at 4k; between them untested), contiguous or in pages of whole
# tiles (a tile's page one block-table read; D=128's wide tiles over pages were no better than the paged wave), split
# into waves of which at least DECODE_WAVE_WIDE.fill of the SMs work (full_waves); _wide_tiles
_DECODE_WIDE = {128: (128, 8), 64: (256, 8)}
DECODE_WIDE_MIN_CAPACITY = 32768
_INTERPRETER_DECODE = (16, 1)  # block_n, num_warps


def decode_waves(programs: int, tiles: int, sms: int, wave: DecodeWave) -> tuple[int, int]:
    """(splits, num_stages) for a grid of ``programs`` unsplit programs over caches of ``tiles`` tiles: split to at
    most wave.per_sm programs per SM, a tile each at least; where the grid already passes that, unsplit or
    (wave.fill) in full waves. From shapes alone: the lengths are device values."""
    slots = wave.per_sm * sms
    if programs > slots:
        splits = 1 if wave.fill is None else full_waves(programs, tiles, slots, wave.fill)
        return splits, wave.unsplit_stages
    return whole_splits(tiles, min(wave.per_sm * sms // programs, DECODE_MAX_SPLITS)), wave.stages


def whole_splits(tiles: int, most: int) -> int:
    """Splits of ``tiles`` (>= 1) tiles, at most ``most``, each of which gets a tile: the split kernel deals chunks
    of cdiv(tiles, splits) whole tiles, so 128 tiles in 33 splits would be 32 chunks of 4 and a 33rd split with none."""
    most = max(1, min(most, tiles))
    return -(-tiles // -(-tiles // most))


def decode_config(
    arch: str,
    head_dim: int,
    dtype: torch.dtype,
    rows: int,
    pairs: int,
    capacity: int,
    sms: int,
    num_splits: int,
    page_size: int = 0,
) -> DecodeConfig:
    """The decode kernels' config for ``rows`` packed query rows per (sequence, K/V head), ``pairs`` such pairs,
    caches of ``capacity`` rows in pages of ``page_size`` (0: contiguous) and ``sms`` SMs: the table's tiles (or the
    wide ones), split and staged as decode_waves says. ``num_splits``: the caller's (0: choose), kept as given but
    capped at the cache's tiles (a split may then be left without a tile: it writes an empty partial); tiles and
    stages stay the table's choice."""
    block_m = min(max(MIN_BLOCK, next_power_of_2(rows)), DECODE_MAX_BLOCK_M)
    programs = pairs * -(-rows // block_m)
    wave = DECODE_WAVE_PAGED if page_size > 0 else DECODE_WAVE
    deep = False  # DECODE_WAVE_PAGED_DEEP, where its splits are long enough
    if arch == "interpreter":
        block_n, warps = _INTERPRETER_DECODE
    else:
        padded = block_d(head_dim)
        _, block_n, warps = next(row for row in _DECODE_TABLE if padded <= row[0])
        if dtype == torch.float32:
            block_n = max(MIN_BLOCK, block_n // 2)
        elif arch == "sm90" and _wide_tiles(padded, programs, capacity, sms, page_size):
            (block_n, warps), wave = _DECODE_WIDE[padded], DECODE_WAVE_WIDE
        deep = arch == "sm90" and page_size > 0 and padded >= 128 and dtype != torch.float32
    tiles = max(1, -(-capacity // block_n))
    if deep and tiles // decode_waves(programs, tiles, sms, DECODE_WAVE_PAGED_DEEP)[0] >= DECODE_DEEP_MIN_TILES:
        wave = DECODE_WAVE_PAGED_DEEP
    splits, stages = decode_waves(programs, tiles, sms, wave)
    splits = num_splits or splits
    by_tile = tile_pages(block_n, page_size)
    splits, registers = min(splits, tiles), wave_registers(wave, warps)
    return DecodeConfig(block_m, block_n, warps, stages, splits, by_tile, registers, pdl=arch == "sm90")


def _wide_tiles(padded: int, programs: int, capacity: int, sms: int, page_size: int) -> bool:
    """Whether a 2-byte call on Hopper takes the wide tiles (_DECODE_WIDE): at D=128 a contiguous cache's grid of one
    program per SM at most (split to one wave of them), at D=64 a grid past DECODE_WAVE's (unsplit) over a long
    contiguous cache or one in pages of whole wide tiles."""
    if padded == 128:
        return page_size <= 0 and programs <= DECODE_WAVE_WIDE.per_sm * sms
    whole_pages = page_size <= 0 or page_size % _DECODE_WIDE[64][0] == 0
    return padded == 64 and whole_pages and programs > DECODE_WAVE.per_sm * sms and capacity >= DECODE_WIDE_MIN_CAPACITY


def full_waves(programs: int, tiles: int, slots: int, fill: float, most: int = 4) -> int:
    """Splits of a grid of ``programs`` on ``slots`` programs at a time whose last wave keeps ``fill`` of the slots
    busy: the fewest up to ``most`` (and a tile each), else the one whose waves are fullest (a grid of 3.4 waves runs
    as long as one of 4)."""
    counts = sorted({whole_splits(tiles, s) for s in range(1, most + 1)})
    busy = {s: programs * s / (-(-programs * s // slots) * slots) for s in counts}
    return next((s for s in counts if busy[s] >= fill), max(counts, key=busy.__getitem__))


def wave_registers(wave: DecodeWave, num_warps: int) -> int | None:
    """Registers per thread that let the wave's resident (or per_sm) programs share an SM (a kernel over the cap
    fits fewer, and the wave's grid then runs in two), a cap that holds only where the kernel would take more (ptxas
    held to one it need not reach spills anyway); None where that is the most a thread has anyway (asked for 255,
    ptxas takes far more than it needs: DECISIONS, "Decoding")."""
    registers = SM_REGISTERS // ((wave.resident or wave.per_sm) * num_warps * 32)
    return registers if registers < MAX_REGISTERS else None


def tile_pages(block_n: int, page_size: int) -> bool:
    """Whether the split kernel reads a tile's pages by tile (DecodeConfig.tile_pages, decode.py's aligned_slots):
    pages of whole tiles, or tiles of whole pages, up to DECODE_TILE_PAGES_MAX_READS of them."""
    if page_size <= 0:
        return False
    if page_size >= block_n:
        return page_size % block_n == 0
    return block_n % page_size == 0 and block_n // page_size <= DECODE_TILE_PAGES_MAX_READS
