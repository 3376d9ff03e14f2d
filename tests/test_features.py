"""Sliding windows, softcap, ALiBi, dropout, variable-length batches, and a block mask with a
score_mod, through the public API against the fp64 reference on every available target
(params.py defines the semantics).

Dropout is checked element for element: the test draws the seed the call will draw
(torch.manual_seed, then dropout.draw_seed) and feeds the reference the mask dropout.keep makes
from it, so a kernel that drops a different element fails.

On the GPU each case runs in every dtype of the target. On the CPU targets, where a case costs
seconds, each case names one dtype: test_attention.test_matches_reference runs every dtype there,
and the cases of a feature share the dtypes out between them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial

import pytest
import torch
import triton
import triton.language as tl

from flashtriton import (
    attention_reference,
    dropout,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from flashtriton.block_mask import BlockMask, create_block_mask
from flashtriton.mods import Mod, and_masks, causal_mask, document_mask
from helpers import (
    Seqlens,
    Shape,
    assert_close_to_reference,
    dtype_name,
    dtypes_for,
    packed_inputs,
    random_qkv,
    reference_outputs,
    target_params,
)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

NAMES = ("out", "lse", "dq", "dk", "dv")


@dataclass(frozen=True)
class Case:
    """One call: a dense Shape or packed Seqlens, and the options under test."""

    shape: Shape | Seqlens
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: str = ""  # "h": slopes of shape (nheads,); "bh": (batch, nheads)
    dropout_p: float = 0.0
    mods: bool = False  # a document-causal block mask and a score_mod with its gradient (dense only)
    api: str = "varlen"  # for Seqlens: "varlen", "qkvpacked" or "kvpacked"
    dtype: torch.dtype | None = None  # None: every dtype of the target (helpers.dtypes_for)
    deterministic: bool = False  # also: two more calls (same seeds) give bitwise the same out, lse and gradients

    def __str__(self) -> str:
        parts = [dtype_name(self.dtype)] if self.dtype else []
        parts.append(str(self.shape))
        if isinstance(self.shape, Seqlens) and self.api != "varlen":
            parts.append(self.api)
        if self.causal:
            parts.append("causal")
        if self.window != (-1, -1):
            parts.append(f"w{self.window[0]},{self.window[1]}")
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        if self.alibi:
            parts.append(f"alibi-{self.alibi}")
        if self.dropout_p:
            parts.append(f"drop{self.dropout_p:g}")
        if self.mods:
            parts.append("block-mask-score-mod")
        if self.deterministic:
            parts.append("deterministic")
        return "-".join(parts)


def _alibi_slopes(case: Case, device) -> torch.Tensor | None:
    heads = case.shape.heads
    if case.alibi == "h":  # the geometric slopes of the ALiBi paper
        return 2.0 ** (-8.0 * torch.arange(1, heads + 1, device=device) / heads)
    if case.alibi == "bh":
        return torch.rand(case.shape.batch, heads, device=device) * 0.5
    return None


@triton.jit
def _gated_bias(score, b, h, q_idx, kv_idx, gates):
    return score + tl.load(gates + h) * tl.sigmoid(score)


@triton.jit
def _gated_bias_grad(score, b, h, q_idx, kv_idx, gates):
    s = tl.sigmoid(score)
    return 1.0 + tl.load(gates + h) * s * (1.0 - s)


def _mods(shape: Shape, device) -> tuple[BlockMask, Mod]:
    """A causal block mask within random documents, and a nonlinear per-head score_mod."""
    doc_ids = torch.randint(0, 4, (shape.n_q,), device=device).sort().values
    block_size = (32, 16) if shape.n_q < 128 else (128, 64)
    mask_mod = and_masks(causal_mask(), document_mask(doc_ids))
    block_mask = create_block_mask(mask_mod, None, None, shape.n_q, shape.n_k, device, block_size)
    gates = torch.rand(shape.heads, device=device) * 2.0
    return block_mask, Mod(_gated_bias, (gates,), _gated_bias_grad)


def _backprop(out, lse, dout, dlse) -> None:
    finite = torch.isfinite(lse)
    ((out * dout).sum() + (lse[finite] * dlse[finite]).sum()).backward()


def _run_varlen(case: Case, q, k, v, cu_q, cu_k, dout, dlse, **options):
    """out, lse, dq, dk, dv of the case's varlen entry point; packed inputs get their gradient unpacked."""
    lens = case.shape
    max_q, max_k = max(lens.q), max(lens.k)
    if case.api == "qkvpacked":
        qkv = torch.stack([q, k, v], dim=1).requires_grad_()
        out, lse, _ = flash_attn_varlen_qkvpacked_func(qkv, cu_q, max_q, **options)
        _backprop(out, lse, dout, dlse)
        return out.detach(), lse.detach(), *qkv.grad.unbind(1)
    if case.api == "kvpacked":
        q = q.clone().requires_grad_()
        kv = torch.stack([k, v], dim=1).requires_grad_()
        out, lse, _ = flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, max_q, max_k, **options)
        _backprop(out, lse, dout, dlse)
        return out.detach(), lse.detach(), q.grad, *kv.grad.unbind(1)
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **options)
    _backprop(out, lse, dout, dlse)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _seed_of_next_call(torch_seed: int) -> int:
    """Seed torch's generator; return the dropout seed that the next flashtriton call will draw from it."""
    torch.manual_seed(torch_seed)
    seed = int(dropout.draw_seed())
    torch.manual_seed(torch_seed)
    return seed


