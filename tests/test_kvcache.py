"""flash_attn_with_kvcache against the fp64 reference on every target: the cache after the call, exactly, and the
attention over it (gathered into dense K, V here), for every argument; splits against one pass; errors.

Outputs are NaN-poisoned by conftest (torch.empty fills with NaN), so a row a kernel did not write fails."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field, replace

import pytest
import torch

from flashtriton import decode_backend, flash_attn_with_kvcache, interface, route
from flashtriton.kernels import config
from flashtriton.reference import rotary_reference
from helpers import TARGETS, assert_close_to_reference, target_params


@dataclass(frozen=True)
class Case:
    """One call: its shapes and arguments. seqlens: the rows already in each sequence's cache."""

    name: str = "case"
    seqlens: tuple[int, ...] = (5, 27)
    n_q: int = 1
    n_new: int = 1  # 0: no k, v to append
    heads: int = 4
    heads_k: int = 2
    head_dim: int = 16
    capacity: int = 40  # rows per sequence (paged: max_blocks * page_size)
    page_size: int = 0  # 0: a contiguous cache
    batch_cache: int = 0  # > batch: cache_batch_idx picks each sequence's row
    leftpad: tuple[int, ...] | None = None
    rotary_dim: int = 0
    interleaved: bool = True
    int_seqlens: bool = False
    sinks: bool = False  # head 0's sink -inf (none), the others' finite
    dtype: torch.dtype = torch.float16
    options: dict = field(default_factory=dict)  # causal, window_size, softcap, softmax_scale
    alibi: bool = False

    @property
    def batch(self) -> int:
        return len(self.seqlens)

    def __str__(self) -> str:
        return self.name


def _cases(tiny: bool) -> list[Case]:
    big = {} if tiny else dict(heads=8, head_dim=64, capacity=300)
    base = Case(**big)
    two = replace(base, seqlens=(17, 17))
    cases = {
        "append-q1": base,
        "append-q4-causal": replace(base, n_q=4, n_new=4, options=dict(causal=True)),
        "append-2-of-q3": replace(base, n_q=3, n_new=2, dtype=torch.float32),
        "no-append": replace(base, n_new=0, seqlens=(1, 33)),
        "int-seqlens": replace(two, int_seqlens=True, n_q=2, n_new=2, options=dict(causal=True)),
        "rotary-interleaved-causal": replace(base, n_q=2, n_new=2, rotary_dim=8, options=dict(causal=True)),
        "rotary-neox-rows-share": replace(base, n_q=2, n_new=2, rotary_dim=16, interleaved=False),
        "rotary-neox-window": replace(
            base, n_q=3, n_new=3, rotary_dim=12, interleaved=False, options=dict(window_size=(6, 1))
        ),
        "paged-16-crossing": replace(
            base, page_size=16, capacity=64, seqlens=(15, 30), n_new=3, n_q=3, options=dict(causal=True)
        ),
        "paged-256": replace(base, page_size=256, capacity=512, seqlens=(250, 40), n_new=8, n_q=2, heads_k=1),
        # pages that do not divide a tile (the interpreter's tiles of 16, the GPU's of 32-256): an entry per row,
        # tiles over three pages
        "paged-12-leftpad": replace(
            base, page_size=12, capacity=48, leftpad=(10, 20), seqlens=(27, 33), n_new=2, n_q=2
        ),
        # pages too small to read by tile (more than config.DECODE_TILE_PAGES_MAX_READS a tile): an entry per row
        "paged-1": replace(base, page_size=1, capacity=40, seqlens=(21, 36), n_new=2, n_q=2, options=dict(causal=True)),
        # tiles of whole pages (four a tile in the interpreter), read by tile: leftpad and the splits' boundaries
        # move each split's first tile back to a page's first row, and the keys before the split's are masked
        "paged-4-leftpad-window": replace(
            base,
            page_size=4,
            capacity=64,
            leftpad=(3, 10),
            seqlens=(50, 33),
            n_new=2,
            n_q=2,
            options=dict(window_size=(13, 0)),
        ),
        # pages of whole tiles, read by tile (pages of 48 too: a multiple of the tile, not a power of two): the first
        # tile moved back to a tile's first row (leftpad, a window's unaligned first key)
        "paged-48-leftpad-window": replace(
            base,
            page_size=48,
            capacity=144,
            leftpad=(7, 20),
            seqlens=(100, 130),
            n_new=3,
            n_q=2,
            options=dict(window_size=(29, 0)),
        ),
        "paged-32-leftpad-window": replace(
            base,
            page_size=32,
            capacity=128,
            leftpad=(5, 37),
            seqlens=(60, 90),
            n_new=3,
            n_q=2,
            options=dict(window_size=(21, 0)),
        ),
        # by tile too: rows appended past the capacity (dropped), and a table with no pages at all
        "paged-32-past-capacity": replace(
            base, page_size=32, capacity=64, seqlens=(63, 5), n_new=3, n_q=2, options=dict(causal=True)
        ),
        "paged-256-leftpad": replace(
            base, page_size=256, capacity=768, leftpad=(100, 7), seqlens=(400, 300), n_new=4, n_q=1, heads_k=1
        ),
        "leftpad": replace(base, leftpad=(2, 26), n_q=2, n_new=2, options=dict(causal=True)),
        "batch-idx": replace(base, batch_cache=5, n_q=2, n_new=2, rotary_dim=8),
        "gqa-3-window": replace(base, heads=6, heads_k=2, n_q=4, n_new=4, options=dict(window_size=(5, 2))),
        "mqa-softcap-scale": replace(base, heads_k=1, n_q=2, options=dict(softcap=2.0, softmax_scale=-0.4)),
        "softcap-large": replace(base, n_q=2, dtype=torch.float32, options=dict(softcap=1000.0, causal=True)),
        "alibi-causal": replace(base, alibi=True, n_q=3, n_new=1, options=dict(causal=True)),
        "head-dim-20": replace(base, head_dim=20, rotary_dim=12, n_q=2, n_new=2, options=dict(causal=True)),
        "head-dim-256-bf16": replace(base, head_dim=256, heads=2, heads_k=1, n_q=2, dtype=torch.bfloat16),
        "gqa-16-rows-80": replace(base, heads=16, heads_k=1, n_q=5, n_new=5, options=dict(causal=True)),
        "append-20": replace(base, seqlens=(5, 17), n_new=20, n_q=1),
        "sinks-leftpad-causal": replace(base, sinks=True, leftpad=(2, 6), n_q=3, n_new=2, options=dict(causal=True)),
        "sinks-no-keys": replace(base, sinks=True, seqlens=(9, 0), n_new=0, n_q=2, options=dict(causal=True)),
        "rotary-leftpad": replace(base, leftpad=(2, 10), rotary_dim=8, n_q=2, n_new=2, options=dict(causal=True)),
        # a window of the capacity or more is none: no mask, so the queries share one rotary position
        "window-of-capacity": replace(
            base, rotary_dim=8, n_q=2, n_new=2, options=dict(window_size=(base.capacity, base.capacity))
        ),
        # more queries than the capacity + 1 under a left window alone: flash_attn bounds the right at the capacity,
        # which hides the last cache row from the first query
        "left-window-many-queries": replace(
            base, n_q=base.capacity + 2, n_new=0, seqlens=(base.capacity, 9), options=dict(window_size=(30, -1))
        ),
        # sequence 0's second new row lands past the cache: dropped; its second query's rotary position is past the
        # cos / sin table: left unrotated
        "past-capacity": replace(
            base, seqlens=(base.capacity - 1, 3), n_q=2, n_new=2, rotary_dim=8, options=dict(causal=True)
        ),
    }
    return [replace(case, name=name) for name, case in cases.items()]


