"""The Gluon kernels on the shapes users bring: any length (a sequence may end inside a tile), a model's (B, H, N, D)
storage seen as (B, N, H, D), packed qkv, and ragged varlen documents; forward and both backwards (fused, and the
deterministic pair), against the fp64 reference, with gradients in their inputs' layouts.

The routes are pinned on any machine (a change that sends these calls back to the portable kernels fails here); the
kernels run on a Hopper GPU.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from flashtriton import flash_attn_func, flash_attn_varlen_func, ops, route, triton_backend
from flashtriton.kernels import config
from flashtriton.launch import Recorder
from flashtriton.params import NO_BOUND, AttentionParams
from flashtriton.validation import host_read
from helpers import assert_close_to_reference, hopper, reference_outputs

LAYOUTS = ("contiguous", "model", "qkv-packed")


def _inputs(layout: str, batch: int, n: int, heads: int, head_dim: int, device="cuda", dtype=torch.bfloat16):
    """q, k, v (batch, n, heads, head_dim) leaves in a layout: contiguous, a model's (B, H, N, D) storage seen as
    (B, N, H, D), or views into one packed (B, N, 3, H, D) tensor (the leaf is then the packed tensor)."""
    if layout == "contiguous":
        leaves = [torch.randn(batch, n, heads, head_dim, device=device, dtype=dtype) for _ in range(3)]
        return [x.requires_grad_() for x in leaves], leaves
    if layout == "model":
        leaves = [torch.randn(batch, heads, n, head_dim, device=device, dtype=dtype).requires_grad_() for _ in range(3)]
        return leaves, [x.transpose(1, 2) for x in leaves]
    packed = torch.randn(batch, n, 3, heads, head_dim, device=device, dtype=dtype).requires_grad_()
    return [packed], list(packed.unbind(2))


def test_strided_tma_fits():
    """Which layouts the Gluon kernels' rank-4 descriptors read in place."""
    x = torch.zeros(2, 4, 6, 64, dtype=torch.bfloat16)
    assert route.strided_tma_fits(x)
    assert route.strided_tma_fits(x.transpose(1, 2).contiguous().transpose(1, 2))  # the model's layout
    assert route.strided_tma_fits(torch.zeros(2, 6, 3, 4, 64, dtype=torch.bfloat16)[:, :, 1])  # packed qkv
    assert route.strided_tma_fits(x[:, :, :, :32])  # a head's columns: strides stay 16-byte multiples
    assert route.strided_tma_fits(torch.zeros(2, 4, 6, 80, dtype=torch.bfloat16))  # 160-byte heads: 128-wide tiles
    assert not route.strided_tma_fits(torch.zeros(2, 4, 6, 44, dtype=torch.bfloat16))  # 88-byte heads
    assert not route.strided_tma_fits(torch.zeros(2, 4, 6, 264, dtype=torch.bfloat16))  # wider than any tile
    assert not route.strided_tma_fits(torch.zeros(2, 4, 6, 65, dtype=torch.bfloat16)[..., :64])  # 130-byte heads
    assert not route.strided_tma_fits(torch.zeros(2 * 4 * 6 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 4, 6, 64))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [1000, 4096])
def test_routes_take_the_gluon_kernels(layout, n):
    """Any length and layout goes to the Gluon kernels (fused backward at a long span, the pair deterministic)."""
    _, (q, k, v) = _inputs(layout, 2, n, 4, 128, device="cpu")
    causal = AttentionParams(128**-0.5, window_right=0)
    assert route.forward(q, k, v, causal, gpu="sm90").family == route.HOPPER
    backward = route.backward(q, None, q, k, v, q, None, AttentionParams(128**-0.5), gpu="sm90")
    assert (backward.family, backward.dq) == (route.HOPPER, route.FUSED if n == 4096 else route.PAIR)
    deterministic = AttentionParams(128**-0.5, deterministic=True)
    assert route.backward(q, None, q, k, v, q, None, deterministic, gpu="sm90").dq == route.PAIR