def _run_dense(q, k, v, dout, dlse, **options):
    """out, lse, dq, dk, dv of flash_attn_func on fresh leaves holding q, k, v."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **options)
    _backprop(out, lse, dout, dlse)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def check_case(target, case: Case) -> None:
    """out, lse and the three gradients of one case, in its dtype or each of the target's, against the reference;
    deterministic cases are called twice more with the same seeds and must repeat bit for bit."""
    for dtype in [case.dtype] if case.dtype else dtypes_for(target):
        options = dict(
            causal=case.causal, window_size=case.window, softcap=case.softcap,
            alibi_slopes=_alibi_slopes(case, target.device), dropout_p=case.dropout_p,
        )  # fmt: skip
        reference = dict(options)
        if case.deterministic:
            options.update(deterministic=True)
        if isinstance(case.shape, Shape):
            s = case.shape
            q, k, v = random_qkv(s, dtype, target.device, requires_grad=False)
            dout = torch.randn(q.shape, dtype=dtype, device=q.device)
            dlse = torch.randn(s.batch, s.heads, s.n_q, device=q.device)
            if case.mods:
                block_mask, score_mod = _mods(s, target.device)
                options.update(block_mask=block_mask, score_mod=score_mod)
                heads = torch.arange(s.heads, device=q.device)
                reference.update(mask=block_mask.element_mask(b=torch.arange(s.batch), h=heads), score_mod=score_mod)
            call = partial(_run_dense, q, k, v, dout, dlse, **options)
        else:
            q, k, v, cu_q, cu_k = packed_inputs(case.shape, dtype, target.device)
            dout = torch.randn(q.shape, dtype=dtype, device=q.device)
            dlse = torch.randn(q.shape[1], q.shape[0], device=q.device)
            call = partial(_run_varlen, case, q, k, v, cu_q, cu_k, dout, dlse, return_attn_probs=True, **options)
        seed = _seed_of_next_call(1)
        ours = call()
        if isinstance(case.shape, Seqlens):
            reference.update(cu_seqlens=(cu_q, cu_k), dropout_seed=seed)
        elif case.dropout_p > 0:
            reference["dropout_mask"] = dropout.dropout_mask(
                seed, case.dropout_p, s.batch, s.heads, s.n_q, s.n_k, q.device
            )
        exact = reference_outputs(q, k, v, dout, dlse, **reference)
        plain = reference_outputs(q, k, v, dout, dlse, compute_dtype=None, **reference)
        for name, a, e, p in zip(NAMES, ours, exact, plain, strict=True):
            assert a.dtype == (torch.float32 if name == "lse" else dtype), name
            assert_close_to_reference(f"{name} ({dtype})", a, e, p)
        for _ in range(2 if case.deterministic else 0):
            torch.manual_seed(1)  # the first call's dropout seed
            for name, a, b in zip(NAMES, ours, call(), strict=True):
                assert torch.equal(a, b), f"{name} ({dtype}): a deterministic call did not repeat bit for bit"


def _cases(**by_size) -> list:
    return target_params(by_size)


# Windows narrower than the sequences, so key tiles are skipped as well as masked; n_q > n_k with a
# small right bound leaves the first rows with no key at all.
WINDOWS = _cases(
    tiny=[
        Case(Shape(1, 45, 45, 2, 1, 16), window=(8, -1), dtype=F32),
        Case(Shape(1, 40, 60, 2, 2, 24), window=(-1, 5), dtype=F16),
        Case(Shape(2, 50, 33, 2, 1, 16), window=(6, 3), dtype=F32),
        Case(Shape(1, 45, 45, 2, 2, 16), causal=True, window=(10, -1), dtype=F16),
        Case(Shape(1, 37, 37, 1, 1, 16), window=(0, 0), dtype=F32),
    ],
    cpu=[
        Case(Shape(2, 1000, 1000, 2, 1, 64), window=(200, -1), dtype=F32),
        Case(Shape(1, 600, 1300, 2, 2, 72), window=(-1, 100), dtype=F16),
        Case(Shape(2, 900, 500, 4, 1, 40), window=(60, 30), dtype=BF16),
        Case(Shape(1, 1000, 1000, 2, 2, 64), causal=True, window=(333, -1), dtype=F32),
        Case(Shape(1, 257, 257, 2, 1, 64), window=(0, 0), dtype=F16),
    ],
    gpu=[
        Case(Shape(2, 2048, 2048, 8, 2, 128), window=(256, -1)),
        Case(Shape(1, 1500, 3000, 4, 4, 64), window=(-1, 200)),
        Case(Shape(2, 3000, 1000, 4, 1, 96), window=(128, 64)),
        Case(Shape(1, 4096, 4096, 8, 2, 64), causal=True, window=(1000, -1)),
        Case(Shape(1, 1000, 1000, 4, 4, 128), causal=True, window=(0, 0)),
        # whole 128-row tiles: the sm90 Gluon kernels' sliding window
        Case(Shape(2, 1024, 1024, 8, 4, 128), causal=True, window=(200, -1)),
        Case(Shape(1, 1024, 1024, 4, 4, 128), causal=True, window=(0, 0)),
        # and a span of 2048+ keys: the sm90 fused backward, masking every step
        Case(Shape(1, 4096, 4096, 4, 2, 64), causal=True, window=(2500, -1)),
    ],
)


@pytest.mark.parametrize("backend,case", WINDOWS, indirect=["backend"])
def test_window(backend, case):
    check_case(backend, case)


EMPTY_ROWS = _cases(
    tiny=[Case(Shape(2, 50, 30, 4, 2, 24), window=(5, 2))],
    cpu=[Case(Shape(2, 700, 300, 4, 2, 64), window=(50, 10))],
    gpu=[Case(Shape(2, 2000, 900, 8, 2, 128), window=(200, 20))],
)


@pytest.mark.parametrize("backend,case", EMPTY_ROWS, indirect=["backend"])
def test_window_rows_without_keys_are_zero_not_nan(backend, case):
    """With offset = n_k - n_q < 0, rows i < -(offset + right) see no key: out 0, lse +inf, grads 0."""
    s = case.shape
    q, k, v = random_qkv(s, torch.float16, backend.device)
    out, lse, _ = flash_attn_func(q, k, v, window_size=case.window, return_attn_probs=True)
    out.backward(torch.randn_like(out))
    empty = s.n_q - s.n_k - case.window[1]
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    assert torch.isposinf(lse[:, :, :empty]).all() and torch.isfinite(lse[:, :, empty:]).all()
    assert torch.equal(q.grad[:, :empty], torch.zeros_like(q.grad[:, :empty]))
    for x in (out, q.grad, k.grad, v.grad):
        assert not torch.isnan(x).any()
    assert q.grad[:, empty:].abs().amax() > 0


SOFTCAP = _cases(
    tiny=[
        Case(Shape(1, 40, 40, 2, 1, 16), softcap=1.5, dtype=F32),
        Case(Shape(1, 33, 50, 2, 2, 24), causal=True, softcap=3.0, dtype=F16),
        # a cap far above the scores: tanh near 0, where 1 - 2 / (exp(2x) + 1) cancels by the cap's size
        Case(Shape(1, 40, 40, 2, 1, 16), softcap=1e5, dtype=F32),
    ],
    cpu=[
        Case(Shape(2, 300, 300, 4, 2, 64), softcap=2.0, dtype=F32),
        Case(Shape(1, 1000, 700, 2, 1, 96), causal=True, softcap=5.0, dtype=BF16),
    ],
    gpu=[
        Case(Shape(2, 1000, 1000, 8, 2, 128), softcap=2.0),
        Case(Shape(1, 4096, 4096, 8, 8, 64), causal=True, softcap=5.0),
        Case(Shape(1, 1000, 1000, 4, 2, 64), softcap=1e5, dtype=F32),
    ],
)


@pytest.mark.parametrize("backend,case", SOFTCAP, indirect=["backend"])
def test_softcap(backend, case):
    check_case(backend, case)


ALIBI = _cases(
    tiny=[
        Case(Shape(1, 40, 40, 4, 2, 16), alibi="h", dtype=F16),
        Case(Shape(2, 30, 45, 2, 1, 16), causal=True, alibi="bh", dtype=F32),
    ],
    cpu=[
        Case(Shape(2, 500, 500, 4, 2, 64), alibi="h", dtype=F32),
        Case(Shape(2, 300, 800, 4, 4, 64), causal=True, alibi="bh", dtype=F16),
    ],
    gpu=[
        Case(Shape(2, 2048, 2048, 8, 2, 128), alibi="h"),
        Case(Shape(2, 1000, 1500, 8, 8, 64), causal=True, alibi="bh"),
    ],
)


@pytest.mark.parametrize("backend,case", ALIBI, indirect=["backend"])
def test_alibi(backend, case):
    check_case(backend, case)


DROPOUT = _cases(
    tiny=[
        Case(Shape(2, 40, 40, 2, 1, 16), dropout_p=0.17, dtype=F32),
        Case(Shape(1, 33, 50, 2, 2, 24), causal=True, dropout_p=0.3, dtype=F16),
    ],
    cpu=[
        Case(Shape(2, 300, 300, 4, 2, 64), dropout_p=0.1, dtype=F32),
        Case(Shape(1, 300, 600, 2, 1, 72), causal=True, dropout_p=0.3, dtype=BF16),
    ],
    gpu=[
        Case(Shape(2, 1000, 1000, 8, 2, 128), dropout_p=0.1),
        Case(Shape(1, 2000, 3000, 4, 2, 64), causal=True, dropout_p=0.25),
    ],
)


@pytest.mark.parametrize("backend,case", DROPOUT, indirect=["backend"])
def test_dropout(backend, case):
    check_case(backend, case)


ONE_SHAPE = {
    "tiny": [Shape(2, 33, 40, 2, 1, 16)],
    "cpu": [Shape(2, 300, 200, 2, 1, 72)],
    "gpu": [Shape(2, 1000, 700, 8, 2, 72)],
}


@pytest.mark.parametrize("backend,shape", target_params(ONE_SHAPE), indirect=["backend"])
def test_dropout_follows_torch_manual_seed(backend, shape):
    """The same torch seed replays the mask bit for bit (forward and backward); another seed does not."""
    q, k, v = random_qkv(shape, torch.float16, backend.device)
    dout = torch.randn(q.shape, dtype=q.dtype, device=q.device)
    runs = []
    for seed in (1, 1, 2):
        for x in (q, k, v):
            x.grad = None
        torch.manual_seed(seed)  # the only seeding: the call draws its dropout seed from torch's generator
        out = flash_attn_func(q, k, v, dropout_p=0.2, causal=True)
        out.backward(dout)
        runs.append((out, q.grad, k.grad, v.grad))
    for a, b in zip(runs[0], runs[1], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(runs[0], runs[2], strict=True):
        assert not torch.equal(a, b)


KEEP_SHAPE = {
    "tiny": [Shape(1, 64, 64, 2, 1, 64)],
    "cpu": [Shape(2, 512, 256, 4, 2, 256)],
    "gpu": [Shape(4, 1024, 256, 8, 2, 256)],
}


@pytest.mark.parametrize("backend,shape", target_params(KEEP_SHAPE), indirect=["backend"])
def test_dropout_keeps_one_minus_p(backend, shape):
    """With V = identity the output row is the dropped probability row itself: its zeros are the
    dropped entries. They must be exactly dropout.keep's, and a fraction p of all entries."""
    p = 0.3
    q, k, _ = random_qkv(shape, torch.float16, backend.device, requires_grad=False)
    eye = torch.eye(shape.n_k, dtype=q.dtype, device=q.device)[None, :, None, :]
    v = eye.expand(shape.batch, shape.n_k, shape.heads_k, shape.n_k)
    seed = _seed_of_next_call(3)
    out = flash_attn_func(q * 0.5, k, v, dropout_p=p)  # small scores: no probability underflows to 0
    kept = (out != 0).transpose(1, 2)  # (batch, heads, n_q, n_k)
    mask = dropout.dropout_mask(seed, p, shape.batch, shape.heads, shape.n_q, shape.n_k, q.device)
    assert torch.equal(kept, mask)
    n = kept.numel()
    assert abs(kept.float().mean().item() - (1 - p)) < 6 * math.sqrt(p * (1 - p) / n)