CASES = {"tiny": _cases(tiny=True), "cpu": _cases(tiny=False)}
# longer caches on the GPU (paged cases keep their tables, past-capacity its overflow)
CASES["gpu"] = [
    c
    if c.page_size or c.name == "past-capacity"
    else replace(c, capacity=c.capacity * 8, seqlens=tuple(8 * n + 1 for n in c.seqlens))
    for c in CASES["cpu"]
]
# a long cache in pages of 256, read by tile, its first tiles moved back to a tile's first row (leftpad)
CASES["gpu"].append(
    replace(
        CASES["cpu"][0], name="paged-256-long-leftpad", page_size=256, capacity=20480, leftpad=(300, 9),
        seqlens=(20000, 7000), n_new=2, n_q=2, options=dict(causal=True),
    )
)  # fmt: skip
# Hopper's deep paged wave (config.DECODE_WAVE_PAGED_DEEP: 3 stages, the block table read by plain loads): D=128,
# splits of 8 tiles, an append crossing a page; a tile's pages by tile (16 rows) and by row (4 rows: more pages than
# the tile reads)
CASES["gpu"] += [
    replace(
        CASES["cpu"][0], name=f"paged-{page}-deep-leftpad", head_dim=128, page_size=page, capacity=32768,
        leftpad=(17, 0), seqlens=(30000, 9001), n_new=3, n_q=2, options=dict(causal=True),
    )
    for page in (16, 4)
]  # fmt: skip


def _gpu_dtype(case: Case, device: str) -> torch.dtype:
    """fp32 runs on the PyTorch path and in the interpreter; the GPU's kernels are tested in bf16 there instead."""
    return torch.bfloat16 if device == "cuda" and case.dtype == torch.float32 else case.dtype


@dataclass
class Inputs:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    kwargs: dict