@pytest.mark.parametrize(
    "layout,n,causal,flat",
    [("contiguous", 2048, False, True), ("qkv-packed", 2048, False, True), ("model", 2048, False, False),
     ("contiguous", 2000, False, False), ("contiguous", 2048, True, False)],
)  # fmt: skip
def test_flat_views_where_batches_follow_in_whole_tiles(layout, n, causal, flat):
    """The (B * N, H, D) view only where each batch's rows follow the last's in whole tiles (the model's layout
    interleaves heads; 2000 rows end inside a tile, whose load would read the next batch's first rows), and not for
    causal calls (config.FLAT_VIEW_BANDED)."""
    _, (q, k, v) = _inputs(layout, 2, n, 4, 128, device="cpu")
    common = dict(N=n, VARLEN=False, RAGGED=n % 128 != 0, CAUSAL=causal, LEFT=False)
    assert triton_backend._flat(common, q, k, v, torch.empty_like(q)) == flat
    # one tensor whose batches do not follow one another (a slice of longer sequences) keeps the whole call rank-4
    sliced = torch.empty(2, 2 * n, 4, 128, dtype=q.dtype)[:, :n]
    assert not triton_backend._flat(common, q, k, v, sliced)
    # so do keys of another length (cross-attention), even with batches N rows apart: the flat view's rows end at
    # B * their length, before the last batch's
    keys = torch.empty(2, n, 4, 128, dtype=q.dtype)[:, : n // 2]
    assert not triton_backend._flat(common, q, keys, keys, torch.empty_like(q))


@pytest.mark.parametrize("head_dim,width", [(32, None), (40, 64), (80, 128), (96, 128), (136, 256), (192, 256)])
def test_head_dims_between_widths_take_the_next(head_dim, width):
    """A head dim between the Gluon kernels' widths runs in tiles of the next (at or below 32: the portable kernels,
    which are faster there)."""
    q = torch.zeros(2, 1000, 4, head_dim, dtype=torch.bfloat16)
    params = AttentionParams(head_dim**-0.5, window_right=0)
    assert config.hopper_width(head_dim) == width
    family = route.HOPPER if width else route.PORTABLE
    assert route.forward(q, q, q, params, gpu="sm90").family == family
    assert route.backward(q, None, q, q, q, q, None, params, gpu="sm90").family == family


def _varlen_params(starts: list[int]) -> AttentionParams:
    cu = torch.tensor(starts, dtype=torch.int32)
    host_read(cu, "values", torch.Tensor.tolist)  # as validation reads them
    longest = max(b - a for a, b in itertools.pairwise(starts))
    return AttentionParams(0.125, window_right=0, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                           max_seqlen_k=longest)  # fmt: skip


def test_ragged_documents_take_the_gluon_pair():
    """Ragged varlen documents: the Gluon forward and the deterministic pair (the fused dQ sums take a document's
    tiles at whole-tile rows, so only documents that start there take the fused backward)."""
    q = torch.zeros(8192, 4, 128, dtype=torch.bfloat16)
    ragged, whole = _varlen_params([0, 1000, 5000, 8192]), _varlen_params([0, 1024, 5120, 8192])
    assert route.forward(q, q, q, ragged, gpu="sm90").family == route.HOPPER
    assert route.backward(q, None, q, q, q, q, None, ragged, gpu="sm90").dq == route.PAIR
    assert route.backward(q, None, q, q, q, q, None, whole, gpu="sm90").dq == route.FUSED


def _spy(monkeypatch) -> list[str]:
    """The Gluon launchers called from here on (plans and routes cleared, so that every call launches afresh)."""
    monkeypatch.setattr(triton_backend, "_PLANS", {})
    monkeypatch.setattr(route, "_ROUTES", {})
    calls = []
    for name in ("_hopper_forward", "_hopper_dkdv", "_hopper_dq"):
        launch = getattr(triton_backend, name)
        monkeypatch.setattr(triton_backend, name, lambda *args, n=name, f=launch: calls.append(n) or f(*args))
    return calls


def _check(name, ours, q, k, v, dout, dlse, causal, window=(-1, -1), cu_seqlens=None):
    exact = reference_outputs(q, k, v, dout, dlse, causal, window_size=window, cu_seqlens=cu_seqlens)
    plain = reference_outputs(q, k, v, dout, dlse, causal, window_size=window, cu_seqlens=cu_seqlens,
                              compute_dtype=None)  # fmt: skip
    for part, a, e, p in zip(("out", "lse", "dq", "dk", "dv"), ours, exact, plain, strict=True):
        assert_close_to_reference(f"{name} {part}", a, e, p)


CASES = [  # (n, head dim, mode): lengths that end inside a tile, and a whole one
    (1000, 128, "dense"),
    (4000, 128, "causal"),
    (3000, 64, "causal"),
    (1000, 64, "dense"),
    (129, 128, "window"),
    (777, 256, "causal"),
    (2048, 128, "causal"),
    (4100, 128, "dense"),  # the D=128 fused backward (spans of 2048 and more) on a length that ends inside a tile
    # the forward's key tile that needs a mask streamed first (primitives.py, last_first): a long causal span's diagonal
    # (config.LONG_BAND_SPAN) on a length that ends inside a tile, at 128 and in 128-wide tiles; three warpgroups
    (4100, 128, "causal"),
    (5000, 96, "causal"),
    (4000, 64, "dense"),
    (17, 64, "causal"),  # shorter than one tile
    (113, 128, "dense"),
    # head dims between the kernels' widths, in tiles of the next width (the fused backward from 2048 keys at 128)
    (1000, 80, "causal"),
    (4100, 80, "dense"),
    (3000, 96, "causal"),
    (777, 192, "dense"),
    (1000, 48, "window"),
    # whole tiles without a band: contiguous and packed batches reach the kernels as one sequence of B * N rows
    (1024, 64, "dense"),
    (2048, 128, "dense"),  # the fused backward
    (1024, 80, "dense"),  # columns past the head dim: TMA's zeros in the flat view too
    (2048, 256, "dense"),  # O and dK/dV stored in column halves
]


@hopper
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n,head_dim,mode", CASES, ids=[f"n{n}-d{d}-{m}" for n, d, m in CASES])
def test_gluon_kernels_on_users_shapes(n, head_dim, mode, layout, deterministic, monkeypatch):
    calls = _spy(monkeypatch)
    leaves, (q, k, v) = _inputs(layout, 2, n, 4, head_dim)
    causal, window = mode != "dense", (100, 0) if mode == "window" else (-1, -1)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, window_size=window, deterministic=deterministic,
                                  return_attn_probs=True)  # fmt: skip
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    torch.autograd.backward((out, lse), (dout, dlse))
    grads = [x.grad for x in leaves]
    if layout == "qkv-packed":
        grads = list(grads[0].unbind(2))
    else:
        for leaf in leaves:  # the gradients come back in their inputs' layouts
            assert leaf.grad.stride() == leaf.stride()
        grads = [g.transpose(1, 2) for g in grads] if layout == "model" else grads
    _check(f"{layout} n={n}", (out, lse, *grads), q, k, v, dout, dlse, causal, window)
    assert calls[0] == "_hopper_forward"
    gluon_backward = not (deterministic and config.hopper_width(head_dim) == 256)  # no Gluon dQ kernel 256 wide
    assert ("_hopper_dkdv" in calls) == gluon_backward