PROBS = _cases(
    tiny=[Case(Shape(2, 20, 30, 2, 1, 16), causal=True, window=(12, -1), softcap=2.0, alibi="bh", dropout_p=0.25)],
    cpu=[Case(Shape(2, 200, 300, 4, 2, 64), causal=True, window=(100, -1), softcap=2.0, alibi="bh", dropout_p=0.25)],
    gpu=[Case(Shape(2, 500, 700, 8, 2, 64), causal=True, window=(300, -1), softcap=2.0, alibi="bh", dropout_p=0.25)],
)


@pytest.mark.parametrize("backend,case", PROBS, indirect=["backend"])
def test_dropout_returns_probabilities_with_dropped_entries_negative(backend, case):
    """return_attn_probs=True with dropout: the probabilities (batch, nheads, n_q, n_k) before
    dropout, negated where dropped (flash_attn's S_dmask convention)."""
    s = case.shape
    q, k, _ = random_qkv(s, torch.float16, backend.device, requires_grad=False)
    v = torch.randn_like(k)
    slopes = _alibi_slopes(case, backend.device)
    options = dict(causal=case.causal, window_size=case.window, softcap=case.softcap, alibi_slopes=slopes)
    seed = _seed_of_next_call(4)
    _, _, probs = flash_attn_func(q, k, v, dropout_p=case.dropout_p, return_attn_probs=True, **options)
    assert probs.shape == (s.batch, s.heads, s.n_q, s.n_k)
    # attention against V = identity returns the probabilities themselves
    eye = torch.eye(s.n_k, dtype=q.dtype, device=q.device)[None, :, None, :].expand(s.batch, s.n_k, s.heads_k, s.n_k)
    exact, plain = (
        attention_reference(q, k, eye, compute_dtype=dtype, **options)[0].transpose(1, 2)
        for dtype in (torch.float64, None)
    )
    assert_close_to_reference("probs", probs.abs(), exact, plain)
    dropped = ~dropout.dropout_mask(seed, case.dropout_p, s.batch, s.heads, s.n_q, s.n_k, q.device)
    # the sign is checked where fp32 keeps it; below 1e-30 a probability may round to -0.0 (not < 0)
    sure = exact > 1e-30
    assert torch.equal((probs < 0)[sure], dropped[sure])
    assert not (probs < 0)[~dropped].any()


