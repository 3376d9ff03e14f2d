"""Block masks and mods: create_block_mask against brute-force masks, the tile lists, the torch
evaluation of mods against the same mods run inside a Triton kernel (the interpreter on CPU, the
GPU when there is one), and an offline sm90 compile of that kernel."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

import flashtriton
from flashtriton import block_mask as block_mask_module
from flashtriton.block_mask import BlockMask, create_block_mask
from flashtriton.mods import (
    Mod,
    and_masks,
    as_mod,
    causal_mask,
    check_differentiable,
    document_mask,
    evaluate_mask,
    evaluate_score,
    evaluate_score_grad,
    or_masks,
    prefix_lm_mask,
    sliding_window_mask,
)

KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: conftest turned on TRITON_INTERPRET


# --- user mods, as a user would write them --------------------------------------------------------


@triton.jit
def per_head_window(b, h, q_idx, kv_idx, windows):
    """windows: (batch, 3) int32: a causal window per batch and head."""
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= tl.load(windows + b * 3 + h))


@triton.jit
def _wrap(d):
    return tl.where(d < 0, -d, d) % 7


@triton.jit
def c_division(b, h, q_idx, kv_idx):
    """Negative // and %, in-place operators, a nested jit call: Triton's C semantics, not torch's."""
    d = q_idx - kv_idx
    d += 3
    return (d // 4 == d % 3) | (_wrap(d) == 1)


@triton.jit
def always(b, h, q_idx, kv_idx):
    return True


@triton.jit
def softcap(score, b, h, q_idx, kv_idx):
    return 4.0 * libdevice.tanh(score / 4.0)


@triton.jit
def softcap_grad(score, b, h, q_idx, kv_idx):
    t = libdevice.tanh(score / 4.0)
    return 1.0 - t * t


@triton.jit
def softcap_sigmoid(score, b, h, q_idx, kv_idx):
    """4 tanh(score / 4) without libdevice, which Triton's interpreter cannot run."""
    return 4.0 * (2.0 * tl.sigmoid(score / 2.0) - 1.0)


@triton.jit
def softcap_sigmoid_grad(score, b, h, q_idx, kv_idx):
    s = tl.sigmoid(score / 2.0)
    return 4.0 * s * (1.0 - s)


@triton.jit
def distance_bias(score, b, h, q_idx, kv_idx, slopes):
    return score - tl.load(slopes + h) * tl.abs(q_idx - kv_idx).to(tl.float32)


@triton.jit
def one(score, b, h, q_idx, kv_idx, slopes):
    return 1.0


@triton.jit
def uses_program_id(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx + tl.program_id(0)


# --- cases: a mod and its mask written out in plain torch ---------------------------------------


def doc_ids(n):
    """Documents of odd lengths (7, 29, 1, ...), so boundaries fall inside tiles."""
    ends = torch.tensor([7, 36, 37, 60, 81, 100, 150])
    return torch.bucketize(torch.arange(n), ends, right=True).to(torch.int32)


def windows():
    return torch.tensor([[0, 5, 40], [17, 1, 3]], dtype=torch.int32)


def causal_rule(offset):
    return lambda b, h, q, kv: kv <= q + offset


# name: (mod factory, brute-force rule, seqlen_q, seqlen_k, batch, heads)
MASKS = {
    "causal": (causal_mask, causal_rule(0), 100, 100, None, None),
    "causal-q>k": (lambda: causal_mask(100, 77), causal_rule(-23), 100, 77, None, None),
    "causal-q<k": (lambda: causal_mask(77, 100), causal_rule(23), 77, 100, None, None),
    "window": (
        lambda: sliding_window_mask(10, 100, 77),
        lambda b, h, q, kv: (kv <= q - 23) & (kv >= q - 33),
        100, 77, None, None,
    ),
    "prefix-lm": (lambda: prefix_lm_mask(23), lambda b, h, q, kv: (kv < 23) | (kv <= q), 100, 100, None, None),
    "document": (
        lambda: document_mask(doc_ids(100)),
        lambda b, h, q, kv: doc_ids(100)[q] == doc_ids(100)[kv],
        100, 100, None, None,
    ),
    "document-and-causal": (
        lambda: and_masks(document_mask(doc_ids(100)), causal_mask()),
        lambda b, h, q, kv: (doc_ids(100)[q] == doc_ids(100)[kv]) & (kv <= q),
        100, 100, None, None,
    ),
    "window-or-prefix-or-document": (
        lambda: or_masks(sliding_window_mask(3), prefix_lm_mask(5), document_mask(doc_ids(100))),
        lambda b, h, q, kv: ((kv <= q) & (kv >= q - 3)) | (kv < 5) | (kv <= q) | (doc_ids(100)[q] == doc_ids(100)[kv]),
        100, 100, None, None,
    ),
    "nested-combinators": (
        lambda: and_masks(or_masks(causal_mask(), document_mask(doc_ids(100))), sliding_window_mask(30)),
        lambda b, h, q, kv: ((kv <= q) | (doc_ids(100)[q] == doc_ids(100)[kv])) & (kv <= q) & (kv >= q - 30),
        100, 100, None, None,
    ),
    "per-batch-head": (
        lambda: Mod(per_head_window, (windows(),)),
        lambda b, h, q, kv: (kv <= q) & (q - kv <= windows()[b, h]),
        100, 77, 2, 3,
    ),
    "c-division": (
        lambda: c_division,
        lambda b, h, q, kv: (
            (torch.div(q - kv + 3, 4, rounding_mode="trunc") == torch.fmod(q - kv + 3, 3))
            | (torch.fmod((q - kv + 3).abs(), 7) == 1)
        ),
        100, 77, None, None,
    ),
    "always": (lambda: always, lambda b, h, q, kv: torch.ones_like(q - kv, dtype=torch.bool), 100, 77, None, 2),
}  # fmt: skip


def brute_force(rule, bm, hm, seqlen_q, seqlen_k):
    """(Bm, Hm, seqlen_q, seqlen_k) bool from the plain-torch rule."""
    b = torch.arange(bm)[:, None, None, None]
    h = torch.arange(hm)[None, :, None, None]
    q = torch.arange(seqlen_q)[:, None]
    kv = torch.arange(seqlen_k)[None, :]
    return torch.broadcast_to(rule(b, h, q, kv), (bm, hm, seqlen_q, seqlen_k))


def tile_classes(elements, block_size):
    """Partial and full (Bm, Hm, Mq, Mk) layouts of an element mask, looking only inside the sequences."""
    (bm, bn), (n_q, n_k) = block_size, elements.shape[-2:]
    pad = (0, -n_k % bn, 0, -n_q % bm)
    shape = (*elements.shape[:2], triton.cdiv(n_q, bm), bm, triton.cdiv(n_k, bn), bn)
    some = F.pad(elements, pad, value=False).view(shape).any(dim=5).any(dim=3)
    every = F.pad(elements, pad, value=True).view(shape).all(dim=5).all(dim=3)
    return some & ~every, every


BLOCK_SIZES = [(16, 16), (32, 16), (16, 48)]


@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", list(MASKS))
def test_create_block_mask_matches_brute_force(name, block_size):
    make, rule, n_q, n_k, batch, heads = MASKS[name]
    mask = create_block_mask(make(), batch, heads, n_q, n_k, device="cpu", block_size=block_size)
    bm, hm = batch or 1, heads or 1
    assert mask.shape == (bm, hm, n_q, n_k)
    expected = brute_force(rule, bm, hm, n_q, n_k)
    assert torch.equal(mask.element_mask(), expected)
    partial, full = tile_classes(expected, block_size)
    assert torch.equal(mask.partial_layout(), partial)
    assert torch.equal(mask.full_layout(), full)
    assert (mask.full_kv_num_blocks is None) == (not full.any())


def test_chunks_give_the_same_mask(monkeypatch):
    make, _, n_q, n_k, batch, heads = MASKS["per-batch-head"]
    whole = create_block_mask(make(), batch, heads, n_q, n_k, device="cpu", block_size=16)
    monkeypatch.setattr(block_mask_module, "CHUNK_ELEMENTS", 3 * 16 * 80)  # 3 query tiles per chunk
    chunked = create_block_mask(make(), batch, heads, n_q, n_k, device="cpu", block_size=16)
    assert torch.equal(whole.partial_layout(), chunked.partial_layout())
    assert torch.equal(whole.full_layout(), chunked.full_layout())


def assert_lists_consistent(mask: BlockMask):
    """Counts, ascending indices in range, and the transposed lists describing the same tiles."""
    mq, mk = mask.num_tiles
    for kind in ("", "full_"):
        kv_num, kv_idx = getattr(mask, f"{kind}kv_num_blocks"), getattr(mask, f"{kind}kv_indices")
        q_num, q_idx = getattr(mask, f"{kind}q_num_blocks"), getattr(mask, f"{kind}q_indices")
        if kv_num is None:
            assert q_num is None and q_idx is None and kv_idx is None
            continue
        for t in (kv_num, kv_idx, q_num, q_idx):
            assert t.dtype == torch.int32 and t.is_contiguous()
        for num, idx, n in ((kv_num, kv_idx, mk), (q_num, q_idx, mq)):
            listed = torch.arange(idx.shape[-1]) < num[..., None]
            assert ((idx >= 0) & (idx < n))[listed].all()
            steps = idx[..., 1:] - idx[..., :-1]
            assert (steps > 0)[listed[..., 1:]].all(), "listed tiles must be ascending"
        kv_layout = block_mask_module._tile_layout(kv_num, kv_idx, (*kv_num.shape, mk), "cpu")
        q_layout = block_mask_module._tile_layout(q_num, q_idx, (*q_num.shape, mq), "cpu")
        assert torch.equal(kv_layout, q_layout.transpose(-1, -2))
        assert torch.equal(kv_num, kv_layout.sum(-1, dtype=torch.int32))


@pytest.mark.parametrize("name", ["document-and-causal", "per-batch-head", "always"])
def test_transposed_lists_consistent(name):
    make, _, n_q, n_k, batch, heads = MASKS[name]
    assert_lists_consistent(create_block_mask(make(), batch, heads, n_q, n_k, device="cpu", block_size=(16, 32)))


@pytest.mark.parametrize("with_mask_mod", [False, True], ids=["full-tiles", "partial-tiles"])
def test_from_layout_round_trip(with_mask_mod):
    layout = torch.rand(2, 3, 7, 5) < 0.4  # seqlen 100 x 77 in 16-blocks
    mod = causal_mask(100, 77) if with_mask_mod else None
    mask = BlockMask.from_layout(layout, (16, 16), seqlen_q=100, seqlen_k=77, mask_mod=mod)
    assert_lists_consistent(mask)
    assert torch.equal(mask.to_dense(), layout)
    assert torch.equal(mask.partial_layout() if with_mask_mod else mask.full_layout(), layout)
    if with_mask_mod:
        assert mask.full_kv_num_blocks is None
    else:
        assert not mask.kv_num_blocks.any() and mask.mask_mod is None
    again = BlockMask.from_layout(mask.to_dense(), mask.block_size, seqlen_q=100, seqlen_k=77, mask_mod=mod)
    assert torch.equal(again.kv_indices, mask.kv_indices) and torch.equal(again.q_indices, mask.q_indices)
    rows, cols = torch.arange(100) // 16, torch.arange(77) // 16
    expected = layout[:, :, rows][:, :, :, cols]
    if with_mask_mod:
        expected = expected & causal_rule(-23)(0, 0, torch.arange(100)[:, None], torch.arange(77))
    assert torch.equal(mask.element_mask(), expected)


def test_counts_for_flops():
    layout = torch.zeros(1, 2, 7, 5, dtype=torch.bool)
    layout[0, 0, 6, 4] = True  # the ragged corner: 100 - 96 = 4 rows, 77 - 64 = 13 columns
    layout[0, 1, 0, :] = True  # 16 rows x 77 columns
    mask = BlockMask.from_layout(layout, 16, seqlen_q=100, seqlen_k=77)
    assert mask.visited_pairs() == 4 * 13 + 16 * 77
    assert mask.visited_pairs(batch=3, heads=2) == 3 * (4 * 13 + 16 * 77)
    assert mask.density() == pytest.approx(6 / 70)
    assert mask.sparsity() == pytest.approx(64 / 70)
    with pytest.raises(ValueError, match="make it for heads 4"):
        mask.visited_pairs(heads=4)


def test_broadcast_dims():
    mask = create_block_mask(causal_mask(), None, None, 50, 50, device="cpu", block_size=16)
    assert mask.shape == (1, 1, 50, 50) and mask.kv_indices.shape == (1, 1, 4, 4)
    mask.check_matches(batch=8, heads=5, seqlen_q=50, seqlen_k=50, device=torch.device("cpu"))
    many = mask.element_mask(b=[0, 3, 7], h=4)
    assert many.shape == (3, 1, 50, 50) and torch.equal(many, mask.element_mask().expand(3, 1, 50, 50))
    per_head = create_block_mask(causal_mask(), None, 3, 50, 50, device="cpu", block_size=16)
    assert per_head.kv_num_blocks.shape == (1, 3, 4)
    with pytest.raises(ValueError, match="heads 3, not 1 or 4"):
        per_head.check_matches(batch=2, heads=4, seqlen_q=50, seqlen_k=50, device="cpu")
    with pytest.raises(ValueError, match="seqlen_q=50, seqlen_k=50"):
        per_head.check_matches(batch=2, heads=3, seqlen_q=50, seqlen_k=60, device="cpu")
    with pytest.raises(ValueError, match=r"block_mask.to\(device\)"):
        per_head.check_matches(batch=2, heads=3, seqlen_q=50, seqlen_k=50, device="meta")
    moved = per_head.to("cpu")
    assert torch.equal(moved.to_dense(), per_head.to_dense()) and moved.mask_mod.fn is per_head.mask_mod.fn


@triton.jit
def _per_head_mask(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & ((h == 0) | (kv_idx == q_idx))  # head 0 causal, the others their diagonal only


@triton.jit
def _per_batch_mask(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx + b * 0  # reads b: counted as depending on it


def test_mask_dims_are_those_the_mask_reads():
    """flash_attn_func's mask_mod gets a block mask over the dims it reads, so a per-head mask's tiles are its own
    for each head (one for all heads would skip the others' tiles by head 0's), and a mask that reads neither is
    evaluated once."""
    cpu = torch.device("cpu")
    assert block_mask_module.mask_dims(causal_mask(), 3, 4, cpu) == (None, None)
    assert block_mask_module.mask_dims(_per_head_mask, 3, 4, cpu) == (None, 4)
    assert block_mask_module.mask_dims(_per_batch_mask, 3, 4, cpu) == (3, None)
    assert block_mask_module.mask_dims(and_masks(causal_mask(), _per_head_mask), 3, 4, cpu) == (None, 4)
    assert block_mask_module.mask_dims(_per_head_mask, 3, 1, cpu) == (None, None)  # one head: nothing to tell apart
    q, k, v = (torch.randn(1, 256, 2, 16) for _ in range(3))  # 2 x 2 tiles of 128: head 0's (1, 0) is full
    out = flashtriton.flash_attn_func(q, k, v, mask_mod=_per_head_mask)
    dense = create_block_mask(_per_head_mask, None, 2, 256, 256, device="cpu", block_size=16).element_mask()
    expected, _ = flashtriton.attention_reference(q.double(), k.double(), v.double(), mask=dense)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(out[:, :, 1], v[:, :, 1])  # head 1 sees its own key alone


def test_repr_and_generated_functions_are_shared():
    assert causal_mask().fn is causal_mask().fn
    assert causal_mask().fn is not causal_mask(10, 20).fn
    assert and_masks(causal_mask(), always).fn is and_masks(causal_mask(), always).fn
    mask = create_block_mask(causal_mask(), None, None, 64, 64, device="cpu", block_size=16)
    assert "density=0.625" in repr(mask) and "causal_mask" in repr(mask)
    assert "int32(100,)@cpu" in repr(document_mask(doc_ids(100)))


# --- torch evaluation --------------------------------------------------------------------------


def test_score_mod_grad_matches_autograd():
    score = torch.randn(2, 3, 9, 11, dtype=torch.float64, requires_grad=True)
    b, h = torch.arange(2)[:, None, None, None], torch.arange(3)[None, :, None, None]
    q, kv = torch.arange(9)[:, None], torch.arange(11)
    mod = Mod(softcap, grad=softcap_grad)
    out = evaluate_score(mod, score, b, h, q, kv)
    assert out.dtype == torch.float64 and type(out) is torch.Tensor
    torch.testing.assert_close(out, 4.0 * torch.tanh(score / 4.0))
    (grad,) = torch.autograd.grad(out.sum(), score)
    torch.testing.assert_close(evaluate_score_grad(mod, score.detach(), b, h, q, kv), grad)
    slopes = torch.tensor([0.5, 0.25, 0.125])
    biased = evaluate_score(Mod(distance_bias, (slopes,)), score, b, h, q, kv)
    torch.testing.assert_close(biased, score - slopes[h] * (q - kv).abs())


def test_evaluation_errors():
    with pytest.raises(NotImplementedError, match=r"uses_program_id calls tl\.program_id"):
        evaluate_mask(uses_program_id, 0, 0, torch.arange(4)[:, None], torch.arange(4))
    with pytest.raises(IndexError, match="_same_document loads out of bounds"):
        evaluate_mask(document_mask(doc_ids(10)), 0, 0, torch.arange(11)[:, None], torch.arange(10))
    with pytest.raises(ValueError, match="forward-only"):
        check_differentiable(Mod(softcap))
    check_differentiable(Mod(softcap, grad=softcap_grad))


def plain_function(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


VALIDATION = {
    "layout-dtype": (lambda: BlockMask.from_layout(torch.ones(1, 1, 7, 5), 16, seqlen_q=100, seqlen_k=77),
                     TypeError, r"layout.bool\(\)"),
    "layout-shape": (lambda: BlockMask.from_layout(torch.ones(1, 1, 7, 4, dtype=torch.bool), 16, seqlen_q=100,
                                                   seqlen_k=77), ValueError, r"shape \(Bm, Hm, 7, 5\)"),
    "layout-rank": (lambda: BlockMask.from_layout(torch.ones(7, 5, dtype=torch.bool), 16, seqlen_q=100,
                                                  seqlen_k=77), ValueError, r"layout\[None, None\]"),
    "block-size-multiple": (lambda: create_block_mask(causal_mask(), 1, 1, 64, 64, "cpu", (24, 16)),
                            ValueError, "not a multiple of 16"),
    "block-size-positive": (lambda: create_block_mask(causal_mask(), 1, 1, 64, 64, "cpu", 0), ValueError, ">= 1"),
    "block-size-type": (lambda: create_block_mask(causal_mask(), 1, 1, 64, 64, "cpu", 16.0), TypeError, "pair"),
    "seqlen": (lambda: create_block_mask(causal_mask(), 1, 1, 0, 64, "cpu"), ValueError, "seqlen_q must be >= 1"),
    "batch-type": (lambda: create_block_mask(causal_mask(), "2", 1, 64, 64, "cpu"), TypeError, "batch must be an int"),
    "not-jit": (lambda: create_block_mask(plain_function, 1, 1, 64, 64, "cpu"), TypeError, "@triton.jit"),
    "mod-not-contiguous": (lambda: Mod(per_head_window, (windows().t(),)), ValueError, r"tensor.contiguous\(\)"),
    "mod-not-tensor": (lambda: Mod(per_head_window, ([0, 1],)), TypeError, "not a torch.Tensor"),
    "doc-ids-float": (lambda: document_mask(torch.zeros(8)), TypeError, r"doc_ids.int\(\)"),
    "doc-ids-rank": (lambda: document_mask(torch.zeros(2, 8, dtype=torch.int32)), TypeError, r"\(seqlen,\)"),
    "window-negative": (lambda: sliding_window_mask(-1), ValueError, "window must be >= 0"),
    "causal-one-length": (lambda: causal_mask(seqlen_q=5), ValueError, "both seqlen_q and seqlen_k"),
    "no-masks": (lambda: and_masks(), ValueError, "at least one mask_mod"),
    "grad-missing": (lambda: evaluate_score_grad(softcap, torch.zeros(2, 2), 0, 0, 0, 0), ValueError, "forward-only"),
    "lists-dtype": (lambda: BlockMask(16, 16, 16, *(torch.zeros(1, 1, 1, dtype=torch.int64),) * 8),
                    ValueError, "must be an int32 tensor"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(VALIDATION))
def test_bad_input_raises_clear_error(name):
    make, error, message = VALIDATION[name]
    with pytest.raises(error, match=message):
        make()


# --- the same mods inside a Triton kernel ------------------------------------------------------------


@triton.jit
def mask_mod_kernel(out, mask_tensors, b, h, N_Q, N_K, MASK_MOD: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):  # fmt: skip
    """out[i, j] = MASK_MOD(b, h, i, j, *mask_tensors), called as the attention kernels call it."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_bounds = (rows[:, None] < N_Q) & (cols[None, :] < N_K)
    # padding rows / columns of ragged tiles get an in-range index: mods index tensors of length seqlen
    q_idx = tl.minimum(rows, N_Q - 1)[:, None]
    kv_idx = tl.minimum(cols, N_K - 1)[None, :]
    visible = MASK_MOD(b, h, q_idx, kv_idx, *mask_tensors)
    tl.store(out + rows[:, None] * N_K + cols[None, :], (visible & in_bounds).to(tl.int8), mask=in_bounds)


@triton.jit
def score_mod_kernel(out, grad_out, score_in, score_tensors, b, h, N_Q, N_K, SCORE_MOD: tl.constexpr,
                     SCORE_GRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_bounds = (rows[:, None] < N_Q) & (cols[None, :] < N_K)
    q_idx = tl.minimum(rows, N_Q - 1)[:, None]
    kv_idx = tl.minimum(cols, N_K - 1)[None, :]
    offsets = rows[:, None] * N_K + cols[None, :]
    score = tl.load(score_in + offsets, mask=in_bounds, other=0.0)
    tl.store(out + offsets, SCORE_MOD(score, b, h, q_idx, kv_idx, *score_tensors), mask=in_bounds)
    tl.store(grad_out + offsets, SCORE_GRAD(score, b, h, q_idx, kv_idx, *score_tensors), mask=in_bounds)


KERNEL_BLOCK = 32
SCORE_MODS = {
    "softcap-libdevice": lambda: Mod(softcap, grad=softcap_grad),
    "softcap-sigmoid": lambda: Mod(softcap_sigmoid, grad=softcap_sigmoid_grad),
    "distance-bias": lambda: Mod(distance_bias, (torch.tensor([0.5, 0.25, 0.125]),), grad=one),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_mask_mod_in_kernel_matches_torch_evaluation(name):
    make, _, n_q, n_k, batch, heads = MASKS[name]
    mod = as_mod(make()).to(KERNEL_DEVICE)
    b, h = (batch or 1) - 1, (heads or 1) - 1
    out = torch.full((n_q, n_k), -1, dtype=torch.int8, device=KERNEL_DEVICE)
    grid = (triton.cdiv(n_q, KERNEL_BLOCK), triton.cdiv(n_k, KERNEL_BLOCK))
    mask_mod_kernel[grid](out, mod.tensors, b, h, n_q, n_k, mod.fn, KERNEL_BLOCK, KERNEL_BLOCK)
    q, kv = torch.arange(n_q, device=KERNEL_DEVICE)[:, None], torch.arange(n_k, device=KERNEL_DEVICE)
    expected = evaluate_mask(mod, b, h, q, kv)
    assert torch.equal(out.bool(), expected)


@pytest.mark.parametrize("name", list(SCORE_MODS))
def test_score_mod_in_kernel_matches_torch_evaluation(name):
    if name.endswith("libdevice") and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("Triton's interpreter has no libdevice (test_mods_compile_for_sm90 compiles it)")
    mod = SCORE_MODS[name]().to(KERNEL_DEVICE)
    n_q, n_k, b, h = 45, 70, 1, 2
    score = 6 * torch.randn(n_q, n_k, device=KERNEL_DEVICE)
    out, grad = torch.empty_like(score), torch.empty_like(score)
    grid = (triton.cdiv(n_q, KERNEL_BLOCK), triton.cdiv(n_k, KERNEL_BLOCK))
    score_mod_kernel[grid](out, grad, score, mod.tensors, b, h, n_q, n_k, mod.fn, mod.grad, KERNEL_BLOCK, KERNEL_BLOCK)
    q, kv = torch.arange(n_q, device=KERNEL_DEVICE)[:, None], torch.arange(n_k, device=KERNEL_DEVICE)
    torch.testing.assert_close(out, evaluate_score(mod, score, b, h, q, kv))
    torch.testing.assert_close(grad, evaluate_score_grad(mod, score, b, h, q, kv).expand_as(grad))


_TRITON_TYPES = {torch.int32: "*i32", torch.int64: "*i64", torch.float32: "*fp32"}


def compile_for_sm90() -> None:
    """Compile both test kernels with every mod for Hopper, without a GPU (run with TRITON_INTERPRET unset)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    scalars = {"b": "i32", "h": "i32", "N_Q": "i32", "N_K": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
    blocks = {"BLOCK_M": 64, "BLOCK_N": 64}
    for name, (make, *_) in MASKS.items():
        mod = as_mod(make())
        signature = {"out": "*i8", "mask_tensors": tuple(_TRITON_TYPES[t.dtype] for t in mod.tensors),
                     "MASK_MOD": "constexpr", **scalars}  # fmt: skip
        source = ASTSource(mask_mod_kernel, signature, constexprs={"MASK_MOD": mod.fn, **blocks})
        assert "ptx" in triton.compile(source, target=target).asm, name
    for make in SCORE_MODS.values():
        mod = make()
        signature = {"out": "*fp32", "grad_out": "*fp32", "score_in": "*fp32",
                     "score_tensors": tuple(_TRITON_TYPES[t.dtype] for t in mod.tensors),
                     "SCORE_MOD": "constexpr", "SCORE_GRAD": "constexpr", **scalars}  # fmt: skip
        constexprs = {"SCORE_MOD": mod.fn, "SCORE_GRAD": mod.grad, **blocks}
        assert "ptx" in triton.compile(ASTSource(score_mod_kernel, signature, constexprs=constexprs), target=target).asm


def test_mods_compile_for_sm90():
    """The combinators and ready masks are generated source: prove Triton's real compiler takes them."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tests = Path(__file__).parent
    env["PYTHONPATH"] = os.pathsep.join([str(tests.parent / "src"), str(tests), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", "import test_block_mask; test_block_mask.compile_for_sm90()"],
        env=env, cwd=tests, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]


def test_mean_span_counts_listed_keys_and_sees_in_place_edits():
    # 4 query tiles x 5 key tiles of 16: rows list 1, 2, 3 and 5 tiles (full lists only: no mask_mod)
    layout = torch.zeros(1, 1, 4, 5, dtype=torch.bool)
    for row, tiles in enumerate((1, 2, 3, 5)):
        layout[0, 0, row, :tiles] = True
    mask = BlockMask.from_layout(layout, (16, 16), seqlen_q=64, seqlen_k=80)
    assert mask.mean_span() == round(11 / 4 * 16)
    # the count is read once per tensor version: an in-place write is seen at the next call
    mask.kv_num_blocks.fill_(5)
    assert mask.mean_span() == min(80, round((4 * 5 + 11) / 4 * 16))