# keys of another length than the queries (cross-attention, no mask): lengths that end inside tiles on either side, a
# single query or key, GQA; the fused backward from long spans, the pair below them and deterministic
CROSS = [
    (1000, 4096, 128), (4096, 1000, 128), (300, 2047, 64), (2048, 77, 256), (1, 513, 128), (513, 1, 64),
    (1024, 4096, 128), (2048, 1024, 64),  # whole tiles on both sides: no masks, rank-4 views
]  # fmt: skip


def test_cross_attention_takes_the_gluon_kernels():
    q, k = torch.zeros(2, 1000, 4, 128, dtype=torch.bfloat16), torch.zeros(2, 4096, 2, 128, dtype=torch.bfloat16)
    dense = AttentionParams(128**-0.5)
    assert route.forward(q, k, k, dense, gpu="sm90").family == route.HOPPER
    backward = route.backward(q, None, q, k, k, q, None, dense, gpu="sm90")
    assert (backward.family, backward.dq) == (route.HOPPER, route.FUSED)
    deterministic = AttentionParams(128**-0.5, deterministic=True)
    assert route.backward(q, None, q, k, k, q, None, deterministic, gpu="sm90").dq == route.PAIR
    # a mask aligned bottom-right between two lengths, and a ring step's fp32 partial results, stay portable
    ring_step = AttentionParams(128**-0.5, fp32_results=True)
    assert route.forward(q, k, k, ring_step, gpu="sm90").family == route.PORTABLE
    causal = AttentionParams(128**-0.5, window_right=0)
    assert route.forward(q, k, k, causal, gpu="sm90").family == route.PORTABLE
    assert route.backward(q, None, q, k, k, q, None, causal, gpu="sm90").family == route.PORTABLE