def _inputs(case: Case, device: str) -> Inputs:
    dtype = _gpu_dtype(case, device)
    batch, d = case.batch, case.head_dim

    def randn(*shape):
        return torch.randn(*shape, device=device).to(dtype)

    kwargs = dict(case.options)
    if case.page_size:
        width = case.capacity // case.page_size
        blocks = batch * width + 3  # spare pages: the table does not cover the cache
        table = torch.randperm(blocks, device=device)[: batch * width].view(batch, width).to(torch.int32)
        shape = (blocks, case.page_size, case.heads_k, d)
        kwargs["block_table"] = table
    else:
        shape = (case.batch_cache or batch, case.capacity, case.heads_k, d)
        if case.batch_cache:
            kwargs["cache_batch_idx"] = torch.randperm(case.batch_cache, device=device)[:batch].to(torch.int32)
    seqlens = torch.tensor(case.seqlens, dtype=torch.int32, device=device)
    kwargs["cache_seqlens"] = case.seqlens[0] if case.int_seqlens else seqlens
    if case.leftpad is not None:
        kwargs["cache_leftpad"] = torch.tensor(case.leftpad, dtype=torch.int32, device=device)
    if case.rotary_dim:
        angles = torch.rand(case.capacity, case.rotary_dim // 2, device=device) * 6.3
        kwargs.update(rotary_cos=angles.cos().to(dtype), rotary_sin=angles.sin().to(dtype))
        kwargs["rotary_interleaved"] = case.interleaved
    if case.alibi:
        kwargs["alibi_slopes"] = torch.rand(batch, case.heads, device=device)
    if case.sinks:
        kwargs["sinks"] = (2 * torch.randn(case.heads, device=device)).index_fill(0, torch.tensor([0], device=device),
                                                                                 float("-inf"))  # fmt: skip
    new = (randn(batch, case.n_new, case.heads_k, d) for _ in range(2)) if case.n_new else (None, None)
    return Inputs(randn(batch, case.n_q, case.heads, d), randn(*shape), randn(*shape), *new, kwargs)


def _dense(x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """A cache as each sequence sees it, (batch, capacity, nheads_k, headdim), gathered by Python loops."""
    table, index = kwargs.get("block_table"), kwargs.get("cache_batch_idx")
    if table is None:
        return x if index is None else torch.stack([x[int(i)] for i in index])
    return torch.stack([torch.cat([x[int(page)] for page in row]) for row in table])


def _seqlens(case: Case) -> list[int]:
    return [case.seqlens[0]] * case.batch if case.int_seqlens else list(case.seqlens)


def _expected(case: Case, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache after the call, with the dense K, V each sequence then sees): the call's append, written
    row by row into copies of the caches."""
    kwargs = inputs.kwargs
    k_cache, v_cache = inputs.k_cache.clone(), inputs.v_cache.clone()
    seqlens = _seqlens(case)
    if inputs.k is not None:
        k_new = inputs.k
        if case.rotary_dim:
            positions = torch.tensor(seqlens, device=k_new.device)[:, None] + torch.arange(
                case.n_new, device=k_new.device
            )
            k_new = rotary_reference(k_new, kwargs["rotary_cos"], kwargs["rotary_sin"], positions, case.interleaved)
        for b in range(case.batch):
            for row, j in ((seqlens[b] + j, j) for j in range(case.n_new)):
                if not 0 <= row < case.capacity:
                    continue  # outside the cache (a negative cache_seqlens puts rows before it): dropped
                if case.page_size:
                    at = (int(kwargs["block_table"][b, row // case.page_size]), row % case.page_size)
                else:
                    at = (int(kwargs["cache_batch_idx"][b]) if case.batch_cache else b, row)
                k_cache[at], v_cache[at] = k_new[b, j], inputs.v[b, j]
    return k_cache, v_cache, _dense(k_cache, kwargs), _dense(v_cache, kwargs)


def _reference(case: Case, inputs: Inputs, k: torch.Tensor, v: torch.Tensor, compute_dtype):
    """out, lse of attention over each sequence's whole dense cache k, v (batch, capacity, nheads_k, headdim) under a
    mask in absolute cache rows, as flash_attn's own kvcache test builds it (not the library's key slices): key row r
    counts iff leftpad <= r < seqlen + n_new and r is in the cache; query i sits at row seqlen + n_new - n_q + i (the
    append's end, whether or not it fit) for causal, the window and ALiBi; a window bound of the capacity or more is
    none, and beside a left bound no right bound is one of the capacity (flash_attn's C++). compute_dtype None: in the
    inputs' dtype (plain attention's error)."""
    kwargs, q = inputs.kwargs, inputs.q
    dtype = compute_dtype or q.dtype
    device, capacity = q.device, case.capacity
    seqlens = torch.tensor(_seqlens(case), device=device)[:, None]
    leftpad = torch.tensor(case.leftpad or [0] * case.batch, device=device)[:, None]
    causal = case.options.get("causal", False)
    left, right = case.options.get("window_size", (-1, -1))
    right = 0 if causal else right
    left, right = (-1 if bound >= capacity else bound for bound in (left, right))
    if left >= 0 and right < 0:
        right = capacity
    if case.rotary_dim:
        step = int(left >= 0 or right >= 0)  # flash_attn's rule: per-row query positions only under a mask
        positions = seqlens + step * torch.arange(case.n_q, device=device)
        q = rotary_reference(q, kwargs["rotary_cos"], kwargs["rotary_sin"], positions, case.interleaved)
    group = case.heads // case.heads_k
    k, v = (x.repeat_interleave(group, dim=2).to(dtype) for x in (k, v))
    scale = case.options.get("softmax_scale") or case.head_dim**-0.5
    scores = torch.einsum("bihd,bjhd->bhij", q.to(dtype), k) * scale
    softcap = case.options.get("softcap", 0.0)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    rows = torch.arange(capacity, device=device)[None, None, :]  # (1, 1, r)
    query_rows = (seqlens + case.n_new - case.n_q + torch.arange(case.n_q, device=device))[:, :, None]  # (b, i, 1)
    if case.alibi:
        slopes = kwargs["alibi_slopes"].to(dtype)[:, :, None, None]
        scores = scores - slopes * (query_rows - rows).abs()[:, None].to(dtype)
    valid = (rows >= leftpad[:, :, None]) & (rows < torch.clamp(seqlens + case.n_new, max=capacity)[:, :, None])
    if right >= 0:
        valid = valid & (rows <= query_rows + right)
    if left >= 0:
        valid = valid & (rows >= query_rows - left)
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (b, h, i); -inf where a row sees no key
    if case.sinks:  # one more logit per row, no value: a row that sees no key has the sink alone
        lse = torch.logaddexp(lse, kwargs["sinks"].to(dtype)[None, :, None])
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhij,bjhd->bihd", probs, v)
    return out, lse.masked_fill(lse.isneginf(), float("inf")).float()


def _call(inputs: Inputs, num_splits: int):
    """The call on copies of the caches: (out, lse, k_cache, v_cache after it)."""
    k_cache, v_cache = inputs.k_cache.clone(), inputs.v_cache.clone()
    out, lse = flash_attn_with_kvcache(
        inputs.q,
        k_cache,
        v_cache,
        inputs.k,
        inputs.v,
        num_splits=num_splits,
        return_softmax_lse=True,
        **inputs.kwargs,
    )
    return out, lse, k_cache, v_cache


def _assert_cache(name: str, actual: torch.Tensor, expected: torch.Tensor, rotated: bool) -> None:
    """Copied rows are exact; rotated ones may differ by the rounding of a fused multiply-add (one ulp)."""
    if not rotated:
        assert torch.equal(actual, expected), f"{name} differs from the expected append"
        return
    ulp = torch.finfo(actual.dtype).eps * expected.abs().amax().item()
    torch.testing.assert_close(actual, expected, rtol=0, atol=ulp, msg=f"{name} differs by more than an ulp")


@pytest.mark.parametrize("backend,case", target_params(CASES), indirect=["backend"])
def test_matches_reference(backend, case):
    """The cache after the call and out, LSE against the fp64 reference, with one pass and with splits."""
    inputs = _inputs(case, backend.device)
    k_cache, v_cache, k, v = _expected(case, inputs)
    exact = _reference(case, inputs, k, v, torch.float64)
    plain = _reference(case, inputs, k, v, None)
    for num_splits in (1, 3):
        out, lse, k_after, v_after = _call(inputs, num_splits)
        _assert_cache("k_cache", k_after, k_cache, rotated=case.rotary_dim > 0)
        _assert_cache("v_cache", v_after, v_cache, rotated=False)
        assert out.dtype == inputs.q.dtype and lse.dtype == torch.float32
        assert_close_to_reference(f"out (splits {num_splits})", out, exact[0], plain[0])
        assert_close_to_reference(f"lse (splits {num_splits})", lse, exact[1], plain[1])


ONE = {
    "tiny": [Case("d16", seqlens=(2, 0), n_q=4, n_new=0)],
    "cpu": [Case("d64", seqlens=(2, 0), n_q=4, n_new=0, head_dim=64)],
    "gpu": [Case("d128", seqlens=(2, 0), n_q=4, n_new=0, head_dim=128, capacity=2000)],
}


@pytest.mark.parametrize("backend,case", target_params(ONE), indirect=["backend"])
def test_rows_without_keys_are_zero_with_infinite_lse(backend, case):
    """Causal with more queries than keys: sequence 0's first two queries and every query of the empty sequence 1
    see no key; out is 0 (not NaN) and the LSE +inf, in one pass and merged from splits (each then empty)."""
    case = replace(case, options=dict(causal=True))
    inputs = _inputs(case, backend.device)
    for num_splits in (1, 4):
        out, lse, _, _ = _call(inputs, num_splits)
        empty = torch.zeros(case.batch, case.n_q, dtype=torch.bool, device=out.device)
        empty[0, :2] = empty[1] = True
        assert torch.equal(out[empty], torch.zeros_like(out[empty]))
        assert torch.isposinf(lse.transpose(1, 2)[empty]).all()
        assert torch.isfinite(lse.transpose(1, 2)[~empty]).all() and not out.isnan().any()


@pytest.mark.parametrize("backend,case", target_params(ONE), indirect=["backend"])
def test_negative_leftpad_counts_as_zero(backend, case):
    """A negative cache_leftpad (device data, never read on the host) starts the keys at row 0: no row before the
    cache is read, and the result is leftpad 0's, bit for bit."""
    case = replace(case, seqlens=(30, 9), n_q=2, n_new=2, leftpad=(-7, 0))
    inputs = _inputs(case, backend.device)
    negative = _call(inputs, 2)
    inputs.kwargs["cache_leftpad"] = torch.zeros_like(inputs.kwargs["cache_leftpad"])
    for a, b in zip(negative, _call(inputs, 2), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend,case", target_params(ONE), indirect=["backend"])
def test_negative_cache_seqlens_see_no_key(backend, case):
    """A negative cache_seqlens (device data, never checked on the host) leaves its sequence no key: out 0 and LSE
    +inf on every path, as a length of 0 gives."""
    inputs = _inputs(replace(case, seqlens=(30, 9), n_q=2, n_new=0), backend.device)
    inputs.kwargs["cache_seqlens"] = torch.tensor([-3, 9], dtype=torch.int32, device=backend.device)
    out, lse, _, _ = _call(inputs, 2)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isposinf(lse[0]).all()
    assert torch.isfinite(lse[1]).all()


@pytest.mark.parametrize("backend,case", target_params(ONE), indirect=["backend"])
def test_rows_appended_before_the_cache_are_dropped_and_stay_unrotated(backend, case):
    """A negative cache_seqlens with an append: the new rows that land before row 0 are dropped as those past the end
    are, the others written and attended; q and k at negative positions stay unrotated. Nothing outside the rotary
    tables' rows is read: the memory before them and their rows past the capacity (no position reaches them) hold
    NaN, so a negative position read from before the table or from its end (Python's indexing) shows."""
    case = replace(case, seqlens=(-2, 9), n_q=2, n_new=3, rotary_dim=8, options=dict(causal=True))
    inputs = _inputs(case, backend.device)
    for name in ("rotary_cos", "rotary_sin"):
        table = inputs.kwargs[name]
        nan = torch.full_like(table[:4], float("nan"))
        inputs.kwargs[name] = torch.cat((nan, table, nan))[4:]
    k_cache, v_cache, k, v = _expected(case, inputs)
    exact, plain = (_reference(case, inputs, k, v, dtype) for dtype in (torch.float64, None))
    out, lse, k_after, v_after = _call(inputs, 2)
    _assert_cache("k_cache", k_after, k_cache, rotated=True)
    _assert_cache("v_cache", v_after, v_cache, rotated=False)
    assert_close_to_reference("out", out, exact[0], plain[0])
    assert_close_to_reference("lse", lse, exact[1], plain[1])
    assert torch.isfinite(lse[0, :, -1]).all()  # the last query sees row 0, appended


@pytest.mark.parametrize("backend,case", target_params(ONE), indirect=["backend"])
def test_a_larger_cache_serves_its_first_rows(backend, case):
    """Without cache_batch_idx a cache of more batch rows than q serves sequence b from its row b (flash_attn's rule
    for a static cache sized for a larger batch); the rows past the batch are neither read nor written."""
    inputs = _inputs(replace(case, seqlens=(30, 9), n_q=2, n_new=2), backend.device)
    expected = _call(inputs, 2)
    spare = torch.full_like(inputs.k_cache[:1], float("nan"))  # read, it would show
    inputs.k_cache, inputs.v_cache = (torch.cat((x, spare, spare)) for x in (inputs.k_cache, inputs.v_cache))
    larger = _call(inputs, 2)
    assert torch.equal(larger[0], expected[0]) and torch.equal(larger[1], expected[1])
    for grown, small in zip(larger[2:], expected[2:], strict=True):
        assert torch.equal(grown[:2], small) and grown[2:].isnan().all()


@pytest.mark.parametrize("backend,case", target_params(ONE), indirect=["backend"])
def test_block_table_entries_past_a_sequences_pages_are_not_read(backend, case):
    """A block table's entries past the pages a sequence uses may hold anything (flash_attn reads only the used
    ones): page numbers past the cache there change nothing."""
    case = replace(case, seqlens=(5, 20), n_q=2, n_new=2, capacity=64, page_size=16)
    inputs = _inputs(case, backend.device)
    expected = _call(inputs, 2)
    table = inputs.kwargs["block_table"].clone()
    table[0, 1:], table[1, 2:] = 10**6, -(10**6)  # sequence 0 uses one page (7 rows), sequence 1 two (22)
    inputs.kwargs["block_table"] = table
    for a, b in zip(_call(inputs, 2), expected, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "index,message",
    [
        ({"cache_batch_idx": [1, 3]}, "cache_batch_idx holds 3"),
        ({"cache_batch_idx": [-1, 0]}, "cache_batch_idx holds -1"),
        ({"block_table": [[0, 1], [2, 9]]}, r"block_table\[1\] lists page 9"),
        ({"block_table": [[0, 1], [-1, 3]]}, r"block_table\[1\] lists page -1"),
    ],
    ids=["batch-idx-past", "batch-idx-negative", "page-past", "page-negative"],
)
def test_the_pytorch_path_refuses_index_values_outside_the_cache_before_writing(index, message, monkeypatch):
    """The PyTorch path reads its index tensors on the host anyway: an entry it would use outside the cache raises a
    ValueError before the append writes a row (Python's indexing would raise half-way, or wrap a negative one)."""
    monkeypatch.setenv("FLASHTRITON_BACKEND", "torch")
    name, value = next(iter(index.items()))
    paged = name == "block_table"
    k_cache = torch.randn(4, 16, 1, 8) if paged else torch.randn(3, 32, 1, 8)
    v_cache = k_cache.clone()
    before = k_cache.clone(), v_cache.clone()
    q, k, v = (torch.randn(2, 1, 1, 8) for _ in range(3))
    with pytest.raises(ValueError, match=message):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([3, 20], dtype=torch.int32),
                                **{name: torch.tensor(value, dtype=torch.int32)})  # fmt: skip
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@pytest.mark.parametrize("backend", TARGETS, indirect=True, ids=str)
def test_a_pool_of_no_pages_reads_nothing(backend):
    """A paged cache of no pages with sequences of no rows: out 0 and LSE +inf on every path."""
    q = torch.randn(2, 1, 2, 16, device=backend.device)
    pages = torch.empty(0, 16, 1, 16, device=backend.device)
    table = torch.zeros(2, 1, dtype=torch.int32, device=backend.device)
    seqlens = torch.zeros(2, dtype=torch.int32, device=backend.device)
    out, lse = flash_attn_with_kvcache(q, pages, pages, cache_seqlens=seqlens, block_table=table,
                                       return_softmax_lse=True)  # fmt: skip
    assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all()


@pytest.mark.parametrize("backend,case", target_params(ONE), indirect=["backend"])
def test_block_table_entries_before_a_left_window_are_not_read(backend, case):
    """Pages wholly before every query's left window bound may be freed (an engine's sliding window): their entries
    may hold anything, on every path."""
    case = replace(case, seqlens=(40, 5), n_q=2, n_new=1, capacity=64, page_size=16,
                   options=dict(causal=True, window_size=(8, 0)))  # fmt: skip
    inputs = _inputs(case, backend.device)
    expected = _call(inputs, 2)
    table = inputs.kwargs["block_table"].clone()
    table[0, 0] = -1  # sequence 0's queries sit at rows 39 and 40: the first key any sees is 31, page 1's last
    inputs.kwargs["block_table"] = table
    for a, b in zip(_call(inputs, 2), expected, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend,case", target_params(ONE), indirect=["backend"])
def test_chosen_splits_and_no_lse_give_the_same_out(backend, case):
    """num_splits=0 (the table's choice: a split cache, one sequence of one K/V head) and return_softmax_lse=False
    agree with explicit splits to rounding."""
    case = replace(case, seqlens=(500,), n_q=2, n_new=2, heads_k=1, capacity=max(case.capacity, 512))
    inputs = _inputs(case, backend.device)
    if backend.name != "cpu-torch":
        assert route.decode(inputs.q, case.capacity, case.heads_k, 0).config.splits > 1
    ours, _, _, _ = _call(inputs, 1)
    chosen, _, _, _ = _call(inputs, 0)
    torch.testing.assert_close(chosen, ours, atol=2e-3, rtol=0)
    k_cache, v_cache = inputs.k_cache.clone(), inputs.v_cache.clone()
    out = flash_attn_with_kvcache(inputs.q, k_cache, v_cache, inputs.k, inputs.v, num_splits=1, **inputs.kwargs)
    assert torch.equal(out, ours)


@pytest.mark.parametrize("backend,case", target_params(ONE), indirect=["backend"])
def test_omitted_seqlens_attend_the_whole_cache_and_slopes_broadcast(backend, case):
    """cache_seqlens=None attends every cache row, as cache_seqlens = the capacity does; alibi_slopes of shape
    (nheads,) act as the same slopes for every sequence."""
    inputs = _inputs(replace(case, n_q=2), backend.device)
    q, k_cache, v_cache = inputs.q, inputs.k_cache, inputs.v_cache
    full = torch.full((q.shape[0],), k_cache.shape[1], dtype=torch.int32, device=q.device)
    slopes = torch.rand(q.shape[2], device=q.device)
    options = dict(causal=True, return_softmax_lse=True)
    omitted = flash_attn_with_kvcache(q, k_cache, v_cache, alibi_slopes=slopes, **options)
    given = flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=full, alibi_slopes=slopes.expand(q.shape[0], -1), **options
    )
    for a, b in zip(omitted, given, strict=True):
        assert torch.equal(a, b)


def test_rotary_reference_is_a_complex_rotation():
    """rotary_reference, the tests' oracle, against rotary as complex multiplication by e^(i angle)."""
    x = torch.randn(2, 3, 4, 10, dtype=torch.float64)
    angles = torch.rand(9, 4, dtype=torch.float64) * 6.3
    positions = torch.randint(0, 9, (2, 3))
    turn = torch.polar(torch.ones_like(angles), angles)[positions][:, :, None, :]  # (2, 3, 1, 4)
    for interleaved in (True, False):
        pairs = x[..., :8].unflatten(-1, (4, 2)) if interleaved else x[..., :8].unflatten(-1, (2, 4)).transpose(-1, -2)
        turned = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * turn)
        turned = turned.flatten(-2) if interleaved else turned.transpose(-1, -2).flatten(-2)
        expected = torch.cat((turned, x[..., 8:]), -1)
        actual = rotary_reference(x, angles.cos(), angles.sin(), positions, interleaved)
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)  # it rotates in fp32


