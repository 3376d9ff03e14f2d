"""The decode suite's cases (``flashtriton bench --suite decode``): one step of decoding against a KV cache.

One table, every combination of its axes: batch 1, 8, 64; cache length 1k, 4k, 32k, 128k; 32 query heads on 8 K/V
heads; D 128 and 64; seqlen_q 1, and 4 causal (speculative decoding's draft tokens, aligned bottom-right); a
contiguous cache, or pages of 16 or 256 rows in a shuffled block table; bf16. The whole cache is attended
(cache_seqlens = its length, nothing appended), so a call reads K and V once: measured as bandwidth, with the device
time and the host time per call.

A case holds its cache twice (ours, and the peers' dense copy); one over MEMORY_BUDGET is skipped, named in
results.json and in the output: B64 L128k D128 (34 GB of cache, 69 GB held) in each seqlen_q and layout.

Peers: cuDNN SDPA and SDPA's FlashAttention-2 backend (enable_gqa) on contiguous (B, H_KV, L, D) copies of the cache,
their best ordinary setup (paged cases too: neither reads a block table), and FlexAttention compiled for the shape.

On a GPU: 138 cases (144, 6 skipped), most of their time the device timer's, FlexAttention's compiles (one per
shape, its layouts share it) and the host time (blocks of decode_calls.HOST_CALLS calls; a large cache's are
device-bound); the README says how long a run took. PARTS parts: --part 1/5, then --part 2/5 --resume
.../results.json, and so on (a part cut short resumes like any run). Without a GPU: a tiny case per seqlen_q and
layout on the CPU (the PyTorch path), SDPA's default as the peer that runs there.
"""

from __future__ import annotations

import itertools

from .cases import OURS, DecodeCase

BATCHES = (1, 8, 64)
CACHE_LENS = (1024, 4096, 32768, 131072)
HEADS, HEADS_K = 32, 8
HEAD_DIMS = (128, 64)
QUERIES = (1, 4)  # seqlen_q; more than one is causal
PAGE_SIZES = (0, 16, 256)  # 0: a contiguous cache
MEMORY_BUDGET = 40 * 10**9  # bytes of K and V a case holds: our cache and the peers' dense copy
PARTS = 5  # --part K/PARTS on a GPU: each under 10 minutes (the module's docstring)

CUDNN, FLASH, FLEX, SDPA = "sdpa-cudnn", "sdpa-flash", "flex", "sdpa"
QUICK = {"batch": 8, "cache_len": 32768, "head_dim": 128}  # --quick: this shape in every seqlen_q and layout


def _case(batch, cache_len, heads, heads_k, head_dim, seqlen_q, page_size, peers, dtype) -> DecodeCase:
    causal = seqlen_q > 1
    return DecodeCase(batch, cache_len, heads, heads_k, head_dim, seqlen_q, causal, page_size, (OURS, *peers), dtype)


def all_gpu_cases(dtype: str = "bfloat16") -> list[DecodeCase]:
    """The table, in order: a shape's layouts side by side (one part holds them, FlexAttention compiles it once)."""
    axes = itertools.product(HEAD_DIMS, QUERIES, BATCHES, CACHE_LENS, PAGE_SIZES)
    return [_case(b, n, HEADS, HEADS_K, d, q, page, (CUDNN, FLASH, FLEX), dtype) for d, q, b, n, page in axes]


def held_bytes(case: DecodeCase) -> int:
    """K and V a case holds at once: our cache and the peers' dense copy of it."""
    return 2 * case.kv_bytes


def within_budget(cases: list[DecodeCase], budget: int = MEMORY_BUDGET) -> tuple[list[DecodeCase], dict[str, str]]:
    """(the cases that fit the budget, {skipped case's name: why})."""
    fits = [c for c in cases if held_bytes(c) <= budget]
    why = {c.name: f"K and V held {held_bytes(c) / 1e9:.1f} GB, over the {budget / 1e9:.0f} GB budget" for c in cases}
    return fits, {c.name: why[c.name] for c in cases if c not in fits}


def gpu_cases(dtype: str = "bfloat16") -> tuple[list[DecodeCase], dict[str, str]]:
    """The suite on a GPU: the table's cases within the memory budget, and the skipped ones with why."""
    return within_budget(all_gpu_cases(dtype))


def quick(cases: list[DecodeCase]) -> list[DecodeCase]:
    """--quick on a GPU: one shape in every seqlen_q and layout."""
    return [c for c in cases if all(getattr(c, key) == value for key, value in QUICK.items())]


def cpu_cases(dtype: str = "float32") -> list[DecodeCase]:
    """A tiny case per seqlen_q and layout for a CPU (a cache of two 256-row pages): SDPA's default, which runs
    there, beside the GPU peers."""
    peers = (SDPA, CUDNN, FLASH, FLEX)
    return [_case(2, 512, 4, 2, 16, q, page, peers, dtype) for q in QUERIES for page in PAGE_SIZES]


def unit(case: DecodeCase) -> tuple:
    """The cases --part keeps together: a shape's layouts."""
    return case.head_dim, case.seqlen_q, case.batch, case.cache_len