@hopper
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
@pytest.mark.parametrize("layout", ["contiguous", "model"])
@pytest.mark.parametrize("n_q,n_k,head_dim", CROSS, ids=[f"q{a}-k{b}-d{d}" for a, b, d in CROSS])
def test_gluon_kernels_on_cross_attention(n_q, n_k, head_dim, layout, deterministic, monkeypatch):
    calls = _spy(monkeypatch)
    shapes = (2, n_q, 4, head_dim), (2, n_k, 2, head_dim), (2, n_k, 2, head_dim)
    if layout == "model":  # (B, H, N, D) storage seen as (B, N, H, D)
        leaves = [
            torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16).requires_grad_() for b, n, h, d in shapes
        ]
        q, k, v = (x.transpose(1, 2) for x in leaves)
    else:
        leaves = q, k, v = [torch.randn(s, device="cuda", dtype=torch.bfloat16).requires_grad_() for s in shapes]
    out, lse, _ = flash_attn_func(q, k, v, deterministic=deterministic, return_attn_probs=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    torch.autograd.backward((out, lse), (dout, dlse))
    for leaf in leaves:  # the gradients come back in their inputs' layouts
        assert leaf.grad.stride() == leaf.stride()
    grads = [x.grad.transpose(1, 2) if layout == "model" else x.grad for x in leaves]
    _check(f"{layout} q{n_q} k{n_k}", (out, lse, *grads), q, k, v, dout, dlse, False)
    assert calls[0] == "_hopper_forward"
    gluon_backward = not (deterministic and config.hopper_width(head_dim) == 256)  # no Gluon dQ kernel 256 wide
    assert ("_hopper_dkdv" in calls) == gluon_backward


# documents that end inside tiles (one of a single row); the longest of each set takes the forward's long causal span
# (config.LONG_BAND_SPAN), whose diagonal key tiles stream first
DOCUMENTS = {"short": [0, 1000, 1129, 4000, 4001, 6144], "long": [0, 1000, 6100, 6101, 6237]}


@hopper
@pytest.mark.parametrize("documents", list(DOCUMENTS))
@pytest.mark.parametrize("head_dim", [128, 80])
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_gluon_kernels_on_ragged_documents(causal, deterministic, head_dim, documents, monkeypatch):
    calls = _spy(monkeypatch)
    starts = DOCUMENTS[documents]
    longest = max(b - a for a, b in itertools.pairwise(starts))
    cu = torch.tensor(starts, dtype=torch.int32, device="cuda")
    shapes = [(starts[-1], h, head_dim) for h in (8, 2, 2)]
    q, k, v = (torch.randn(s, device="cuda", dtype=torch.bfloat16).requires_grad_() for s in shapes)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal, deterministic=deterministic,
                                         return_attn_probs=True)  # fmt: skip
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    torch.autograd.backward((out, lse), (dout, dlse))
    _check("ragged", (out, lse, q.grad, k.grad, v.grad), q, k, v, dout, dlse, causal, cu_seqlens=(cu, cu))
    assert calls == ["_hopper_forward", "_hopper_dq", "_hopper_dkdv"]


@hopper
def test_fused_backward_on_documents_that_start_at_whole_tiles(monkeypatch):
    """Documents that start at multiples of 64 rows but end inside the dK/dV kernel's 128-key programs (and the last
    inside a tile): the fused backward, whose second warpgroup's keys then lie in the next document."""
    calls = _spy(monkeypatch)
    starts = [0, 64, 1088, 4160, 4200]
    cu = torch.tensor(starts, dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(starts[-1], h, 64, device="cuda", dtype=torch.bfloat16).requires_grad_() for h in (4, 2, 2))
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu, cu, 3072, 3072, causal=True, return_attn_probs=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    torch.autograd.backward((out, lse), (dout, dlse))
    _check("aligned documents", (out, lse, q.grad, k.grad, v.grad), q, k, v, dout, dlse, True, cu_seqlens=(cu, cu))
    assert calls == ["_hopper_forward", "_hopper_dkdv"]