MIXED = _cases(
    tiny=[
        Case(
            Shape(2, 45, 38, 4, 2, 24), causal=True, window=(12, -1), softcap=2.0, alibi="bh", dropout_p=0.2, dtype=F32
        )
    ],
    cpu=[
        Case(
            Shape(2, 300, 260, 2, 1, 64),
            causal=True,
            window=(150, -1),
            softcap=3.0,
            alibi="bh",
            dropout_p=0.2,
            dtype=F32,
        )
    ],
    gpu=[
        Case(Shape(2, 1500, 1300, 8, 2, 128), causal=True, window=(300, -1), softcap=3.0, alibi="bh", dropout_p=0.2),
        Case(Shape(1, 1000, 2000, 4, 4, 64), window=(200, 100), softcap=5.0, alibi="h", dropout_p=0.1),
    ],
)


@pytest.mark.parametrize("backend,case", MIXED, indirect=["backend"])
def test_all_features_together(backend, case):
    check_case(backend, case)


BLOCK_MASKED = _cases(
    tiny=[Case(Shape(2, 70, 70, 2, 1, 16), mods=True, softcap=3.0, dropout_p=0.1, dtype=F32)],
    cpu=[Case(Shape(2, 300, 300, 2, 1, 64), mods=True, softcap=3.0, dropout_p=0.1, dtype=F32)],
    gpu=[Case(Shape(2, 2048, 2048, 8, 2, 128), mods=True, softcap=3.0, dropout_p=0.1)],
)


