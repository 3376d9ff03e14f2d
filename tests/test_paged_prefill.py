"""flash_attn_varlen_func with a block_table (paged prefill) on every target: k, v paged caches with shuffled pages,
against the fp64 varlen reference on the same rows packed, and bitwise against the packed call; errors; tracing.

Outputs are NaN-poisoned by conftest (torch.empty fills with NaN), so a row a kernel did not write fails."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import pytest
import torch

from flashtriton import flash_attn_varlen_func
from flashtriton.reference import attention_reference_varlen
from helpers import assert_close_to_reference, target_params


@dataclass(frozen=True)
class Case:
    name: str
    lengths_q: tuple[int, ...]
    lengths_k: tuple[int, ...]
    page_size: int
    max_blocks: int
    heads: int = 4
    heads_k: int = 2
    head_dim: int = 16
    dtype: torch.dtype = torch.float16
    options: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return self.name


def _cases(big: bool) -> list[Case]:
    dim = dict(head_dim=64, heads=8) if big else {}
    return [
        Case("pages-16-crossing-causal", (3, 5, 1), (17, 40, 9), 16, 3, options=dict(causal=True), **dim),
        Case("pages-12-empty-sequence", (4, 0, 6), (30, 0, 6), 12, 3, dtype=torch.float32),
        Case("pages-256-window-gqa", (7, 2), (300, 9), 256, 2, heads=6, heads_k=1, options=dict(window_size=(20, 3))),
        Case("pages-16-prefill-softcap", (40, 33), (40, 48), 16, 4, options=dict(causal=True, softcap=5.0), **dim),
    ]


CASES = target_params({"cpu": _cases(False), "tiny": _cases(False)[:2], "gpu": _cases(True)})


def _cumulative(lengths, device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _inputs(case: Case, device: str):
    """q, packed k and v, the same rows in paged caches (pages shuffled, a spare page of noise), the block table."""
    batch = len(case.lengths_q)
    rows = ((case.lengths_q, case.heads), (case.lengths_k, case.heads_k), (case.lengths_k, case.heads_k))
    q, k, v = (
        torch.randn(sum(lengths), heads, case.head_dim, dtype=case.dtype, device=device) for lengths, heads in rows
    )
    pages = batch * case.max_blocks + 1
    k_cache, v_cache = (
        torch.randn(pages, case.page_size, case.heads_k, case.head_dim, dtype=case.dtype, device=device) for _ in "kv"
    )
    block_table = torch.randperm(pages, device=device)[: batch * case.max_blocks].view(batch, -1).to(torch.int32)
    start = 0
    for b, n in enumerate(case.lengths_k):
        for j in range(n):
            page, row = block_table[b, j // case.page_size], j % case.page_size
            k_cache[page, row], v_cache[page, row] = k[start + j], v[start + j]
        start += n
    return q, k, v, k_cache, v_cache, block_table


@pytest.mark.parametrize("backend, case", CASES, indirect=["backend"])
def test_paged_prefill(backend, case):
    q, k, v, k_cache, v_cache, block_table = _inputs(case, backend.device)
    cu_q, cu_k = _cumulative(case.lengths_q, q.device), _cumulative(case.lengths_k, q.device)
    sizes = max(case.lengths_q), max(case.lengths_k)
    out, lse, _ = flash_attn_varlen_func(
        q, k_cache, v_cache, cu_q, cu_k, *sizes, block_table=block_table, return_attn_probs=True, **case.options
    )
    packed, packed_lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, *sizes, return_attn_probs=True, **case.options)
    assert torch.equal(out, packed) and torch.equal(lse, packed_lse)  # the same rows, the same kernels
    exact, exact_lse = attention_reference_varlen(q, k, v, cu_q, cu_k, **case.options)
    plain, plain_lse = attention_reference_varlen(q, k, v, cu_q, cu_k, compute_dtype=case.dtype, **case.options)
    assert_close_to_reference("out", out, exact, plain)
    assert_close_to_reference("lse", lse, exact_lse, plain_lse)


def test_paged_prefill_errors():
    case = _cases(False)[0]
    q, _, _, k_cache, v_cache, table = _inputs(case, "cpu")
    cu_q, cu_k = _cumulative(case.lengths_q, "cpu"), _cumulative(case.lengths_k, "cpu")

    def call(**changes):
        args = dict(q=q, k=k_cache, v=v_cache, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=40)
        args.update(changes)
        return flash_attn_varlen_func(**{"block_table": table, **args})

    with pytest.raises(TypeError, match="block_table must be int32"):
        call(block_table=table.long())
    with pytest.raises(ValueError, match="one row of page indices per sequence"):
        call(block_table=table[:2])
    with pytest.raises(ValueError, match="pass more pages per sequence"):
        call(max_seqlen_k=49)
    with pytest.raises(ValueError, match=r"\(num_blocks, page_size, nheads_k, headdim\)"):
        call(k=k_cache[0], v=v_cache[0])
    with pytest.raises(ValueError, match="no backward"):
        call(q=q.clone().requires_grad_())
    with pytest.raises(ValueError, match=r"dropout_p=0\.0"):
        call(dropout_p=0.1)
    with pytest.raises(ValueError, match="max_seqlen_k is 20"):  # a sequence longer than it said: values, op time
        call(max_seqlen_k=20)
    padded = table.clone()
    padded[0, 1] = -1  # a padding entry where sequence 0 (17 rows, pages of 16) reads its second page
    with pytest.raises(ValueError, match="1 page entries outside the cache"):
        call(block_table=padded)
    padded[0, 2] = -1  # past sequence 0's rows: never read, so allowed
    padded[0, 1] = table[0, 1]
    call(block_table=padded)
    with pytest.raises(ValueError, match="multiples of 8"):
        call(q=q[..., :12], k=k_cache[..., :12], v=v_cache[..., :12])
    with pytest.raises(TypeError, match="sinks"):
        call(sinks=[0.0] * q.shape[1])


def test_a_block_table_checked_for_one_page_size_is_checked_again_for_another():
    """Which entries a call reads depends on the page size: a table whose padding entry pages of 8 rows never reach
    is refused where pages of 4 read it."""
    table = torch.tensor([[0, -1]], dtype=torch.int32)
    q, cu_q, cu_k = (
        torch.randn(1, 2, 8),
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([0, 5], dtype=torch.int32),
    )
    for page_size, refused in ((8, False), (4, True)):
        k, v = torch.randn(2, page_size, 2, 8), torch.randn(2, page_size, 2, 8)
        with pytest.raises(ValueError, match="1 page entries outside") if refused else contextlib.nullcontext():
            flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, 5, block_table=table)


def test_paged_prefill_traces_fullgraph():
    case = _cases(False)[0]
    q, _, _, k_cache, v_cache, table = _inputs(case, "cpu")
    cu_q, cu_k = _cumulative(case.lengths_q, "cpu"), _cumulative(case.lengths_k, "cpu")

    def call(q, k_cache, v_cache, table):
        return flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 5, 40, causal=True, block_table=table)

    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, k_cache, v_cache, table), call(q, k_cache, v_cache, table))
