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
The sm90 rows won sweeps on an H200 or, on 2026-11-25, an H100 (benchmarks/NOTES.md names each run's
card). Banded and unbanded spans may take different rows (the Gluon forward's short band, the portable
D=128 backward's _SM90_CAUSAL_BACKWARD). The table
for other CUDA GPUs is an unmeasured starting point that only fits shared memory.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import triton

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


@dataclass(frozen=True)
class HopperForwardConfig:
    """The Gluon sm90 forward (kernels/hopper.py)."""

    block_m: int  # query rows per consumer warpgroup
    block_n: int  # keys per K/V tile
    stages: int  # K/V tiles in flight (slots of the shared-memory rings: the forward's K ring and its V ring)
    stage_o: bool = False  # the forward's O through shared memory and a TMA store (consumers * block_m * D more of it)
    consumers: int = 2  # the forward's consumer warpgroups (2 or 3; the backward's dQ kernel has two)
    q_stages: int = 1  # the forward's Q tiles per consumer warpgroup (2: the next tile's Q loads a tile ahead)
    o_pieces: int = 1  # stage_o: O goes out in this many column pieces (1 or 2) through a tile as much narrower
    tree_rows: bool = False  # the forward's row max and sum as trees of column halves, not chains
    pingpong: bool = False  # the forward's consumers issue their MMAs in turns (named barriers, FA3's ping-pong)

    @property
    def rows(self) -> int:
        """The forward's sequences must be whole multiples of this many rows (a warpgroup's, a K/V tile's)."""
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

    @property
    def keys(self) -> int:
        """Keys per dK/dV program."""
        return self.block_n if self.split_d else 2 * self.block_n

    @property
    def rows(self) -> int:
        """Sequences must be whole multiples of this many rows (of both kernels' programs and tiles)."""
        rows = math.lcm(self.block_m, self.keys)
        return rows if self.dq is None else math.lcm(rows, 2 * self.dq.block_m, self.dq.block_n)


# The Gluon kernels' partitions (kernels/hopper/). Every kernel launches with num_warps = HOPPER_NUM_WARPS, its
# default partition being one consumer warpgroup (wgmma's 4 warps); the other consumer warpgroups and the producer
# warp, which only issues TMA loads, are worker partitions. Registers per thread of each worker (setmaxnreg), out of
# the SM's 64K: 232 for each of two consumer warpgroups, 160 for each of three.
HOPPER_NUM_WARPS = 4
HOPPER_PRODUCER_WARPS = 1
HOPPER_PRODUCER_REGISTERS = 24
HOPPER_CONSUMER_REGISTERS = {2: 232, 3: 160}  # by the kernel's consumer warpgroups

# The most K/V heads in one group of order_programs.
ORDER_HEADS = 16

# Rows of the preprocessing kernel (delta = rowsum(dO * O)) per program.
PREPROCESS_BLOCK_M = 64

# fp32 values per row of the fused Hopper backward's dQ reductions in fragment order (hopper._fragments), through an
# unswizzled tile. 256 (1 KB rows) against 32 (128-byte rows, 128-byte swizzle), whole backward: 2-4% faster on causal
# spans, level at D=64 dense, 2-3.5% slower at D=128 dense (NOTES 68)
DQ_FRAGMENT_COLS = 256

_INTERPRETER_FORWARD = ForwardConfig(block_m=16, block_n=16, num_warps=1, num_stages=1, tma=True)
_INTERPRETER_BACKWARD = BackwardConfig(16, 16, 16, 16, num_warps=1, stages_kv=1, stages_q=1, tma=True)

# (max head dim, forward, backward) for 2-byte dtypes; first row whose head dim fits wins.
# tma=True rows won H200 A/Bs against pointer loads (2026-11-21, NOTES item 12): D=128 forward +2-3%,
# backwards +5-7% (D=64 +7%), D=256 forward +12-17% and backward +16-23% (its pointer loads spilled);
# the D=64 forward was level, so it keeps pointer loads. D=256's dQ runs at 4 warps (-20%: 26.7 -> 21.4 ms at
# 16k; D=128's and the short bands' dQ lose 5-47% at 4 warps); D=64's dQ takes 128-row tiles at 8 warps (-1%).
# Triton 3.6's ptxas crashes (SIGSEGV) on some TMA kernels whose loops differ in pipeline depth by one
# (main 3 / edges 2, or main 2 / ragged tile 1): TMA rows keep edge_stages None or 1 below 3 stages.
# On an H100 the dQ kernel with 128 x 32 tiles at 4 warps and 2 TMA stages made illegal shared-memory accesses at
# D=128 (softcap 30, non-causal, 1024 programs or more; benchmarks/NOTES.md 65, 66): no row takes that combination.
_SM90_TABLE: tuple[tuple[int, ForwardConfig, BackwardConfig], ...] = (
    (
        64,
        ForwardConfig(128, 64, 8, 3, max_registers=128),
        BackwardConfig(64, 64, 128, 64, 4, 2, 3, tma=True, warps_q=8),
    ),
    (
        128,
        ForwardConfig(128, 128, 8, 3, tma=True),
        BackwardConfig(64, 128, 128, 64, 8, 3, 3, edge_stages=1, tma=True),
    ),
    (
        256,
        ForwardConfig(128, 64, 8, 2, edge_stages=1, tma=True),
        BackwardConfig(64, 64, 64, 64, 8, 2, 2, 1, tma=True, warps_q=4),
    ),
)
# sm90 backwards of causal-like bands (right bound only), by head dim. D=128: the non-causal row with TMA
# loses there (16k: 7.56 ms against 6.96 with pointer loads and 2-stage edges); 64 keys per dK/dV program
# at 4 warps (dQ at 8) beats both: 6.86, and 4k 2.22 / 2.06 -> 1.96.
_SM90_CAUSAL_BACKWARD = {128: BackwardConfig(32, 64, 128, 64, 4, 3, 3, tma=True, warps_q=8)}
# sm90 forwards for spans up to SHORT_SPAN keys, by head dim (measured at 128 only: faster for a causal
# window of 1024, 2k-token causal documents and N = 512; level for dense N = 1k and causal N = 2k; slower
# for dense N = 2k, span 2048; the threshold lies between). With TMA: window 1024 0.406 -> 0.365 ms.
SHORT_SPAN = 1536
_SM90_SHORT_FORWARD = {128: ForwardConfig(64, 64, 4, 3, tma=True)}
# sm90 backwards for short spans of windowed or varlen bands (the kernel variants that spill most):
# dK/dV streams 32 query rows per step (8 x 2k causal documents, varlen: dK/dV 1.36 -> 0.82 ms; window
# 1024: 1.08 -> 0.82). Dense short sequences lose with it (N=1k fwd+bwd 1.59 -> 1.81 ms), as does a
# long span (16k causal dK/dV 4.13 -> 4.84 ms). With TMA: window 1024 1.28 -> 1.21 ms, documents 1.33 -> 1.27.
_SM90_SHORT_BACKWARD = {128: BackwardConfig(32, 128, 128, 64, 8, 2, 3, tma=True)}

# The Gluon forward on sm90, by head dim (H200, kernel times in one run with cuDNN, B * N = 16k, H * D = 2048, N = 16k,
# TFLOP/s non-causal / causal): D=128 615 / 591 against the portable kernel's 504 / 472 and cuDNN's 601 / 551; D=64 440
# / 412 against 424 / 400 and 452 / 434. Three K/V slots beat two (D=128: 615 against 518, with one Q tile per
# warpgroup; with two, two slots win: below); 64-key tiles lose (559). Persistent since (benchmarks/NOTES.md 24; forward
# kernel ms against the grid of one program per tile, same run): D=128 N=512 0.166-0.171 -> 0.152-0.157, causal N=1k
# 0.181-0.186 -> 0.168-0.173, N=4k 0.821 -> 0.831-0.837, 16k within noise. D=64 now beats the portable kernel at short N
# too (N=512 0.209 -> 0.204-0.206, 1k 0.354 -> 0.340, causal 0.244 -> 0.233, causal 2k 0.398 -> 0.380), so its former
# threshold (Gluon only from a span of 2048 keys) is gone.
# O through shared memory and a TMA store (stage_o; NOTES 34), forward kernel ms, same run, two repeats: D=64
# N=512 0.207-0.208 -> 0.198-0.199, 1k 0.340 -> 0.328-0.331, 2k 0.635-0.641 -> 0.621-0.627, causal 512 0.161-0.162
# -> 0.155-0.156, causal 2k 0.367-0.370 -> 0.354-0.358, 16k level. D=128 makes room for it with a V ring of two
# slots beside a K ring of three (NOTES 37; the split alone is level), forward kernel ms against three of each
# without it, same run: N=512 0.153 -> 0.135 (cuDNN 0.134), 1k 0.259 -> 0.240, 2k 0.467 -> 0.450, 16k 3.42 -> 3.39,
# causal 512 0.132 -> 0.117, 1k 0.174 -> 0.160, 4k 0.507 -> 0.471, 16k 1.85 -> 1.79. A second Q tile per
# warpgroup (its next tile's Q loads a tile ahead) in that room instead: 1-2%. D=64 has room for it beside
# the staged O: N=512 0.189 -> 0.183, causal 1k 0.222 -> 0.218, longer spans level.
# D=256 (NOTES 44): 64-key tiles; two K and two V slots (192 KB) leave room for a staged O only in column halves,
# one after the other through a 64 x 128 tile per warpgroup. Forward kernel ms, same run as cuDNN: against the portable
# kernel (two repeats) N=512 0.151-0.154 against 0.196-0.198, 16k 3.15-3.23 against 4.23-4.26, causal 512 0.116-0.117
# against 0.159-0.160; the halves against O from registers (three repeats): N=512 0.127-0.130 against 0.154-0.161
# (cuDNN 0.132-0.144), 1k 0.227-0.238 against 0.255-0.276, 16k 3.29-3.36 against 3.22-3.26 (3.42-3.54), causal 512
# 0.100-0.102 against 0.117-0.119 (0.101-0.107), causal 16k 1.75-1.78 against 1.83-1.85 (1.78-1.90). A third K slot
# (224 KB, no staged O) is level causal and 5-10% slower dense; a V ring of one slot beside it is slower still.
# D=256 issues its MMAs in turns (pingpong, NOTES 58), forward kernel ms (H100, CUDA-graph replay, three rounds,
# median) against without, same run: N=512 0.1319 -> 0.1245, 1k 0.2258 -> 0.2188, 16k 3.274 -> 3.130, causal 512
# 0.1092 -> 0.1060 / 0.1068 -> 0.1052 / 0.1068 -> 0.1057 (three runs), causal 2k 0.2461 -> 0.2386, causal 16k 1.779
# -> 1.623; causal 1k 0.1310 -> 0.1330. At D=64 it loses (causal 512 0.1310 -> 0.1379, causal 1k 0.1943 -> 0.2013),
# at D=128 it is level; D=64's three warpgroups at 16k (4.349 -> 4.254, one run) take turns since NOTES 75.
# D=128 takes two K and two V slots and, in the room that frees, two Q tiles per warpgroup (NOTES 55 for unbanded
# spans below 2k, NOTES 63 for the rest), forward kernel ms (H100, CUDA-graph replay, five rounds, min and max)
# against three K and two V slots with one Q tile, two runs: N=512 0.1282-0.1298 / 0.1270-0.1300 against
# 0.1331-0.1378 / 0.1330-0.1401 (cuDNN 0.1333 / 0.1321), 1k 0.2255-0.2306 against 0.2276-0.2435; medians of five and
# of seven rounds (NOTES 63): causal 1k 0.1572 -> 0.1467, 2k 0.2594 -> 0.2537, 4k 0.4724 -> 0.4704, 8k 0.9283 ->
# 0.8922 and 0.9324 -> 0.9032, 16k 1.7848 -> 1.7181 and 1.7980 -> 1.7385; dense 2k 0.4527 -> 0.4449, 4k 0.8870 ->
# 0.8758 and 0.8869 -> 0.8829, 8k 1.7244 -> 1.7537, 16k 3.4140 -> 3.4262 and 3.4505 -> 3.4043 (level).
_SM90_HOPPER_FORWARD = {
    64: HopperForwardConfig(64, 128, 3, stage_o=True, q_stages=2),
    128: HopperForwardConfig(64, 128, 2, stage_o=True, q_stages=2),
    256: HopperForwardConfig(64, 64, 2, stage_o=True, o_pieces=2, pingpong=True),
}
# Spans of WIDE_SPAN keys or more (WIDE_BAND_SPAN under a causal or window bound), by head dim: D=64 with three
# consumer warpgroups (NOTES 36), forward kernel ms against two, same run: N=2k 0.627-0.636 -> 0.606-0.613, 4k
# 1.23-1.25 -> 1.16, 8k 2.43-2.45 -> 2.18, 16k 4.89 -> 4.33-4.42; level at 1k, 3% slower at 512 (a 192-row tile's
# third warpgroup idles on the last tile of a head); causal 1.54-1.77x slower at N <= 1k, 6% at 4k (a causal tile's
# warpgroups see different numbers of keys), 1-2% faster at 8k and 16k (NOTES 39). With two Q tiles each (NOTES 37):
# 16k 4.38 -> 4.25, 4k 1.19 -> 1.15. D=128 has neither the registers (296 B of spill) nor the shared memory for a
# third. Unbanded, the three take their MMAs in turns (pingpong) from a span of 1k (NOTES 75: H200, forward kernel
# ms by CUDA-graph replay, no LSE, two consumers / three / three in turns: N=512 0.1789 / 0.1822 / 0.1879, 1k 0.3360
# / 0.3347 / 0.3271 (cuDNN 0.3407); three / three in turns: 2k 0.6038 / 0.5852, 4k 1.1776 / 1.1363, 8k 2.2352 /
# 2.1497, 16k 4.3638 / 4.2657). Banded, turns lose: causal 8k 1.1865 -> 1.2496, 16k 2.2907 -> 2.4272 (a causal
# span is half of N: three warpgroups from causal 8k).
_SM90_HOPPER_FORWARD_WIDE = {64: HopperForwardConfig(64, 128, 3, stage_o=True, consumers=3, q_stages=2, pingpong=True)}
_SM90_HOPPER_FORWARD_WIDE_BAND = {64: HopperForwardConfig(64, 128, 3, stage_o=True, consumers=3, q_stages=2)}
WIDE_SPAN = 1024
WIDE_BAND_SPAN = 4096
# D=64 unbanded spans below 2k took the row max and sum as trees until NOTES 74 (NOTES 51, H100, forward kernel
# ms by CUDA-graph replay against chains, same run: N=512 0.1870 -> 0.1818, 1k 0.3411 -> 0.3292). On the H200 at
# 9cf99a8's kernels, no LSE, chains are faster: N=512 0.1851 -> 0.1775 (cuDNN 0.1865), 1k 0.3429 -> 0.3313 (0.3348);
# the bench there, 0.996 -> 1.033 and 0.991 -> 1.010 x cuDNN. Trees stay an autotune candidate.
# Banded spans of SHORT_BAND_SPAN keys or fewer (causal N=512): 64-key tiles, whose diagonal tiles waste half as
# much (NOTES 39), forward kernel ms against 128-key tiles, same run: D=64 causal 512 0.159 -> 0.141, D=128 0.117
# -> 0.105; at causal 1k (a span of 512) they lose (D=64 0.221 -> 0.231), as they do unbanded. D=128 with three K
# slots instead of four (NOTES 55), forward kernel ms (H100, CUDA-graph replay, five rounds), two runs: causal 512
# 0.1040-0.1045 / 0.1039-0.1047 against 0.1049-0.1053 / 0.1048-0.1054 (cuDNN 0.1030 / 0.1036); two slots 4% slower.
_SM90_HOPPER_FORWARD_SHORT_BAND = {
    64: HopperForwardConfig(64, 64, 6, stage_o=True, q_stages=2),
    128: HopperForwardConfig(64, 64, 3, stage_o=True, q_stages=2),
}
SHORT_BAND_SPAN = 256

# The causal forward's schedule (schedule.py, NOTES 54): a query tile costs the keys its longest warpgroup streams
# plus about SCHEDULE_TILE_KEYS keys' worth of start and end (per FLOP the D=64 forward is 10% slower at N=1k than
# at 16k, where tiles stream 8 and 128 key tiles: NOTES 43); heads are balanced in batches of about
# SCHEDULE_BATCH_ROUNDS tiles per program. Forward kernel ms (H100, CUDA-graph replay, five rounds, min), batches of
# one / two rounds / the kernel's own pairs: D=64 causal 1k 0.2032 / 0.2078 / 0.2171, 4k 0.6188 / 0.6242 / 0.6418;
# D=128 causal 1k 0.1472 / 0.1556 / 0.1514, 4k 0.4291 / 0.4361 / 0.4505, 16k 1.646 / 1.618 / 1.711.
SCHEDULE_TILE_KEYS = 96
SCHEDULE_BATCH_ROUNDS = 1
# Beyond this many query tiles the kernel's own pairs run without a table: a table of 2**17 tiles takes about 0.1 s of
# Python to build, and the pairs' last round is then under 0.2% of the work.
SCHEDULE_MAX_TILES = 2**17

# The Gluon backward on sm90, by head dim (H200, backward kernel times, B * N = 16k, H * D = 2048, same run):
# D=128 dK/dV with the portable dQ: N=16k 12.59 -> 11.90 ms, causal 6.84 -> 6.53, N=4k 3.30 -> 3.11, 1k 1.00 -> 0.92
# (2, 3 or 4 slots within 1%); plus the Gluon dQ (64 rows per warpgroup, 128-key tiles, 2 slots): 16k 13.05 ->
# 11.58 ms against the portable pair, causal 7.10 -> 6.36, 4k 3.43 -> 3.03, 1k 1.03 -> 0.90 (64-key tiles 1-2%
# behind). Issuing dK/dV's next S^T and dP^T behind dV and dK (cross-step overlap) was slower: D=128 16k 14.50 ms.
# Since LSE and delta come through TMA (NOTES 23; dK/dV kernel 16k 6.17 -> 5.77 ms, causal 3.45 -> 2.89, 8 documents
# 0.708 -> 0.497), the D=64 Gluon pair is level with the portable one (backward 16k 13.5 against 13.0 ms, causal
# 6.56 against 6.75-7.12, 1k 1.03 against 1.09; 128-query steps spill), so D=64 kept the portable kernels then.
# Fused (dQ added up by TMA reductions in the dK/dV kernel, NOTES 30) against the pair, whole backward ms, same
# run: 16k 10.03-10.05 (a form with the scale in dS) against 10.67-10.74, causal 5.45-5.48 against 5.68-5.72, 4k
# 2.65-2.71 against 2.87-2.89, 2k 1.40-1.46 against 1.54; at shorter spans the pair wins: causal 2k 0.90-0.92
# against 0.89, causal 1k 0.55-0.56 against 0.54, 512 0.49-0.50 against 0.48, causal 512 0.40 against 0.36.
# Hence fused_span 2048.
# D=64 takes the same kernels since (whole backward ms against the portable pair, same run): 16k 13.14-13.28
# against 14.20-14.48, causal 6.71-6.84 against 7.36-7.47, 4k 3.44-3.49 against 3.76-3.80, 2k 1.82-1.84 against
# 2.02-2.06; below the fused span the Gluon pair: 512 0.63 against 0.68, causal 1k 0.68 against 0.70-0.71.
# D=64 takes the fused kernel from a span of 1024 (NOTES 39), whole backward ms against the pair, three repeats: N=1k
# 1.09-1.13 -> 1.036-1.038, causal 2k 1.157-1.161 -> 1.098-1.113; from 512 level (N=512, causal 1k).
# D=64 issues each step's dQ multiply a step late and reads LSE and delta ahead of the wgmmas (NOTES 40), whole
# backward ms, same run, two repeats, both / dq_late alone / read_ahead alone / neither: N=1k 0.888-0.902 / 1.003 /
# 0.995 / 1.006-1.011, 4k 2.94 / 3.28-3.31 / 3.30-3.59 / 3.35-3.42, 16k 11.16-11.18 / 12.48-12.60 / 12.46-12.61 /
# 12.66-13.10, causal 2k 0.976-0.987 / 1.064-1.073 / 1.091-1.093 / 1.105-1.113, causal 16k 6.00-6.09 / 6.50-7.00 /
# 6.63-6.72 / 6.78-6.84. D=128 has the registers for neither (local ptxas: dq_late spills 368 B and serialises the
# wgmmas; read_ahead adds 16-32 B of spill, 1k and causal 4k 4-5% slower). With both, the fused kernel wins from a span
# of 512 (three repeats, fused from 1024 / 512 / 256): N=512 0.599-0.603 / 0.578-0.580 / 0.577-0.582, causal 1k
# 0.642-0.645 / 0.630-0.635 / 0.630-0.672, causal 512 (span 256) 0.455-0.458 / 0.455 / 0.463.
# D=256 (NOTES 50): both warpgroups take the same 64 keys and half of D each (split_d), fused at every span, dQ by TMA
# reductions staged in the step's Q and dO tiles (atomics from registers held L2 at 81% and cost 42%). Backward
# ms against the portable kernels and cuDNN, same run: 16k 14.30 against 21.39 and 15.24, causal 16k 7.05 against
# 9.75 and 7.30, N=512 0.646 against 0.939 and 0.712, causal 512 0.463 against 0.730 and 0.481; with the slot given
# back a step later (defer): 16k 12.88 (cuDNN 15.22), 4k 3.39 against 3.71 (3.73), causal 4k 1.86 against 2.01
# (2.01), 1k 0.994 against 1.077 (1.135). No Gluon dQ kernel: deterministic=True runs the portable pair.
# Causal dK/dV programs in groups of heads, each group's longest key blocks first (NOTES 61), so that the grid's
# last programs are short ones; larger groups read Q and dO from DRAM more than once. dK/dV kernel us (D=64/256 and
# D=128 from 2k with dQ's zeroing), H100, CUDA-graph replay, median of three rounds, order_programs 0 / 64 / 128 /
# 256: D=256 causal 512 433 / 422 / 428 / 429, 1k 600 / 588 / 596 / 597, 2k-16k within 1%; D=128 causal 512 203 /
# 195 / 198 / 198, 1k 313 / 314 / 300 / 302, 2k 841 / 827 / 795 / 832, 4k 1522 / 1539 / 1490 / 1524, 8k 2903 /
# 2922 / 2814 / 2807, 16k 5453 / 5425 / 5424 / 5446; D=64 causal 512 395 / 389 / 391 / 389, 1k 566 / 567 / 563 /
# 564, 2k 951 / 936 / 936 / 937, 4k 1712 / 1733 / 1673 / 1684, 8k 3216 / 3192 / 3107 / 3062, 16k 6260 / 6270 /
# 6261 / 6127.
# D=128 streams through two (Q, dO) slots, not three (NOTES 67), whole backward ms (H100, CUDA-graph replay, medians of
# three and of five rotated rounds in two runs; dK and dV bitwise the same), three / two: causal 16k 5.404 / 5.243 and
# 5.425 / 5.297, causal 8k 2.933 / 2.840, causal 4k 1.577 / 1.560 and 1.572 / 1.573, dense 16k 10.07 / 10.02 and
# 10.12 / 10.10, dense 4k 2.705 / 2.696, dense 2k 1.466 / 1.461 and 1.455 / 1.484, GQA 4:1 causal 4k 1.551 / 1.565 and
# 1.558 / 1.580; the pair below the fused span: causal 2k 0.921 / 0.901 and 0.921 / 0.908, a window of 1000 keys at 8k
# 0.934 / 0.912 and 0.924 / 0.919.
_SM90_HOPPER_BACKWARD = {
    64: HopperBackwardConfig(
        HopperForwardConfig(64, 128, 2), 64, 64, 3, 512, dq_late=True, read_ahead=True, order_programs=256
    ),
    128: HopperBackwardConfig(HopperForwardConfig(64, 128, 2), 64, 64, 2, 2048, order_programs=128),
    256: HopperBackwardConfig(None, 64, 64, 2, 0, split_d=True, order_programs=64),
}

# Other CUDA GPUs (smaller shared memory than Hopper): conservative tiles.
_CUDA_TABLE: tuple[tuple[int, ForwardConfig, BackwardConfig], ...] = (
    (64, ForwardConfig(128, 64, 4, 2), BackwardConfig(32, 64, 64, 32, 4, 2, 2)),
    (128, ForwardConfig(64, 64, 4, 2), BackwardConfig(32, 64, 64, 32, 4, 1, 1)),
    (256, ForwardConfig(64, 32, 4, 1), BackwardConfig(16, 32, 32, 16, 4, 1, 1)),
)


def arch_of(device: torch.device, interpreting: bool) -> str:
    if interpreting:
        return "interpreter"
    return _cuda_arch(device)


@functools.cache
def _cuda_arch(device: torch.device) -> str:
    major, _ = torch.cuda.get_device_capability(device)  # a few microseconds a call: read once per device
    return "sm90" if major == 9 else "cuda"


def block_d(head_dim: int) -> int:
    """Head dims that are not a power of two are padded (and masked) up to one."""
    return max(MIN_BLOCK, triton.next_power_of_2(head_dim))


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


def hopper_forward_config(
    arch: str, head_dim: int, dtype: torch.dtype, *, banded: bool, span: int
) -> HopperForwardConfig | None:
    """The Gluon forward's config, or None where it does not run (forward_config's kernel does). ``banded``: a
    causal or window bound; ``span``: keys per query row (varlen: the longest sequence's)."""
    if arch != "sm90" or dtype == torch.float32 or head_dim not in _SM90_HOPPER_FORWARD:
        return None
    if banded and span <= SHORT_BAND_SPAN:
        return _SM90_HOPPER_FORWARD_SHORT_BAND.get(head_dim, _SM90_HOPPER_FORWARD[head_dim])
    if banded and span >= WIDE_BAND_SPAN:
        return _SM90_HOPPER_FORWARD_WIDE_BAND.get(head_dim, _SM90_HOPPER_FORWARD[head_dim])
    if not banded and span >= WIDE_SPAN:
        return _SM90_HOPPER_FORWARD_WIDE.get(head_dim, _SM90_HOPPER_FORWARD[head_dim])
    return _SM90_HOPPER_FORWARD[head_dim]


def hopper_backward_config(arch: str, head_dim: int, dtype: torch.dtype) -> HopperBackwardConfig | None:
    """The Gluon backward's config, or None where it does not run (backward_config's kernels do)."""
    return _SM90_HOPPER_BACKWARD.get(head_dim) if arch == "sm90" and dtype != torch.float32 else None


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
        # sparse: suits band-like masks (documents BlockMask fwd+bwd 1.91 -> 1.71 ms); scattered random
        # tiles at 2-5% density lose 5-7% with it (NOTES item 14)
        short_band = span <= SHORT_SPAN and (windowed or varlen or sparse)
        short = _SM90_SHORT_BACKWARD.get(bucket) if short_band else None
        if short is not None:
            cfg = short
        elif causal:
            cfg = _SM90_CAUSAL_BACKWARD.get(bucket, cfg)
        elif windowed:
            # A left bound adds the dK/dV kernel's second edge loop; at 3 stages it then spills
            # (window 1024, d128: 2.9 ms against 1.1 at 2 stages).
            cfg = replace(cfg, stages_kv=min(cfg.stages_kv, 2), edge_stages=None)
    return _halve_for_fp32(cfg, dtype)


# Opt-in autotuning of the forward (autotune.py, FLASHTRITON_AUTOTUNE=1) times these beside the table's choice, on a
# call's own inputs: the portable kernel's tiles of benchmarks/tune.py's sweep (fewer: a first call compiles each),
# and the Gluon kernel's rows of the other span bands plus the table's row with a K/V slot more or fewer, with its
# consumers' turns switched, and with its row reductions as trees or chains switched. Candidates that do not compile
# or fit the GPU's shared memory are skipped. The backward is not tuned: one of its sweep's tiles faulted on an H100
# (benchmarks/NOTES.md 65, 66).
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
        _SM90_HOPPER_FORWARD_SHORT_BAND,
    )
    rows = [band[head_dim] for band in bands if head_dim in band]
    slots = [replace(table, stages=table.stages + d) for d in (-1, 1) if table.stages + d >= 2]
    return [*rows, *slots, replace(table, pingpong=not table.pingpong), replace(table, tree_rows=not table.tree_rows)]


# Tiles of the PyTorch (CPU) path: large enough for efficient matmuls, small enough that the
# per-tile score matrix stays a few MiB per (batch, head).
TORCH_BLOCK_M = 256
TORCH_BLOCK_N = 512