def test_route_decides_the_decode_family_and_splits():
    q = torch.empty(2, 1, 32, 128, device="meta", dtype=torch.bfloat16)
    r = route.decode(q, 8192, 8, 0, gpu="sm90", sms=132)
    assert r.family == route.DECODE and r.config.block_m == 16
    # 16 (sequence, K/V head) pairs on 132 SMs fit one program per SM: the wide tiles, 8 splits (of 64 tiles)
    assert (r.config.splits, r.config.num_stages, r.config.block_n, r.config.num_warps) == (8, 3, 128, 8)
    # 64 x 8 pairs pass 2 per SM: unsplit at 2 stages
    assert route.decode(q.new_empty(64, 1, 32, 128), 8192, 8, 0, gpu="sm90", sms=132).config.splits == 1
    # paged caches split to 4 per SM at 2 stages, or on Hopper from D=128 on to 2 per SM at 3 stages where that leaves
    # each split 8 tiles or more (B2 128k: 16 splits of 128 tiles; at B1 8k, 32 splits of 4 would not)
    assert route.decode(q, 131072, 8, 0, gpu="sm90", sms=132, page_size=16).config.splits == 16
    one = q.new_empty(1, 1, 32, 128)
    for capacity, (splits, stages) in ((8192, (64, 2)), (16384, (32, 3)), (1024, (16, 2))):
        c = route.decode(one, capacity, 8, 0, gpu="sm90", sms=132, page_size=16).config
        assert (c.splits, c.num_stages) == (splits, stages), capacity
    # every split grid is one wave of whole programs per SM, split into chunks of whole tiles as short as that wave
    # allows, each split with a chunk; the wide tiles are Hopper's alone (other GPUs' shared memory holds none), for
    # head dims padded to 128
    shapes = itertools.product(("sm90", "cuda"), (0, 16), (1, 2, 3, 8, 17, 64, 300), (1, 8), (4096, 65536))
    for gpu, paged, batch, heads_k, capacity in shapes:
        many = torch.empty(batch, 1, 32, 128, device="meta", dtype=torch.bfloat16)
        c = route.decode(many, capacity, heads_k, 0, gpu=gpu, sms=132, page_size=paged).config
        programs = batch * heads_k  # one row tile each: 4 or 32 packed rows
        wide = gpu == "sm90" and not paged and programs <= 132
        case = gpu, paged, batch, heads_k, capacity
        assert (c.block_n, c.num_warps) == ((128, 8) if wide else (64, 4)), case
        # paged on Hopper: the contiguous caches' wave where its splits get 8 tiles or more
        tiles = capacity // c.block_n
        deep = gpu == "sm90" and paged and programs <= 2 * 132
        deep = deep and tiles // config.whole_splits(tiles, min(2 * 132 // programs, config.DECODE_MAX_SPLITS)) >= 8
        assert c.num_stages == (3 if (not paged or deep) and programs <= 2 * 132 else 2), case
        per_sm = 4 if paged and not deep else 1 if wide else 2
        room = min(per_sm * 132 // programs, config.DECODE_MAX_SPLITS)
        chunk = -(-tiles // c.splits)
        assert c.splits == -(-tiles // chunk), case  # no split without a tile
        shorter = chunk == 1 or -(-tiles // (chunk - 1)) > room  # a shorter chunk would need more splits than room
        assert programs > per_sm * 132 or (c.splits <= room and shorter), case
        assert programs <= per_sm * 132 or c.splits == 1, case
        # per_sm programs fit an SM's 64K registers together: capped where that is under a thread's 255
        assert c.max_registers == (128 if paged else None), case
    for head_dim, block_n in ((64, 128), (96, 128), (256, 32)):  # wide for small grids only where D pads to 128
        c = route.decode(q.new_empty(2, 1, 32, head_dim), 8192, 8, 0, gpu="sm90", sms=132).config
        assert c.block_n == block_n, head_dim
    # D=64: wide (256-row) tiles for grids past 2 per SM over long caches, contiguous or in pages of whole tiles, on
    # Hopper alone, split into waves of one program per SM that keep 95% of the SMs busy: 512 programs are 3.88
    # waves, 448 are 3.39 (split in two: 6.79), 320 are 2.42 (4.85)
    for batch, capacity, paged, gpu, splits in (
        (64, 32768, 0, "sm90", 1), (56, 32768, 0, "sm90", 2), (40, 131072, 0, "sm90", 2), (48, 32768, 0, "sm90", 1),
        (64, 16384, 0, "sm90", 0), (64, 32768, 16, "sm90", 0), (64, 32768, 0, "cuda", 0), (16, 131072, 0, "sm90", 0),
        (64, 32768, 256, "sm90", 1), (40, 131072, 512, "sm90", 2), (64, 32768, 128, "sm90", 0),
        (64, 16384, 256, "sm90", 0), (64, 32768, 256, "cuda", 0),
    ):  # fmt: skip
        many = q.new_empty(batch, 1, 32, 64)
        c = route.decode(many, capacity, 8, 0, gpu=gpu, sms=132, page_size=paged).config
        wide = (c.block_n, c.num_warps, c.num_stages, c.max_registers) == (256, 8, 3, None)
        assert (wide, c.splits if wide else 0) == (splits > 0, splits), (batch, capacity, paged, gpu)
        assert not wide or c.tile_pages == (paged > 0)  # a tile's page by one block-table read
    # D=128's wide tiles stay contiguous caches': over pages (even of whole tiles) no better than the paged wave
    two = q.new_empty(2, 1, 32, 128)
    assert route.decode(two, 32768, 8, 0, gpu="sm90", sms=132).config.block_n == 128
    assert route.decode(two, 32768, 8, 0, gpu="sm90", sms=132, page_size=256).config.block_n == 64
    assert config.full_waves(133, 1, 132, 0.95) == 1  # a split needs a tile
    assert config.full_waves(133, 5, 132, 0.95) == 3  # 4 splits of 5 tiles would leave one without
    assert config.full_waves(133, 2**20, 132, 0.95) == 4  # none reaches the fill: the fullest (532 of 660)
    fp32 = route.decode(q.new_empty(2, 1, 32, 128, dtype=torch.float32), 8192, 8, 0, gpu="sm90", sms=132).config
    assert (fp32.block_n, fp32.num_warps) == (32, 4)  # no wide tiles: fp32 halves the table's
    # a short cache: a tile per split at least, and no split without one (128 tiles in up to 33 splits: 32 of 4);
    # a caller's count capped at the cache's tiles
    assert route.decode(q, 300, 8, 0, gpu="sm90", sms=132).config.splits == 3
    assert route.decode(q.new_empty(1, 1, 32, 64), 16384, 8, 0, gpu="sm90", sms=132).config.splits == 32
    assert [config.whole_splits(128, most) for most in (1, 32, 33, 43, 64, 200)] == [1, 32, 32, 43, 64, 128]
    # paged: a tile's pages by tile where pages and tiles divide one another, up to
    # config.DECODE_TILE_PAGES_MAX_READS (8) pages a tile, at any length (D=128's tiles of 64: pages of 8 are 8 reads,
    # of 4 sixteen; D=64's of 128: pages of 8 are 16); else an entry per row (pages of 12 or 48 divide no tile)
    assert config.DECODE_TILE_PAGES_MAX_READS == 8
    for head_dim, capacity in itertools.product((128, 64), (4096, 131072)):
        one = q.new_empty(2, 1, 32, head_dim)
        by_tile = {16, 32, 256, 768} | ({8} if head_dim == 128 else set())
        for page in (4, 8, 12, 16, 32, 48, 256, 768):
            c = route.decode(one, capacity, 8, 0, gpu="sm90", sms=132, page_size=page).config
            assert c.block_n == {128: 64, 64: 128}[head_dim] and c.tile_pages == (page in by_tile), (head_dim, page)
    assert not route.decode(q, 131072, 8, 0, gpu="sm90", sms=132).config.tile_pages
    # the interpreter's tiles of 16 (CI's paged cases): pages of 2-8, 16, 32, 48 and 256 by tile, of 1 and 12 by row
    for page in (1, 2, 4, 8, 12, 16, 32, 48, 256):
        c = config.decode_config("interpreter", 16, torch.float32, 2, 4, 96 * page, 4, 0, page)
        assert c.block_n == 16 and c.tile_pages == (page not in (1, 12)), page
    # the caller's count as given, capped at the tiles: 1000 rows are 8 wide tiles
    assert route.decode(q, 1000, 8, 3, gpu="sm90", sms=132).config.splits == 3
    assert route.decode(q, 1000, 8, 64, gpu="sm90", sms=132).config.splits == 8
    assert route.decode(q[:0], 100, 8, 0, gpu="sm90").family == route.NONE
    assert config.decode_config("sm90", 128, torch.bfloat16, 4 * 16, 1, 8192, 132, 1).block_m == 64


def test_decode_route_is_remembered_per_shape_and_backend(monkeypatch):
    """route.decode keeps a call's route by shape, dtype, device, cache and backend variable: the same call gets the
    same Route back, a changed FLASHTRITON_BACKEND a new decision."""
    monkeypatch.setattr(route, "_ROUTES", {})
    q = torch.randn(2, 1, 4, 16, dtype=torch.float16)
    monkeypatch.setenv(route.BACKEND_ENV, "torch")
    first = route.decode(q, 64, 2, 0)
    assert first.family == route.TORCH and route.decode(q.clone(), 64, 2, 0) is first
    monkeypatch.setenv(route.BACKEND_ENV, "triton")
    if route.interpreting():
        assert route.decode(q, 64, 2, 0).family == route.DECODE
    assert len(route._ROUTES) == 1 + route.interpreting()


def _errors_inputs():
    q = torch.randn(2, 1, 4, 16)
    cache = torch.randn(2, 32, 2, 16)
    return q, cache, cache.clone()


ERRORS = {
    "cache-rank": (lambda q, kc, vc: (q, kc[0], vc), {}, ValueError, "must have 4 dims"),
    "cache-dtype": (lambda q, kc, vc: (q, kc.half(), vc), {}, ValueError, "one dtype"),
    "head-dim": (lambda q, kc, vc: (q[..., :8], kc, vc), {}, ValueError, "head dim"),
    "gqa": (lambda q, kc, vc: (q[:, :, :3], kc, vc), {}, ValueError, "multiple of k_cache heads"),
    "cache-batch": (lambda q, kc, vc: (q, kc[:1], vc[:1]), {}, ValueError, "pass cache_batch_idx"),
    "seqlen-q-0": (lambda q, kc, vc: (q[:, :0], kc, vc), {}, ValueError, "seqlen_q = 0"),
    "no-heads": (lambda q, kc, vc: (q[:, :, :0], kc, vc), {}, ValueError, "0 heads"),
    "k-dtype": (
        lambda q, kc, vc: (q, kc, vc, torch.randn(2, 1, 2, 16).half(), torch.randn(2, 1, 2, 16)),
        {"cache_seqlens": 3},
        ValueError,
        "pass k.to",
    ),
    "batch-idx-int64": (
        lambda q, kc, vc: (q, kc, vc),
        {"cache_batch_idx": torch.zeros(2, dtype=torch.long)},
        TypeError,
        "cache_batch_idx must be int32",
    ),
    "block-table-rows": (
        lambda q, kc, vc: (q, kc, vc),
        {"block_table": torch.zeros(3, 2, dtype=torch.int32)},
        ValueError,
        "one per sequence",
    ),
    "cache-stride": (
        lambda q, kc, vc: (q, kc.transpose(-1, -2).contiguous().transpose(-1, -2), vc),
        {},
        ValueError,
        "contiguous last dim",
    ),
    "k-without-v": (
        lambda q, kc, vc: (q, kc, vc, torch.randn(2, 1, 2, 16)),
        {"cache_seqlens": 3},
        ValueError,
        "both k and v",
    ),
    "k-shape": (
        lambda q, kc, vc: (q, kc, vc, torch.randn(2, 1, 4, 16), torch.randn(2, 1, 4, 16)),
        {"cache_seqlens": 3},
        ValueError,
        "seqlen_new, nheads_k",
    ),
    "k-without-seqlens": (
        lambda q, kc, vc: (q, kc, vc, torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)),
        {},
        ValueError,
        "pass cache_seqlens",
    ),
    "append-past-capacity": (
        lambda q, kc, vc: (q, kc, vc, torch.randn(2, 2, 2, 16), torch.randn(2, 2, 2, 16)),
        {"cache_seqlens": 31},
        ValueError,
        "does not fit",
    ),
    "append-longer-than-cache": (  # a tensor cache_seqlens is not read, but the shapes alone cannot fit
        lambda q, kc, vc: (q, kc, vc, torch.randn(2, 33, 2, 16), torch.randn(2, 33, 2, 16)),
        {"cache_seqlens": torch.zeros(2, dtype=torch.int32)},
        ValueError,
        "pass at most 32 new rows",
    ),
    "seqlens-int64": (lambda q, kc, vc: (q, kc, vc), {"cache_seqlens": torch.tensor([1, 2])}, TypeError, "int32"),
    "seqlens-batch": (
        lambda q, kc, vc: (q, kc, vc),
        {"cache_seqlens": torch.tensor([1], dtype=torch.int32)},
        ValueError,
        "one per sequence",
    ),
    "seqlens-float": (lambda q, kc, vc: (q, kc, vc), {"cache_seqlens": 2.0}, TypeError, "an int or"),
    "seqlens-0-d": (
        lambda q, kc, vc: (q, kc, vc),
        {"cache_seqlens": torch.tensor(3, dtype=torch.int32)},
        ValueError,
        "must have 1 dims",
    ),
    "leftpad-0-d": (
        lambda q, kc, vc: (q, kc, vc),
        {"cache_seqlens": 3, "cache_leftpad": torch.tensor(1).int()},
        ValueError,
        "must have 1 dims",
    ),
    "block-table-empty": (
        lambda q, kc, vc: (q, kc, vc),
        {"block_table": torch.zeros(2, 0, dtype=torch.int32), "cache_seqlens": 0},
        ValueError,
        "lists no pages",
    ),
    "block-table-int64": (
        lambda q, kc, vc: (q, kc, vc),
        {"block_table": torch.zeros(2, 2, dtype=torch.long)},
        TypeError,
        "block_table must be int32",
    ),
    "block-table-with-batch-idx": (
        lambda q, kc, vc: (q, kc, vc),
        {"block_table": torch.zeros(2, 2, dtype=torch.int32), "cache_batch_idx": torch.zeros(2, dtype=torch.int32)},
        ValueError,
        "does not combine with block_table",
    ),
    "leftpad-device-shape": (
        lambda q, kc, vc: (q, kc, vc),
        {"cache_leftpad": torch.zeros(2, 1, dtype=torch.int32)},
        ValueError,
        "must have 1 dims",
    ),
    "rotary-without-k": (
        lambda q, kc, vc: (q, kc, vc),
        {"rotary_cos": torch.ones(32, 4), "rotary_sin": torch.ones(32, 4)},
        ValueError,
        "need k and v",
    ),
    "rotary-short": (
        lambda q, kc, vc: (q, kc, vc, torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)),
        {"cache_seqlens": 1, "rotary_cos": torch.ones(8, 4), "rotary_sin": torch.ones(8, 4)},
        ValueError,
        "at least 32",
    ),
    "rotary-wide": (
        lambda q, kc, vc: (q, kc, vc, torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)),
        {"cache_seqlens": 1, "rotary_cos": torch.ones(32, 9), "rotary_sin": torch.ones(32, 9)},
        ValueError,
        "rotary_dim",
    ),
    "rotary-one": (
        lambda q, kc, vc: (q, kc, vc, torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)),
        {"cache_seqlens": 1, "rotary_cos": torch.ones(32, 4)},
        ValueError,
        "both rotary_cos and rotary_sin",
    ),
    "num-splits": (lambda q, kc, vc: (q, kc, vc), {"num_splits": 129}, ValueError, "num_splits must be"),
    "window": (lambda q, kc, vc: (q, kc, vc), {"window_size": (-2, 0)}, ValueError, "window_size"),
    "softcap": (lambda q, kc, vc: (q, kc, vc), {"softcap": -1.0}, ValueError, "softcap"),
    "alibi": (lambda q, kc, vc: (q, kc, vc), {"alibi_slopes": torch.ones(3)}, ValueError, "alibi_slopes"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_bad_input_says_the_fix_before_any_launch(name, monkeypatch):
    def launched(*args, **kwargs):
        raise AssertionError("a backend was chosen for invalid input")

    monkeypatch.setattr(route, "decode", launched)
    make, kwargs, error, message = ERRORS[name]
    with pytest.raises(error, match=message):
        flash_attn_with_kvcache(*make(*_errors_inputs()), **kwargs)


@pytest.mark.parametrize("backend", TARGETS, indirect=True, ids=str)
def test_compiles_without_graph_breaks_and_mutates_the_cache(backend):
    """torch.compile(fullgraph=True) traces the op (aot_eager on CPU, as test_compile.py), sinks included: the same
    out and cache."""
    case = Case(seqlens=(4, 20), n_q=2, n_new=2, rotary_dim=8, sinks=True, options=dict(causal=True))
    inputs = _inputs(case, backend.device)

    def step(q, k_cache, v_cache, k, v):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, num_splits=2, **inputs.kwargs)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if backend.device == "cpu" else "inductor")
    caches = [(inputs.k_cache.clone(), inputs.v_cache.clone()) for _ in range(2)]
    eager = step(inputs.q, *caches[0], inputs.k, inputs.v)
    traced = compiled(inputs.q, *caches[1], inputs.k, inputs.v)
    assert torch.equal(traced, eager)
    assert torch.equal(caches[1][0], caches[0][0]) and torch.equal(caches[1][1], caches[0][1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_graph_replays_decode_steps_with_new_lengths():
    """A decode step captured once replays with cache_seqlens updated in place (no host read in the call)."""
    case = Case(
        "graph",
        seqlens=(100, 900),
        n_q=1,
        n_new=1,
        heads=8,
        heads_k=2,
        head_dim=128,
        capacity=2048,
        page_size=256,
        rotary_dim=64,
        dtype=torch.bfloat16,
        options=dict(causal=True),
    )
    inputs = _inputs(case, "cuda")
    kwargs = dict(inputs.kwargs)
    seqlens = kwargs.pop("cache_seqlens")
    k_cache, v_cache = inputs.k_cache.clone(), inputs.v_cache.clone()

    def step():
        return flash_attn_with_kvcache(inputs.q, k_cache, v_cache, inputs.k, inputs.v, cache_seqlens=seqlens, **kwargs)

    step()  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for lengths in ((7, 1500), (2000, 0)):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        saved = k_cache.clone(), v_cache.clone()
        graph.replay()
        replayed = out.clone(), k_cache.clone(), v_cache.clone()
        k_cache.copy_(saved[0])
        v_cache.copy_(saved[1])
        eager = step()
        assert torch.equal(replayed[0], eager)
        assert torch.equal(replayed[1], k_cache) and torch.equal(replayed[2], v_cache)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_decode_kernels_wait_for_the_previous_grid_first(monkeypatch):
    """On Hopper the decode kernels launch with programmatic dependent launch, their programs placed while the kernel
    before them finishes: each waits for it (griddepcontrol.wait) before its first global memory access, the append
    kernel's writes to the cache and the split kernel's reads of it included."""
    if route.arch(torch.device("cuda")) != "sm90":
        pytest.skip("PDL is Hopper's (and needs the tested Triton's private API)")
    launchers = decode_backend._APPEND, decode_backend._SPLIT, decode_backend._COMBINE
    for launcher in launchers:
        monkeypatch.setattr(launcher, "kernels", {})
    monkeypatch.setattr(decode_backend, "_PLANS", {})
    monkeypatch.setattr(decode_backend, "_SIGNED", {})
    q = torch.randn(2, 1, 8, 64, dtype=torch.bfloat16, device="cuda")
    k_cache, v_cache = (torch.randn(2, 512, 2, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    k, v = (torch.randn(2, 1, 2, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    seqlens = torch.tensor([100, 300], dtype=torch.int32, device="cuda")
    flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, num_splits=4)
    for launcher in launchers:
        (kernel,) = launcher.kernels.values()
        assert kernel.metadata.launch_pdl, launcher.fn.__name__
        before, _, _ = kernel.asm["ptx"].partition("griddepcontrol.wait")
        assert before != kernel.asm["ptx"], launcher.fn.__name__
        assert not re.search(r"\b(ld|st|atom|red)\.global|cp\.async", before), launcher.fn.__name__


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("head_dim,seqlen_q,causal", [(64, 1, False), (64, 4, True), (128, 1, False), (128, 4, True)])
def test_paged_split_kernels_fit_their_wave_and_pipeline(head_dim, seqlen_q, causal, monkeypatch):
    """A paged call's split kernel keeps within the registers that let its wave's programs share an SM
    (config.wave_registers), under a cap only where it would take more without one: held to a cap it need not
    reach, ptxas spills anyway. Past 2 stages, each step waits for its own tile's copies alone, the next tile's
    still in flight: the block table's entries come by plain loads (decode.table_entries), where as copies
    committed after the K/V tiles' every step had waited for all of them."""
    monkeypatch.setattr(decode_backend, "_PLANS", {})
    monkeypatch.setattr(decode_backend, "_SIGNED", {})
    monkeypatch.setattr(decode_backend._SPLIT, "kernels", {})
    batch, length, page = 8, 4096, 16
    q = torch.randn(batch, seqlen_q, 32, head_dim, dtype=torch.bfloat16, device="cuda")
    k_cache, v_cache = (torch.randn(batch * length // page, page, 8, head_dim, dtype=torch.bfloat16, device="cuda")
                        for _ in range(2))  # fmt: skip
    table = torch.randperm(batch * length // page, device="cuda").to(torch.int32).view(batch, -1)
    seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, causal=causal)
    cfg = route.decode(q, length, 8, 0, page_size=page).config
    (kernel,) = decode_backend._SPLIT.kernels.values()
    capped = kernel.metadata.maxnreg == cfg.max_registers
    assert cfg.max_registers is not None and kernel.n_regs <= cfg.max_registers
    if not capped:
        assert kernel.n_spills == 0
    if head_dim == 64:  # measured: 114-128 registers without a cap, which at 128 spilled 22 values in the loop
        assert not capped
    assert cfg.num_stages == (3 if head_dim == 128 and route.arch(q.device) == "sm90" else 2)
    if cfg.num_stages > 2:
        loop = kernel.asm["ttgir"].split("scf.for", 1)[1]
        assert int(re.search(r"ttg\.async_wait [^\n]*\{num = (\d+)", loop).group(1)) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("page_size", [0, 256, 512])
def test_wide_tiles_read_contiguous_caches_and_pages_of_whole_tiles(page_size, monkeypatch):
    """Hopper's D=64 wide tiles (config._DECODE_WIDE: 256 rows, 8 warps, one program per SM), which a small grid
    takes on a GPU pretended to have one SM: over a contiguous cache and over pages of whole tiles (a tile's page by
    one block-table read), with leftpad starting a sequence inside a tile, appends crossing a tile and a causal q2,
    the cache and out, LSE against the fp64 reference, in the splits the waves choose and in given ones."""
    if route.arch(torch.device("cuda")) != "sm90":
        pytest.skip("the wide tiles are Hopper's")
    monkeypatch.setattr(route, "sm_count", lambda device: 1)
    monkeypatch.setattr(config, "DECODE_WIDE_MIN_CAPACITY", 1024)
    for name, module in (("_ROUTES", route), ("_PLANS", decode_backend), ("_SIGNED", decode_backend)):
        monkeypatch.setattr(module, name, {})  # the routes and plans made here hold the pretended SM count
    case = replace(
        CASES["cpu"][0], name="wide", heads=8, heads_k=2, head_dim=64, page_size=page_size, capacity=2048,
        seqlens=(1790, 700, 255), leftpad=(300, 0, 5), n_new=3, n_q=2, options=dict(causal=True),
    )  # fmt: skip
    inputs = _inputs(case, "cuda")
    cfg = route.decode(inputs.q, case.capacity, case.heads_k, 0, page_size=page_size).config
    assert (cfg.block_n, cfg.num_warps, cfg.tile_pages) == (256, 8, page_size > 0)
    k_cache, v_cache, k, v = _expected(case, inputs)
    exact = _reference(case, inputs, k, v, torch.float64)
    plain = _reference(case, inputs, k, v, None)
    for num_splits in (0, 1, 3):
        out, lse, k_after, v_after = _call(inputs, num_splits)
        _assert_cache("k_cache", k_after, k_cache, rotated=False)
        _assert_cache("v_cache", v_after, v_cache, rotated=False)
        assert_close_to_reference(f"out (splits {num_splits})", out, exact[0], plain[0])
        assert_close_to_reference(f"lse (splits {num_splits})", lse, exact[1], plain[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("via", ["signature", "layout"])
@pytest.mark.parametrize("case", CASES["gpu"], ids=str)
def test_replayed_calls_match_recorded_ones(case, via, monkeypatch):
    """A second call of a layout replays the first's launches (decode_backend's plan) with its own tensors, found by
    the API's signature of the call (a plain call: a tensor cache_seqlens, no ALiBi or sinks) or by the backend's
    layout key: out, LSE and the caches bitwise those of the same call recorded afresh."""
    monkeypatch.setattr(decode_backend, "_PLANS", {})
    monkeypatch.setattr(decode_backend, "_SIGNED", {})
    if via == "layout":
        monkeypatch.setattr(interface, "_kvcache_signature", lambda *args: None)
    signed = int(via == "signature" and not (case.int_seqlens or case.alibi or case.sinks))
    torch.manual_seed(0)
    _call(_inputs(case, "cuda"), 0)  # records
    assert (len(decode_backend._PLANS), len(decode_backend._SIGNED)) == (1, signed)
    torch.manual_seed(1)
    inputs = _inputs(case, "cuda")
    replays = []
    replay = decode_backend.replay
    monkeypatch.setattr(decode_backend, "replay", lambda *args: replays.append(replay(*args)) or replays[-1])
    replayed = _call(inputs, 0)
    assert (len(decode_backend._PLANS), len(decode_backend._SIGNED)) == (1, signed)
    assert [made is not None for made in replays] == [True] * signed
    monkeypatch.setattr(decode_backend, "_plan_key", lambda *args: None)
    monkeypatch.setattr(decode_backend, "_SIGNED", {})
    recorded = _call(inputs, 0)
    for name, a, b in zip(("out", "lse", "k_cache", "v_cache"), replayed, recorded, strict=True):
        assert torch.equal(a, b), f"{name} of the replay differs"


def _signature(inputs: Inputs, **changes):
    """interface._kvcache_signature of _call's call, with some arguments changed."""
    args = dict(q=inputs.q, k_cache=inputs.k_cache, v_cache=inputs.v_cache, k=inputs.k, v=inputs.v)
    args.update({name: inputs.kwargs.get(name) for name in _SIGNED_TENSORS})
    options = dict(softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                   alibi_slopes=None, num_splits=0, return_softmax_lse=True, sinks=None)  # fmt: skip
    options.update({name: value for name, value in inputs.kwargs.items() if name in options})
    for name, value in changes.items():
        (options if name in options else args)[name] = value
    return interface._kvcache_signature(*args.values(), tuple(options.values()))


_SIGNED_TENSORS = ("rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table")


def test_a_signature_holds_every_layout_and_option_and_only_plain_calls_have_one(monkeypatch):
    """Calls of one signature replay one plan without checks: any difference in a tensor's shape, strides, dtype,
    alignment, device or identity with another, or in an option, must give another signature; calls whose launches
    would see other tensors than the caller's (int cache_seqlens, made a tensor per call; copies of non-contiguous
    index tensors), ALiBi, sinks or options of other types get none."""
    torch.manual_seed(0)
    case = replace(CASES["cpu"][0], rotary_dim=8, page_size=16, capacity=64, seqlens=(15, 30))
    inputs = _inputs(case, "cpu")
    same = _signature(_inputs(case, "cpu"))
    assert same is not None and _signature(inputs) == same  # other tensors of the same layout
    seqlens, table = inputs.kwargs["cache_seqlens"], inputs.kwargs["block_table"]
    differ = {
        "q's shape": dict(q=inputs.q[:, :, :2]),
        "q's strides": dict(q=inputs.q.repeat_interleave(2, dim=2)[:, :, ::2]),
        "q's dtype": dict(q=inputs.q.float()),
        "k's alignment": dict(k=torch.empty(inputs.k.numel() + 1, dtype=inputs.k.dtype)[1:].view(inputs.k.shape)),
        "v_cache is k_cache": dict(v_cache=inputs.k_cache),
        "no new rows": dict(k=None, v=None),
        "a leftpad": dict(cache_leftpad=seqlens.clone()),
        "the table's width": dict(block_table=table[:, :2].contiguous()),
        "causal": dict(causal=True),
        "a window": dict(window_size=[3, 0]),
        "softcap": dict(softcap=1.5),
        "scale": dict(softmax_scale=0.5),
        "neox rotary": dict(rotary_interleaved=False),
        "splits": dict(num_splits=2),
        "no lse": dict(return_softmax_lse=False),
    }
    signatures = {why: _signature(inputs, **changes) for why, changes in differ.items()}
    for why, signature in signatures.items():
        assert signature is not None and signature != same, why
    assert len(set(signatures.values())) == len(signatures)
    none = {
        "int cache_seqlens": dict(cache_seqlens=27),
        "strided cache_seqlens": dict(cache_seqlens=torch.zeros(4, dtype=torch.int32)[::2]),
        "a strided table": dict(block_table=table.t().contiguous().t()),  # copied per call: the replay would not be
        "strided rotary": dict(rotary_cos=inputs.kwargs["rotary_cos"][::2]),
        "ALiBi": dict(alibi_slopes=torch.rand(case.heads)),
        "sinks": dict(sinks=torch.zeros(case.heads)),
        "a tensor window": dict(window_size=torch.tensor([3, 0])),
        "an int causal": dict(causal=1),
        "a Parameter": dict(v_cache=torch.nn.Parameter(inputs.v_cache, requires_grad=False)),
    }
    for why, changes in none.items():
        assert _signature(inputs, **changes) is None, why
    monkeypatch.setenv(route.BACKEND_ENV, "torch")  # another backend may take the call
    assert _signature(inputs) not in (None, same)
