"""The PyTorch path of flash_attn_with_kvcache: CPU tensors, fp32, FLASHTRITON_BACKEND=torch.

Readable rather than fast: the append is one indexed write; the attention gathers each sequence's keys into dense
K, V and runs the reference (reference.py) on them in fp32, so it materialises (nheads, seqlen_q, seqlen_k) scores
per sequence. It reads cache_seqlens and cache_leftpad on the host (a device sync for CUDA tensors, so not
capturable in a CUDA graph: the Triton path is).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cache_args import KVCache
from .params import NO_BOUND, AttentionParams
from .reference import attention_reference, rotary_reference
from .route import Route


def _slots(cache: KVCache, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, row within it) of each sequence's cache rows ``rows`` (batch, n): a page and its row, or a batch row
    and the row itself."""
    batch = torch.arange(rows.shape[0], device=rows.device)[:, None]
    if cache.paged:
        return cache.block_table.long()[batch, rows // cache.page_size], rows % cache.page_size
    cache_rows = batch if cache.cache_batch_idx is None else cache.cache_batch_idx.long()[:, None]
    return cache_rows.expand_as(rows), rows


def append(cache: KVCache) -> None:
    """k_new (rotated at its positions) and v_new into cache rows cache_seqlens[b] + j; rows past the cache are
    dropped, as the kernels drop them."""
    rows = cache.cache_seqlens.long()[:, None] + torch.arange(cache.seqlen_new, device=cache.k_new.device)
    k_new = cache.k_new
    if cache.rotary_cos is not None:
        k_new = rotary_reference(k_new, cache.rotary_cos, cache.rotary_sin, rows, cache.rotary_interleaved)
    inside = (rows >= 0) & (rows < cache.capacity)
    block, slot = _slots(cache, rows.clamp(0, cache.capacity - 1))
    cache.k_cache[block[inside], slot[inside]] = k_new[inside]
    cache.v_cache[block[inside], slot[inside]] = cache.v_new[inside]


def _check_indices(cache: KVCache, seqlens: list[int], starts: list[int], n_q: int, p: AttentionParams) -> None:
    """The index entries this call uses, which this path reads on the host anyway: one outside the cache raises
    here, before the append writes anything (the Triton path reads none on the host: there, as in flash_attn, such
    values are the caller's error). A block_table's used entries are those of the pages holding the rows appended or
    that some query may see (from leftpad, or the first query's left window bound, on); others may hold anything."""
    if cache.cache_batch_idx is not None:
        rows = cache.k_cache.shape[0]
        bad = [i for i in cache.cache_batch_idx.tolist() if not 0 <= i < rows]
        if bad:
            raise ValueError(
                f"cache_batch_idx holds {bad[0]}, not a row of the cache's {rows}: pass indices in [0, {rows})"
            )
    if not cache.paged:
        return
    page, pages = cache.page_size, cache.k_cache.shape[0]
    for b, entries in enumerate(cache.block_table.tolist()):
        end = seqlens[b] + cache.seqlen_new
        first = starts[b] if p.window_left == NO_BOUND else max(starts[b], end - n_q - p.window_left)
        for lo, hi in ((seqlens[b], end), (first, end)):  # appended, seen
            lo, hi = max(lo, 0), min(hi, cache.capacity)
            bad = [e for e in entries[lo // page : -(-hi // page)] if lo < hi and not 0 <= e < pages]
            if bad:
                raise ValueError(
                    f"block_table[{b}] lists page {bad[0]} among the pages its rows use, not one of the cache's "
                    f"{pages}: pass page indices in [0, {pages})"
                )


def dense_keys(cache: KVCache, x: torch.Tensor) -> torch.Tensor:
    """A cache (k_cache or v_cache) as each sequence sees it: (batch, capacity, nheads_k, headdim)."""
    if cache.paged:  # entries past a sequence's pages are never read (the kernels skip them): any value will do
        if x.shape[0] == 0:  # no pages at all: no row is read either (_check_indices)
            return x.new_zeros(cache.block_table.shape[0], cache.capacity, *x.shape[2:])
        return x[cache.block_table.long().clamp(0, x.shape[0] - 1)].flatten(1, 2)
    return x if cache.cache_batch_idx is None else x[cache.cache_batch_idx.long()]


@torch.no_grad()  # no gradient flows from a cache call, and these ops would record one for inputs that ask
def forward(
    q: torch.Tensor, cache: KVCache, p: AttentionParams, route: Route
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """out (shaped as q) and the natural-log LSE (batch, nheads, seqlen_q) in fp32, None unless p.write_lse."""
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ValueError(
            "flash_attn_with_kvcache on the PyTorch path (fp32 CUDA tensors, or FLASHTRITON_BACKEND=torch) reads "
            "cache_seqlens on the host and cannot be captured in a CUDA graph: capture fp16 or bf16 calls"
        )
    batch, n_q, heads, _ = q.shape
    seqlens = cache.cache_seqlens.tolist()
    starts = [0] * batch if cache.cache_leftpad is None else [max(s, 0) for s in cache.cache_leftpad.tolist()]
    _check_indices(cache, seqlens, starts, n_q, p)
    if cache.k_new is not None:
        append(cache)
    if cache.rotary_cos is not None:
        step = int(cache.rotate_rows)
        positions = cache.cache_seqlens.long()[:, None] + step * torch.arange(n_q, device=q.device)
        q = rotary_reference(q, cache.rotary_cos, cache.rotary_sin, positions, cache.rotary_interleaved)
    k, v = dense_keys(cache, cache.k_cache), dense_keys(cache, cache.v_cache)
    out = torch.empty(q.shape, dtype=p.result_dtype(q.dtype), device=q.device)
    lse = torch.empty(batch, heads, n_q, dtype=torch.float32, device=q.device)
    for b in range(batch):
        # keys up to the append's end: rows it dropped past the cache are masked out but keep the masks' alignment;
        # a negative length (device data) leaves no key, as in the kernels
        end = max(seqlens[b] + cache.seqlen_new, starts[b])
        k_b, v_b = k[b : b + 1, starts[b] : end], v[b : b + 1, starts[b] : end]
        dropped = max(end - starts[b], 0) - k_b.shape[1]
        mask = None
        if dropped > 0:
            k_b, v_b = (F.pad(x, (0, 0, 0, 0, 0, dropped)) for x in (k_b, v_b))
            mask = (torch.arange(k_b.shape[1], device=q.device) < k_b.shape[1] - dropped).expand(1, 1, n_q, -1)
        slopes = None if p.alibi_slopes is None else p.alibi_slopes[b]
        out_b, lse_b = attention_reference(
            q[b : b + 1], k_b, v_b, p.softmax_scale, compute_dtype=torch.float32,
            window_size=(p.window_left, p.window_right), softcap=p.softcap, alibi_slopes=slopes, mask=mask,
            sinks=p.sinks,
        )  # fmt: skip
        out[b], lse[b] = out_b[0], lse_b[0]
    return out, lse if p.write_lse else None
