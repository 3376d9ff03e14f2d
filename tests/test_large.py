"""Tensors over 2**31 elements (issue 35): every row offset, row * stride, must be computed in 64 bits.

On a (1, 2**21, 9, 128) tensor (2.4e9 elements) row * 1152 passes 2**31 from row 1864136 on; a 32-bit product wraps
and the kernel reads or writes outside the tensor (an illegal memory access that kills the CUDA context).

The GPU cases run forward and backward on such tensors (bf16, about 4.8 GB each) through the default route (on
Hopper: the Gluon kernels, their backward fused or as a pair), through the portable kernels (pointer loads, TMA
loads, a ragged last tile, cross-attention), and through a packed varlen batch. A sliding window keeps the work
small (a dense 2**21 x 2**21 attention takes minutes). Each checks every element through one fp32 sum (NaN: an
element never written, the outputs being NaN-poisoned, or a wild read) and compares the last rows, where the offsets
are largest, with the fp64 reference of just those rows. Each skips unless 30 to 53 GB of GPU memory are free
(_bytes_needed, which counts high: an 80 GB card runs every case) and runs in seconds, mostly compiling.

test_rows_far_apart needs no such memory: views whose rows lie FAR elements apart put row offsets past 2**31 with a
few thousand elements, so it runs in Triton's interpreter on the CPU too (in lazily mapped memory).
"""

from __future__ import annotations

import gc
import mmap
import sys
from itertools import accumulate

import pytest
import torch

from flashtriton import flash_attn_func, flash_attn_varlen_func, route, triton_backend
from helpers import TARGETS, assert_close_to_reference, reference_outputs

HEADS, HEAD_DIM = 9, 128
LONG = 2**21  # rows of HEADS * HEAD_DIM elements: 2.4e9 elements, and row offsets pass 2**31 from row 1864136 on
RAGGED = LONG + 77  # not a whole number of tiles: the portable kernels' masked last tile
CHECKED = 512  # rows compared with the fp64 reference at each slice
SHORT_WINDOW = 200  # sliding windows (causal): span below the fused backward's (a Hopper pair) ...
WIDE_WINDOW = 2047  # ... and above it (the Hopper fused backward, with the preprocess and dQ conversion kernels)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _bytes_needed(n_q: int, n_k: int, reference_rows: int) -> int:
    """GPU memory a case takes: its tensors, the fp64 reference on reference_rows rows, and the allocator's slack."""
    q_like, k_like = n_q * HEADS * HEAD_DIM * 2, n_k * HEADS * HEAD_DIM * 2  # bf16
    rows = n_q * HEADS * 4  # one fp32 value per query row and head
    # q, out, dout, dq; k, v, dk, dv; the fused backward's fp32 dQ sums; LSE, dLSE, delta
    tensors = 4 * q_like + 4 * k_like + 2 * q_like + 3 * rows
    reference = 8 * reference_rows**2 * HEADS * 8  # score-sized fp64 tensors, autograd's included
    return tensors + reference + 2**30


def _need_memory(nbytes: int) -> None:
    gc.collect()
    torch.cuda.empty_cache()  # an earlier case's blocks, cached by PyTorch, count as used in mem_get_info
    free, _ = torch.cuda.mem_get_info()
    if free < nbytes:
        pytest.skip(f"needs {nbytes / 1e9:.1f} GB of free GPU memory, {free / 1e9:.1f} GB free")


def _recording(decide, taken: list[str]):
    def spy(*args, **kwargs):
        chosen = decide(*args, **kwargs)
        taken.append(" ".join(filter(None, (chosen.family, chosen.dq))))  # "hopper pair", "portable", ...
        return chosen

    return spy


@pytest.fixture
def routes(monkeypatch):
    """The routes the calls take, by family (and the Hopper backward's dQ), forward and backward in call order."""
    taken = []
    for name in ("forward", "backward"):
        monkeypatch.setattr(route, name, _recording(getattr(route, name), taken))
    return taken


def _random(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.bfloat16, device="cuda").requires_grad_()


OUTPUTS = ("out", "lse", "dq", "dk", "dv")


def _assert_finite(results: tuple[torch.Tensor, ...]) -> None:
    """Every element of out, lse, dq, dk, dv: one fp32 sum shows any NaN or inf (NaN: never written, or read wild)."""
    for name, x in zip(OUTPUTS, results, strict=True):
        assert torch.isfinite(x.sum(dtype=torch.float32)), f"{name}: NaN or inf"


ALL = slice(None)