@hopper
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
def test_gqa_model_layout_and_split_grid(deterministic, monkeypatch):
    """GQA 8/2 in a model's layout on a length that ends inside a tile; then the same call with its (batch, head)
    programs split over the grid's y and z (a tiny y limit standing in for CUDA's 65535): the same bits."""
    calls = _spy(monkeypatch)
    shapes = [(3, h, 1000, 128) for h in (8, 2, 2)]
    leaves = [torch.randn(s, device="cuda", dtype=torch.bfloat16).requires_grad_() for s in shapes]
    q, k, v = (x.transpose(1, 2) for x in leaves)
    dout = torch.randn(3, 1000, 8, 128, device="cuda", dtype=torch.bfloat16)

    def run():
        out, lse, _ = flash_attn_func(q, k, v, causal=True, deterministic=deterministic, return_attn_probs=True)
        return out, lse, *torch.autograd.grad(out, leaves, dout)

    first = run()
    zeros = torch.zeros(3, 8, 1000, device="cuda")
    _check("gqa model", (*first[:2], *(g.transpose(1, 2) for g in first[2:])), q, k, v, dout, zeros, True)
    monkeypatch.setattr(triton_backend, "_GRID_Y", 8)
    monkeypatch.setattr(triton_backend, "_PLANS", {})
    split = run()
    assert "_hopper_forward" in calls and "_hopper_dkdv" in calls
    for a, b in zip(split, first, strict=True):
        assert torch.equal(a, b) if deterministic else torch.allclose(a.float(), b.float(), atol=2e-2, rtol=0)


@hopper
def test_window_wider_than_the_sequence_on_the_gluon_kernels(monkeypatch):
    """A causal window bound near 2**31 (clamped on the host) hides nothing on the Gluon path either."""
    calls = _spy(monkeypatch)
    q, k, v = (torch.randn(2, 1000, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    wide = flash_attn_func(q, k, v, causal=True, window_size=(2**31 - 2, 0))
    assert calls == ["_hopper_forward"]
    assert torch.equal(wide, flash_attn_func(q, k, v, causal=True))


@hopper
def test_ragged_lengths_repeat_bitwise(monkeypatch):
    """The deterministic pair on a length that ends inside a tile and a model layout: bitwise repeatable."""
    leaves, (q, k, v) = _inputs("model", 2, 1000, 4, 128)
    dout = torch.randn(2, 1000, 4, 128, device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(3):
        out = flash_attn_func(q, k, v, causal=True, deterministic=True)
        runs.append((out, *torch.autograd.grad(out, leaves, dout)))
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0], strict=True))


def _kernels_here(n: int, monkeypatch) -> tuple[str, int, bool]:
    """(device, length, whether the Gluon kernels run) for a test of the Triton kernels: a Hopper GPU's at length n,
    else the portable kernels in Triton's interpreter at a short length; skipped elsewhere."""
    gluon = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
    if not gluon and not route.interpreting():
        pytest.skip("needs a Hopper GPU or Triton's interpreter")
    monkeypatch.setenv("FLASHTRITON_BACKEND", "triton")
    return ("cuda", n, True) if gluon else ("cpu", 70, False)


# (n, head dim, causal, deterministic): the pair's dQ kernel, the fused backward's dQ conversion, split D
PADDED = [(1000, 80, True, False), (1000, 80, True, True), (2100, 80, False, False), (700, 192, True, False),
          (2048, 80, False, False), (1024, 80, False, True)]  # fmt: skip


@pytest.mark.parametrize("n,head_dim,causal,deterministic", PADDED, ids=[f"n{n}-d{d}" + "-causal" * c + "-det" * t
                                                                          for n, d, c, t in PADDED])  # fmt: skip