@pytest.mark.parametrize("backend,case", BLOCK_MASKED, indirect=["backend"])
def test_block_mask_and_score_mod_with_softcap_and_dropout(backend, case):
    """The reference applies the block mask's element mask and differentiates the score_mod by autograd."""
    check_case(backend, case)


@triton.jit
def _hidden(b, q_idx, kv_idx, bounds):
    """Keys below bounds[b, 0] and rows below bounds[b, 1]."""
    return (kv_idx < tl.load(bounds + 2 * b)) | (q_idx < tl.load(bounds + 2 * b + 1))


@triton.jit
def _hide_by_score(score, b, h, q_idx, kv_idx, bounds):
    return tl.where(_hidden(b, q_idx, kv_idx, bounds), float("-inf"), score)


@triton.jit
def _hide_by_score_grad(score, b, h, q_idx, kv_idx, bounds):
    return tl.where(_hidden(b, q_idx, kv_idx, bounds), 0.0, 1.0)


@dataclass(frozen=True)
class Hidden:
    """A dense call whose score_mod hides, in batch b, the keys below bounds[b][0] (whole key tiles that the kernels
    stream without a mask) and the rows below bounds[b][1] (causal: past the hidden keys, so that rows which would
    see keys see none)."""

    shape: Shape
    causal: bool
    bounds: tuple[tuple[int, int], ...]

    def __str__(self) -> str:
        hidden = ",".join(f"k{keys}r{rows}" for keys, rows in self.bounds)
        return f"{self.shape}{'-causal' if self.causal else ''}-hide-{hidden}"