def _assert_match(results, exact, plain, compared: slice = ALL, keys_too: bool = True) -> None:
    """(out, lse, dq, dk, dv) against the reference's at the rows ``compared`` (of queries; of keys for dK, dV)."""
    for name, actual, want, base in zip(OUTPUTS, results, exact, plain, strict=True):
        if name in ("dk", "dv") and not keys_too:
            continue
        at = (slice(None), slice(None), compared) if name == "lse" else (slice(None), compared)
        assert_close_to_reference(name, actual[at], want[at], base[at])


def _assert_slice_matches(q, k, v, dout, results, rows: slice, keys: slice, compared: slice, options, keys_too=True):
    """results = (out, lse, dq, dk, dv) of a (1, N, H, D) call at query rows ``rows`` (and key rows ``keys``) against
    the fp64 reference of those rows against those keys alone, at the slice's rows ``compared``: where it holds every
    key those queries see and, keys_too, every query that sees those keys (self-attention slices: rows == keys)."""
    qs, ks, vs, douts = (x.detach()[:, s] for x, s in ((q, rows), (k, keys), (v, keys), (dout, rows)))
    dlse = torch.zeros(1, HEADS, qs.shape[1], device=q.device)
    exact = reference_outputs(qs, ks, vs, douts, dlse, **options)
    plain = reference_outputs(qs, ks, vs, douts, dlse, compute_dtype=None, **options)
    out, lse, dq, dk, dv = results
    _assert_match((out[:, rows], lse[:, :, rows], dq[:, rows], dk[:, keys], dv[:, keys]), exact, plain, compared,
                  keys_too)  # fmt: skip


def _attend(q, k, v, **options) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """dout and (out, lse, dq, dk, dv) of flash_attn_func with a random dout."""
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **options)
    dout = torch.randn_like(out)
    out.backward(dout)
    return dout, (out.detach(), lse.detach(), q.grad, k.grad, v.grad)


def _windowed_self_attention(n: int, window: int, softcap: float = 0.0) -> None:
    """A causal sliding window on (1, n, HEADS, HEAD_DIM): finite everywhere, exact at the last CHECKED rows."""
    _need_memory(_bytes_needed(n, n, CHECKED + window))
    q, k, v = (_random(1, n, HEADS, HEAD_DIM) for _ in range(3))
    options = dict(causal=True, window_size=(window, 0), softcap=softcap)
    dout, results = _attend(q, k, v, **options)
    _assert_finite(results)
    # the last rows and the window before them: every row from the window's width on sees all its keys there
    last = slice(n - CHECKED - window, n)
    _assert_slice_matches(q, k, v, dout, results, last, last, slice(window, None), options)


def _assert_routes(routes: list[str], on_hopper: tuple[str, str]) -> None:
    """On Hopper, the forward and backward took the routes a case is there to cover (a change to the kernel tables
    that moves it elsewhere shows here: pick a case that takes them again)."""
    if route.arch(torch.device("cuda")) == "sm90":
        assert routes == list(on_hopper)


DEFAULT_CASES = {  # window, and the routes on Hopper
    "window-200": (SHORT_WINDOW, ("hopper", "hopper pair")),
    "window-2047": (WIDE_WINDOW, ("hopper", "hopper fused")),
}


@cuda
@pytest.mark.parametrize("case", list(DEFAULT_CASES))
def test_default_route(case, routes, monkeypatch):
    """(1, 2**21, 9, 128) under a causal sliding window, through the route that serves it by default."""
    monkeypatch.delenv("FLASHTRITON_BACKEND", raising=False)
    window, on_hopper = DEFAULT_CASES[case]
    _windowed_self_attention(LONG, window)
    _assert_routes(routes, on_hopper)


def _portable_only(monkeypatch) -> None:
    """Route every call to the portable kernels with pointer loads: the tables of a GPU other than Hopper's."""
    monkeypatch.setattr(route.triton_compat, "PRIVATE_API_OK", False)
    monkeypatch.setattr(route, "_ROUTES", {})  # routes remembered before the switch
    monkeypatch.setattr(triton_backend, "_PLANS", {})


@cuda
@pytest.mark.parametrize("case", ["pointer-loads", "softcap", "cross-attention"])
def test_portable_kernels(case, routes, monkeypatch):
    """The portable kernels on a ragged length: with pointer loads, with softcap (on Hopper its table loads K, V, Q
    and dO through TMA), and dense cross-attention of long queries on few keys (every query row against every key)."""
    monkeypatch.delenv("FLASHTRITON_BACKEND", raising=False)
    if case == "pointer-loads":
        _portable_only(monkeypatch)
        _windowed_self_attention(RAGGED, SHORT_WINDOW)
    elif case == "softcap":
        _windowed_self_attention(RAGGED, SHORT_WINDOW, softcap=30.0)
    else:
        n_k = 500
        _need_memory(_bytes_needed(RAGGED, n_k, CHECKED))
        q = _random(1, RAGGED, HEADS, HEAD_DIM)
        k, v = _random(1, n_k, HEADS, HEAD_DIM), _random(1, n_k, HEADS, HEAD_DIM)
        dout, results = _attend(q, k, v)
        _assert_finite(results)
        # dK, dV sum over every query: finite here; the windowed cases compare them where the offsets are largest
        last = slice(RAGGED - CHECKED, RAGGED)
        options = dict(causal=False)
        _assert_slice_matches(q, k, v, dout, results, last, ALL, ALL, options, keys_too=False)
    assert routes == ["portable", "portable"]