def test_stores_keep_to_the_head_dim(n, head_dim, causal, deterministic, monkeypatch):
    """Results stored from registers (fp32 results, as ring steps ask for) of tiles wider than the head dim write
    its columns only: out, dq, dk and dv each land in a view of a NaN-filled buffer as wide as the tiles, whose
    columns past the head dim stay NaN (an overrun into a neighbour's columns would be written over by the neighbour
    in some orders only). On a Hopper GPU the Gluon kernels (asserted), elsewhere the portable ones in Triton's
    interpreter, at a short length."""
    device, n, gluon = _kernels_here(n, monkeypatch)
    calls = _spy(monkeypatch)
    buffers = []

    def padded(recorder, name, shape, dtype, device):
        buffer = torch.full((*shape[:-1], config.block_d(head_dim)), float("nan"), dtype=dtype, device=device)
        buffers.append(buffer)
        recorder.replayable = False  # (a plan would allocate it contiguous)
        recorder.tensors[name] = view = buffer[..., : shape[-1]]
        return view

    empty, empty_like = Recorder.empty, Recorder.empty_like
    monkeypatch.setattr(Recorder, "empty", lambda self, name, shape, dtype, device, strides=None: (
        padded(self, name, tuple(shape), dtype, device) if name == "out" else
        empty(self, name, shape, dtype, device, strides)))  # fmt: skip
    monkeypatch.setattr(Recorder, "empty_like", lambda self, name, x, dtype=None: (
        padded(self, name, tuple(x.shape), dtype or x.dtype, x.device) if name in ("dq", "dk", "dv") else
        empty_like(self, name, x, dtype)))  # fmt: skip
    q, k, v, dout = (torch.randn(2, n, h, head_dim, device=device, dtype=torch.bfloat16) for h in (4, 2, 2, 4))
    params = AttentionParams(head_dim**-0.5, window_right=0 if causal else NO_BOUND, deterministic=deterministic,
                             fp32_results=True)  # fmt: skip
    out, lse = ops.forward(q, k, v, params)
    dlse = torch.zeros_like(lse)
    grads = ops.backward(dout, dlse, q, k, v, out.to(q.dtype), lse, params)[:3]
    assert len(buffers) == 4 and all(b.dtype == torch.float32 for b in buffers)
    for name, buffer in zip(("out", "dq", "dk", "dv"), buffers, strict=True):
        assert buffer[..., head_dim:].isnan().all(), f"{name} written past the head dim"
    _check(f"d{head_dim} fp32", (out, lse, *grads), q, k, v, dout, dlse, causal)
    if gluon:
        assert calls[0] == "_hopper_forward" and "_hopper_dkdv" in calls


# (head dim, dtype, a): scores about -a^2 sqrt(D), so each row's LSE is very negative (fp16: below -11, where
# exp(-LSE) passes fp16's largest; bf16: below -88, past fp32's)
NEGATIVE = [(64, torch.float16, 1.6), (128, torch.float16, 1.6), (256, torch.float16, 1.6), (64, torch.bfloat16, 4.0),
            (128, torch.bfloat16, 4.0)]  # fmt: skip


@pytest.mark.parametrize("head_dim,dtype,a", NEGATIVE, ids=[f"d{d}-{str(t)[6:]}" for d, t, _ in NEGATIVE])
def test_very_negative_lse_keeps_gradients_finite(head_dim, dtype, a, monkeypatch):
    """A dense sequence that ends inside a key tile, whose rows' LSE is very negative: a key past the end (TMA's
    zeros) would have P = exp(-LSE), which overflows, and dS times those zeros would be NaN in dQ; masked, the
    gradients are finite and match the reference (D=64 fused, 128 the pair, 256 split D). On a Hopper GPU the Gluon
    kernels, elsewhere the portable ones in Triton's interpreter, at a short length."""
    device, n, _ = _kernels_here(1000, monkeypatch)

    def near(value, heads):
        return (value + 0.1 * torch.randn(2, n, heads, head_dim, device=device)).to(dtype).requires_grad_()

    q, k, v = near(a, 4), near(-a, 2), near(0.0, 2)
    v.data.normal_()
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert lse.max() < (-11 if dtype == torch.float16 else -88)
    dout = torch.randn_like(out)
    dlse = torch.zeros_like(lse)
    torch.autograd.backward((out, lse), (dout, dlse))
    assert all(x.grad.isfinite().all() for x in (q, k, v))
    _check(f"d{head_dim} lse {lse.max().item():.0f}", (out, lse, q.grad, k.grad, v.grad), q, k, v, dout, dlse, False)