HIDDEN_BY_SCORE = target_params(
    {
        "tiny": [Hidden(Shape(2, 100, 100, 2, 1, 16), False, ((64, 5), (17, 0))),
                 Hidden(Shape(1, 90, 90, 1, 1, 16), True, ((40, 50),))],
        "cpu": [Hidden(Shape(2, 300, 300, 2, 1, 64), False, ((150, 5), (0, 0))),
                Hidden(Shape(1, 300, 300, 2, 2, 32), True, ((130, 150),))],
        "gpu": [Hidden(Shape(2, 1024, 1024, 4, 2, 128), False, ((300, 70), (0, 0))),
                Hidden(Shape(1, 1000, 1000, 4, 4, 64), True, ((520, 600),))],
    }
)  # fmt: skip


@pytest.mark.parametrize("backend,case", HIDDEN_BY_SCORE, indirect=["backend"])
def test_a_score_mod_that_hides_keys_with_minus_inf(backend, case):
    """FlexAttention's idiom of a mask written as a score_mod (-inf where hidden) against the same mask given to the
    reference: rows that still see keys are exact, rows that see none give 0 and an LSE of +inf, with no NaN."""
    shape, causal = case.shape, case.causal
    bounds = torch.tensor(case.bounds, dtype=torch.int32, device=backend.device)
    for dtype in dtypes_for(backend) if backend.device == "cuda" else [F32]:
        q, k, v = random_qkv(shape, dtype, backend.device, requires_grad=False)
        dout = torch.randn(q.shape, dtype=dtype, device=q.device)
        dlse = torch.randn(shape.batch, shape.heads, shape.n_q, device=q.device)
        ours = _run_dense(
            q, k, v, dout, dlse, causal=causal, score_mod=Mod(_hide_by_score, (bounds,), _hide_by_score_grad)
        )
        i = torch.arange(shape.n_q, device=q.device)[:, None]
        j = torch.arange(shape.n_k, device=q.device)[None, :]
        mask = torch.stack([(j >= keys) & (i >= rows) for keys, rows in case.bounds])[:, None]  # (B, 1, Nq, Nk)
        exact = reference_outputs(q, k, v, dout, dlse, causal, mask=mask)
        plain = reference_outputs(q, k, v, dout, dlse, causal, compute_dtype=None, mask=mask)
        for name, a, e, p in zip(NAMES, ours, exact, plain, strict=True):
            assert_close_to_reference(f"{name} ({dtype})", a, e, p)
        assert (ours[1][exact[1].isinf()] == math.inf).all(), "rows that see no key: LSE +inf"