VARLEN_CASES = {  # sequence lengths, and the routes on Hopper (forward, backward): the last sequence starts past row
    # 1864136, so its first row's offset is past 2**31
    "whole-tiles": ([768 * 2474, 768 * 260], ("hopper", "hopper pair")),
    "ragged": ([1_900_001, 77, 200_031], ("hopper", "hopper pair")),  # sequences that end inside a tile
}


@cuda
@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_varlen(case, routes, monkeypatch):
    """A packed batch of 2.1e6 rows under a causal sliding window: finite everywhere, exact at the first and the last
    rows of its last sequence."""
    monkeypatch.delenv("FLASHTRITON_BACKEND", raising=False)
    (lengths, on_hopper), window = VARLEN_CASES[case], SHORT_WINDOW
    starts = [0, *accumulate(lengths)]
    total, longest = starts[-1], max(lengths)
    _need_memory(_bytes_needed(total, total, CHECKED + window))
    q, k, v = (_random(total, HEADS, HEAD_DIM) for _ in range(3))
    cu_seqlens = torch.tensor(starts, dtype=torch.int32, device=q.device)
    options = dict(causal=True, window_size=(window, 0))
    out, lse, _ = flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, longest, longest, return_attn_probs=True, **options
    )
    dout = torch.randn_like(out)
    out.backward(dout)
    results = (out.detach()[None], lse.detach()[None], q.grad[None], k.grad[None], v.grad[None])
    _assert_finite(results)
    dense = (q[None], k[None], v[None], dout[None])
    # the last sequence's first rows (every one sees all its keys; keys before CHECKED, all their queries) ...
    first = slice(starts[-2], starts[-2] + CHECKED + window)
    _assert_slice_matches(*dense, results, first, first, slice(0, CHECKED), options)
    # ... and its last rows, as in the dense cases
    last = slice(total - CHECKED - window, total)
    _assert_slice_matches(*dense, results, last, last, slice(window, None), options)
    _assert_routes(routes, on_hopper)


FAR = 2**24  # elements between rows of test_rows_far_apart's views
FAR_ROWS = 200  # rows 128 on lie past 2**31 elements, and so do a 128-row tile's offsets from its first row
FAR_HEAD_DIM = 16
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)  # no swap reserved


def _far_apart(device: str) -> tuple[torch.Tensor, ...]:
    """q, k, v (1, FAR_ROWS, 1, FAR_HEAD_DIM) fp16, interleaved in one buffer of 3.4e9 elements, rows FAR apart. On
    the CPU the buffer is mapped lazily: only the pages of the rows written take memory (a few MB)."""
    size = (FAR_ROWS - 1) * FAR + 3 * FAR_HEAD_DIM
    if device == "cpu":
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        base = torch.frombuffer(mmap.mmap(-1, size * 2, flags=flags), dtype=torch.float16)
    else:
        base = torch.empty(size, dtype=torch.float16, device=device)  # 6.7 GB
    shape, strides = (1, FAR_ROWS, 1, FAR_HEAD_DIM), (size, FAR, FAR_HEAD_DIM, 1)
    views = [base.as_strided(shape, strides, i * FAR_HEAD_DIM) for i in range(3)]
    for x in views:
        x.copy_(torch.randn(shape, dtype=torch.float16))
    return tuple(x.requires_grad_() for x in views)


@pytest.mark.parametrize("target", [t for t in TARGETS if t.backend == "triton"], ids=str)
def test_rows_far_apart(target, monkeypatch):
    """Inputs whose row offsets pass 2**31 in a few thousand elements: causal attention, every output against the
    fp64 reference (the outputs are new contiguous tensors: the large cases cover their offsets)."""
    monkeypatch.setenv("FLASHTRITON_BACKEND", target.backend)
    if target.device == "cuda":
        _need_memory(8 * 10**9)
    q, k, v = _far_apart(target.device)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    dlse = torch.zeros_like(lse)
    exact = reference_outputs(q, k, v, dout, dlse, causal=True)
    plain = reference_outputs(q, k, v, dout, dlse, causal=True, compute_dtype=None)
    _assert_match((out.detach(), lse.detach(), q.grad, k.grad, v.grad), exact, plain)