# Lengths 0 and 1, n_q > n_k (the last sequence in "tiny" sees no key at all), n_q < n_k, GQA.
SEQLENS = {
    "tiny": Seqlens(q=(5, 0, 1, 17, 40, 3), k=(7, 3, 1, 17, 25, 0), heads=4, heads_k=2, head_dim=16),
    "cpu": Seqlens(q=(1, 0, 130, 300, 77, 260), k=(1, 5, 200, 530, 40, 0), heads=2, heads_k=1, head_dim=64),
    "gpu": Seqlens(
        q=(1, 0, 1000, 2048, 333, 700, 17), k=(1, 9, 1500, 2048, 200, 0, 900), heads=8, heads_k=2, head_dim=128
    ),
}
SELF_SEQLENS = {  # one cu_seqlens for q and k, as flash_attn_varlen_qkvpacked_func takes
    "tiny": Seqlens(q=(9, 1, 0, 33), k=(9, 1, 0, 33), heads=2, heads_k=2, head_dim=24),
    "cpu": Seqlens(q=(100, 1, 0, 530), k=(100, 1, 0, 530), heads=2, heads_k=2, head_dim=64),
    "gpu": Seqlens(q=(1000, 1, 0, 3000, 77), k=(1000, 1, 0, 3000, 77), heads=8, heads_k=8, head_dim=64),
}


# sequences of whole 128-row tiles (one empty): the sm90 Gluon kernels' varlen path; the longest sequence of
# LONG_TILED_SEQLENS gives a span of 2048+ keys: the fused backward
TILED_SEQLENS = Seqlens(q=(256, 0, 1024, 128), k=(256, 0, 1024, 128), heads=8, heads_k=4, head_dim=128)
LONG_TILED_SEQLENS = Seqlens(q=(2048, 128, 2304), k=(2048, 128, 2304), heads=4, heads_k=2, head_dim=64)
# D=256: whole 64-row tiles; the backward's warpgroups split D
TILED_256_SEQLENS = Seqlens(q=(192, 0, 640, 64), k=(192, 0, 640, 64), heads=4, heads_k=2, head_dim=256)


def _varlen_cases(size: str) -> list[Case]:
    lens, same = SEQLENS[size], SELF_SEQLENS[size]
    window = {"tiny": (6, 2), "cpu": (64, 16), "gpu": (256, 32)}[size]
    every_feature = dict(causal=True, window=(window[0], -1), softcap=3.0, alibi="h", dropout_p=0.15)
    if size == "tiny":
        # Triton's interpreter: the plain batch, every feature at once, and the two packed entry points (which
        # take the rest: a two-sided window, per-sequence ALiBi slopes, dropout without a left bound)
        return [
            Case(lens),
            Case(lens, **every_feature, dtype=F32),
            Case(same, api="qkvpacked", causal=True, dropout_p=0.1, dtype=F16),
            Case(lens, api="kvpacked", window=window, alibi="bh", dtype=F32),
        ]
    one_by_one = [
        (Case(lens), F32),
        (Case(lens, causal=True), F16),
        (Case(lens, window=window, softcap=2.0), BF16),
        (Case(lens, causal=True, alibi="bh"), F32),
        (Case(lens, dropout_p=0.2), F16),
        (Case(lens, **every_feature), F32),
        (Case(same, api="qkvpacked", causal=True, dropout_p=0.1), BF16),
        (Case(lens, api="kvpacked", window=window, alibi="bh"), F16),
    ]
    if size == "cpu":
        return [replace(case, dtype=dtype) for case, dtype in one_by_one]
    tiled = [Case(TILED_SEQLENS), Case(TILED_SEQLENS, causal=True), Case(TILED_SEQLENS, causal=True, window=(200, -1))]
    tiled.append(Case(LONG_TILED_SEQLENS))
    tiled += [Case(TILED_256_SEQLENS), Case(TILED_256_SEQLENS, causal=True, window=(100, -1))]
    return tiled + [case for case, _ in one_by_one]


VARLEN = _cases(**{size: _varlen_cases(size) for size in SEQLENS})


@pytest.mark.parametrize("backend,case", VARLEN, indirect=["backend"])
def test_varlen(backend, case):
    """Each sequence of the packed batch against the reference on that sequence alone."""
    check_case(backend, case)


def _deterministic(shape: Shape | Seqlens, dtype: torch.dtype | None = None, **features) -> Case:
    return Case(shape, dtype=dtype, deterministic=True, **features)


# The features with deterministic=True: a window with GQA and ALiBi (on the GPU in shapes the sm90 kernels take, whose
# default backward adds dQ's shares up in no fixed order), softcap with dropout (its seed drawn again from the same
# torch seed), a varlen batch with all of them, and a block mask with a score_mod and dropout.
EVERY_VARLEN_FEATURE = dict(causal=True, softcap=3.0, alibi="h", dropout_p=0.15)
DETERMINISTIC = _cases(
    tiny=[
        _deterministic(Shape(2, 37, 45, 2, 1, 24), F16, causal=True, window=(10, -1), alibi="bh"),
        _deterministic(Shape(1, 40, 29, 2, 1, 16), F32, softcap=2.0, dropout_p=0.2),
        _deterministic(
            Seqlens(q=(5, 0, 33, 17), k=(9, 3, 20, 17), heads=2, heads_k=1, head_dim=16),
            F16,
            window=(6, -1),
            **EVERY_VARLEN_FEATURE,
        ),
        _deterministic(Shape(1, 40, 40, 2, 1, 16), F32, mods=True, dropout_p=0.1),
    ],
    cpu=[
        _deterministic(Shape(2, 300, 260, 4, 2, 64), BF16, causal=True, window=(100, -1), alibi="bh"),
        _deterministic(Shape(1, 260, 530, 2, 1, 40), F32, softcap=2.0, dropout_p=0.2),
        _deterministic(SEQLENS["cpu"], F16, window=(64, -1), **EVERY_VARLEN_FEATURE),
        _deterministic(Shape(2, 200, 200, 2, 1, 64), F32, mods=True, dropout_p=0.1),
    ],
    gpu=[
        _deterministic(Shape(1, 4096, 4096, 4, 2, 64), causal=True, window=(2500, -1)),
        _deterministic(Shape(2, 1024, 1024, 4, 2, 256), causal=True, window=(300, -1)),
        _deterministic(Shape(2, 1000, 1300, 8, 2, 96), softcap=2.0, alibi="bh", dropout_p=0.15),
        _deterministic(TILED_SEQLENS, causal=True, window=(200, -1)),
        _deterministic(SEQLENS["gpu"], window=(256, -1), **EVERY_VARLEN_FEATURE),
        _deterministic(Shape(2, 2048, 2048, 8, 2, 128), mods=True, dropout_p=0.1),
    ],
)


@pytest.mark.parametrize("backend,case", DETERMINISTIC, indirect=["backend"])
def test_deterministic_with_features(backend, case):
    """Right against the reference, and bitwise the same out, LSE and gradients over three calls."""
    check_case(backend, case)


LAYOUT_SHAPES = {
    "tiny": [Shape(1, 40, 50, 2, 1, 16)],
    "cpu": [Shape(2, 300, 260, 4, 2, 64)],
    "gpu": [Shape(2, 1000, 1300, 8, 2, 128)],
}


@pytest.mark.parametrize("backend,shape", target_params(LAYOUT_SHAPES), indirect=["backend"])
def test_block_layout_without_mask_mod(backend, shape):
    """A bare block layout (every listed tile full, no mask_mod), per head, against the reference."""
    block = (16, 16) if backend.size == "tiny" else (128, 128)
    tiles = (math.ceil(shape.n_q / block[0]), math.ceil(shape.n_k / block[1]))
    layout = torch.rand(1, shape.heads, *tiles, generator=torch.Generator().manual_seed(1)) < 0.4
    mask = BlockMask.from_layout(layout.to(backend.device), block, seqlen_q=shape.n_q, seqlen_k=shape.n_k)
    for dtype in dtypes_for(backend):
        q, k, v = random_qkv(shape, dtype, backend.device)
        dout = torch.randn(q.shape, dtype=dtype, device=q.device)
        dlse = torch.randn(shape.batch, shape.heads, shape.n_q, device=q.device)
        out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, block_mask=mask)
        _backprop(out, lse, dout, dlse)
        ours = (out.detach(), lse.detach(), q.grad, k.grad, v.grad)
        options = dict(mask=mask.element_mask())
        exact = reference_outputs(q, k, v, dout, dlse, False, **options)
        plain = reference_outputs(q, k, v, dout, dlse, False, compute_dtype=None, **options)
        for name, a, e, p in zip(("out", "lse", "dq", "dk", "dv"), ours, exact, plain, strict=True):
            assert_close_to_reference(f"{name} ({dtype})", a, e, p)
