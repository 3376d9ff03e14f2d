"""flash_attn's calling conventions, against the fp64 reference: any head dim from 1 to 256 (run zero-padded to a
multiple of 8), any finite softmax_scale (0 and negative ones included), window_size as a list or a tensor, and
what return_attn_probs returns with dropout."""

from itertools import accumulate

import numpy as np
import pytest
import torch
import triton

import flashtriton as ft
from flashtriton import dropout, ops
from helpers import TARGETS, Shape, assert_close_to_reference, random_qkv, reference_outputs, target_params

NAMES = ("out", "lse", "dq", "dk", "dv")
NOT_INTERPRETED = [t for t in TARGETS if t.name != "cpu-interp"]  # for what does not depend on the kernels


def _cases(names, interpreted):
    """pytest params (target, name): every name on the PyTorch path and the GPU; in the interpreter, where a call
    takes seconds, only those of ``interpreted`` (the conventions are met above the kernels: one case per kernel
    path shows the kernels get what they take)."""
    return [
        pytest.param(target, name, id=f"{target}-{name}")
        for target in TARGETS
        for name in names
        if target.name != "cpu-interp" or name in interpreted
    ]


def _check(q, k, v, call, causal, softmax_scale=None, cu_seqlens=None, **options):
    """call(q, k, v) -> (out, lse, _): out, lse and the three gradients against the reference's."""
    dout = torch.randn(q.shape, dtype=q.dtype, device=q.device)
    out, lse, _ = call(q, k, v)
    dlse = torch.randn_like(lse)
    finite = torch.isfinite(lse)
    ((out * dout).sum() + (lse[finite] * dlse[finite]).sum()).backward()
    ours = (out.detach(), lse.detach(), q.grad, k.grad, v.grad)
    exact, plain = (
        reference_outputs(q, k, v, dout, dlse, causal, softmax_scale, dtype, cu_seqlens=cu_seqlens, **options)
        for dtype in (torch.float64, None)
    )
    for name, a, e, p in zip(NAMES, ours, exact, plain, strict=True):
        assert_close_to_reference(name, a, e, p)


def _spy_kernel_inputs(monkeypatch) -> list[tuple[int, float]]:
    """The (head dim, softmax_scale) of each call that reaches ops.attention, the layer below the API."""
    seen, attention = [], ops.attention

    def spy(q, k, v, params, **options):
        seen.append((q.shape[-1], params.softmax_scale))
        return attention(q, k, v, params, **options)

    monkeypatch.setattr(ops, "attention", spy)
    return seen


# head dims that are not multiples of 8 (1, 5, 59, 111, 255) and one that is (200), GQA, causal rows without keys
ODD_HEAD_DIMS = {
    "tiny": [Shape(1, 9, 12, 2, 1, 1), Shape(1, 7, 9, 1, 1, 59), Shape(1, 5, 6, 1, 1, 111)],
    "cpu": [
        Shape(2, 17, 33, 2, 1, 1),
        Shape(1, 33, 17, 4, 2, 5),
        Shape(1, 40, 40, 2, 2, 59),
        Shape(1, 50, 70, 2, 1, 111),
        Shape(1, 30, 30, 2, 2, 200),
    ],
    "gpu": [
        Shape(2, 1000, 1000, 8, 2, 1),
        Shape(1, 777, 1300, 4, 2, 5),
        Shape(2, 1024, 1024, 4, 2, 59),  # padded to 64: whole tiles, the sm90 kernels
        Shape(1, 1500, 1500, 4, 4, 111),
        Shape(2, 300, 200, 4, 2, 200),
        Shape(1, 513, 513, 2, 1, 255),
    ],
}


@pytest.mark.parametrize("backend,shape", target_params(ODD_HEAD_DIMS), indirect=["backend"])
def test_any_head_dim_matches_reference(backend, shape, monkeypatch):
    """The kernels see the head dim rounded up to a multiple of 8; out, the LSE and the gradients have the caller's
    head dim and the reference's values, with the default scale 1 / sqrt(the caller's head dim)."""
    seen = _spy_kernel_inputs(monkeypatch)
    q, k, v = random_qkv(shape, torch.float16, backend.device)
    _check(q, k, v, lambda q, k, v: ft.flash_attn_func(q, k, v, causal=True, return_attn_probs=True), causal=True)
    assert seen == [(-(-shape.head_dim // 8) * 8, pytest.approx(shape.head_dim**-0.5, rel=1e-15))]
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


# Each public entry point, called on separate q, k, v (the packed ones through torch.stack, whose backward needs
# gradients of the caller's head dim): dense (batch, n, heads, dim) or varlen (total, heads, dim) with cu_seqlens.
DENSE_ENTRIES = {
    "func": lambda q, k, v, **kw: ft.flash_attn_func(q, k, v, **kw),
    "qkvpacked": lambda q, k, v, **kw: ft.flash_attn_qkvpacked_func(torch.stack([q, k, v], dim=2), **kw),
    "kvpacked": lambda q, k, v, **kw: ft.flash_attn_kvpacked_func(q, torch.stack([k, v], dim=2), **kw),
}
VARLEN_ENTRIES = {
    "varlen": lambda q, k, v, cu, n, **kw: ft.flash_attn_varlen_func(q, k, v, cu, cu, n, n, **kw),
    "varlen-qkvpacked": lambda q, k, v, cu, n, **kw: ft.flash_attn_varlen_qkvpacked_func(
        torch.stack([q, k, v], dim=1), cu, n, **kw
    ),
    "varlen-kvpacked": lambda q, k, v, cu, n, **kw: ft.flash_attn_varlen_kvpacked_func(
        q, torch.stack([k, v], dim=1), cu, cu, n, n, **kw
    ),
}
LENGTHS = (5, 0, 11)  # of the varlen batch, an empty sequence among them


@pytest.mark.parametrize(("backend", "entry"), _cases([*DENSE_ENTRIES, *VARLEN_ENTRIES], {"func", "varlen"}),
                         indirect=["backend"])  # fmt: skip
def test_every_entry_point_pads_the_head_dim(backend, entry, monkeypatch):
    """Head dim 5 and a negative scale through each entry point: the kernels get a head dim of 8 and a positive
    scale, the caller the reference's out, LSE and gradients at head dim 5."""
    seen = _spy_kernel_inputs(monkeypatch)
    options = dict(causal=True, softmax_scale=-0.4, window_size=[6, -1])
    dim, heads, device = 5, 2, backend.device
    if entry in DENSE_ENTRIES:
        q, k, v = random_qkv(Shape(2, 13, 13, heads, heads, dim), torch.float16, device)
        call, cu_seqlens = DENSE_ENTRIES[entry], None
    else:
        q, k, v = (torch.randn(sum(LENGTHS), heads, dim, dtype=torch.float16, device=device) for _ in range(3))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        cu = torch.tensor([0, *accumulate(LENGTHS)], dtype=torch.int32, device=device)
        call, cu_seqlens = (lambda *qkv, **kw: VARLEN_ENTRIES[entry](*qkv, cu, max(LENGTHS), **kw)), (cu, cu)
    _check(q, k, v, lambda *qkv: call(*qkv, return_attn_probs=True, **options), cu_seqlens=cu_seqlens, **options)
    assert seen == [(8, 0.4)]


# (softmax_scale, options): the plain scores of the kernels (causal and a ragged last tile: masked tiles), and the
# modified ones (softcap, ALiBi, a window), each with a negative, a zero and an integer scale
SCALES = {
    "negative-causal": (-0.7, dict(causal=True)),
    "zero-causal": (0.0, dict(causal=True)),
    "negative-zero": (-0.0, dict()),
    "int": (2, dict(causal=False)),
    "negative-int-softcap": (-3, dict(causal=True, softcap=2.0)),
    "zero-softcap": (0, dict(causal=False, softcap=2.0)),
    "negative-window-alibi": (-0.5, dict(causal=False, window_size=(4, 2), alibi=True)),
}
# the GPU's in whole tiles: the sm90 kernels serve its plain cases, the portable ones the others
SCALE_SHAPES = {
    "tiny": Shape(1, 19, 23, 2, 1, 16),
    "cpu": Shape(2, 19, 23, 2, 1, 16),
    "gpu": Shape(2, 1024, 1024, 4, 2, 128),
}


@pytest.mark.parametrize(("backend", "case"), _cases(SCALES, {"negative-causal", "zero-softcap"}), indirect=["backend"])
def test_any_finite_softmax_scale(backend, case):
    scale, options = SCALES[case]
    shape = SCALE_SHAPES[backend.size]
    q, k, v = random_qkv(shape, torch.float16, backend.device)
    options = dict(options)
    causal = options.pop("causal", False)
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.rand(shape.heads, device=backend.device)

    def call(q, k, v):
        return ft.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_attn_probs=True, **options)

    _check(q, k, v, call, causal, scale, **options)
    if scale == 0:  # every visible key weighs the same: q's gradient is 0
        assert torch.equal(q.grad, torch.zeros_like(q.grad))


@pytest.mark.parametrize("backend", NOT_INTERPRETED, ids=str, indirect=True)
def test_window_size_as_list_or_tensor(backend):
    """flash_attn's tests pass window_size as a CPU tensor: any pair of ints gives the tuple's output."""
    q, k, v = random_qkv(Shape(2, 30, 40, 2, 1, 32), torch.float16, backend.device, requires_grad=False)
    expected = ft.flash_attn_func(q, k, v, window_size=(3, 1))
    exact, plain = (
        ft.attention_reference(q, k, v, window_size=(3, 1), compute_dtype=d)[0] for d in (torch.float64, None)
    )
    assert_close_to_reference("out", expected, exact, plain)
    pairs = [
        [3, 1],
        torch.tensor([3, 1]),
        torch.tensor([3, 1], dtype=torch.int32),
        tuple(torch.tensor([3, 1])),  # 0-d tensors
        (np.int64(3), np.int32(1)),
        np.array([3, 1]),
    ]
    for pair in pairs:
        assert torch.equal(ft.flash_attn_func(q, k, v, window_size=pair), expected), pair
    packed = [x.flatten(0, 1) for x in (q, k, v)]
    cu_q, cu_k = (torch.tensor([0, n, 2 * n], dtype=torch.int32, device=q.device) for n in (30, 40))
    varlen = ft.flash_attn_varlen_func(*packed, cu_q, cu_k, 30, 40, window_size=(3, 1))
    assert torch.equal(ft.flash_attn_varlen_func(*packed, cu_q, cu_k, 30, 40, window_size=torch.tensor([3, 1])), varlen)


@pytest.mark.parametrize("backend", NOT_INTERPRETED, ids=str, indirect=True)
def test_scalar_options_as_0d_tensors_or_arrays(backend):
    """softmax_scale, softcap, dropout_p, causal and deterministic as 0-d tensors or numpy values (a custom op's float
    and bool arguments take them, flash_attn's among them): the Python values' results."""
    q, k, v = random_qkv(Shape(2, 30, 40, 2, 1, 32), torch.float16, backend.device, requires_grad=False)
    expected = ft.flash_attn_func(q, k, v, softmax_scale=0.3, softcap=2.0, causal=True, deterministic=True)
    scalars = dict(softmax_scale=torch.tensor(0.3), softcap=np.float64(2.0), causal=torch.tensor(True),
                   deterministic=np.array(True), dropout_p=torch.tensor(0.0))  # fmt: skip
    assert torch.equal(ft.flash_attn_func(q, k, v, **scalars), expected)
    with pytest.raises(TypeError, match="causal must be a bool"):
        ft.flash_attn_func(q, k, v, causal=torch.tensor(2))
    with pytest.raises(TypeError, match="softmax_scale is a tensor that requires grad"):
        ft.flash_attn_func(q, k, v, softmax_scale=torch.tensor(0.3, requires_grad=True))


@pytest.mark.parametrize("backend", NOT_INTERPRETED, ids=str, indirect=True)
def test_a_window_bound_of_seqlen_k_or_more_is_none(backend):
    """flash_attn drops a bound of seqlen_k keys or more (max_seqlen_k, varlen) before anything else: with more
    queries than keys, a right bound that long would still hide every key from the first queries."""
    q, k, v = random_qkv(Shape(2, 8, 2, 2, 1, 16), torch.float32, backend.device, requires_grad=False)
    unbounded = ft.flash_attn_func(q, k, v)
    assert unbounded.abs().amin(-1).amin(-1).gt(0).all()  # every query sees a key: a bound that hid them would show
    for window in ((-1, 3), (2, 5), (7, 2)):
        torch.testing.assert_close(ft.flash_attn_func(q, k, v, window_size=window), unbounded, atol=0, rtol=0)
    packed = [x.flatten(0, 1) for x in (q, k, v)]
    cu_q, cu_k = (torch.tensor([0, n, 2 * n], dtype=torch.int32, device=q.device) for n in (8, 2))
    varlen = ft.flash_attn_varlen_func(*packed, cu_q, cu_k, 8, 2, window_size=(-1, 3))
    torch.testing.assert_close(varlen, unbounded.flatten(0, 1), atol=0, rtol=0)


@pytest.mark.parametrize("backend", TARGETS, ids=str, indirect=True)
def test_a_left_window_alone_is_bounded_right_at_seqlen_k(backend):
    """flash_attn's C++ gives a left window without a right bound one of seqlen_k keys (max_seqlen_k, varlen): with
    far more queries than keys, the first queries then see fewer keys, or none (out 0, LSE +inf, gradients 0)."""
    q, k, v = random_qkv(Shape(2, 10, 3, 2, 1, 16), torch.float32, backend.device)
    # query i sees keys i - 8 <= j <= i - 4 (offset 3 - 10): rows 0-3 none, rows 4-5 fewer than all three
    _check(q, k, v, lambda *qkv: ft.flash_attn_func(*qkv, window_size=(1, -1), return_attn_probs=True), False,
           window_size=(1, 3))  # fmt: skip
    out, lse, _ = ft.flash_attn_func(q, k, v, window_size=(1, -1), return_attn_probs=True)
    assert torch.equal(out[:, :4], torch.zeros_like(out[:, :4])) and torch.isinf(lse[..., :4]).all()
    assert torch.equal(q.grad[:, :4], torch.zeros_like(q.grad[:, :4]))
    packed = [x.detach().flatten(0, 1) for x in (q, k, v)]
    cu_q, cu_k = (torch.tensor([0, n, 2 * n], dtype=torch.int32, device=q.device) for n in (10, 3))
    varlen = ft.flash_attn_varlen_func(*packed, cu_q, cu_k, 10, 3, window_size=(1, -1))
    torch.testing.assert_close(varlen, out.detach().flatten(0, 1))
    # one query more than keys: that bound hides nothing (none is kept, the same out); two more: it hides key 2 from
    # query 0
    for n_q in (4, 5):
        q2 = q[:, :n_q].detach()
        exact, plain = (
            ft.attention_reference(q2, k, v, window_size=(1, 3), compute_dtype=d)[0] for d in (torch.float64, None)
        )
        assert_close_to_reference("out", ft.flash_attn_func(q2, k, v, window_size=(1, -1)), exact, plain)


def test_dropout_probs_carry_no_gradient():
    """return_attn_probs' P is for inspection: no gradient reaches q, k or ALiBi slopes through it, and it keeps no
    N x N graph alive."""
    q, k, v = (torch.randn(1, 12, 2, 16, requires_grad=True) for _ in range(3))
    slopes = torch.rand(2, requires_grad=True)
    out, _, probs = ft.flash_attn_func(q, k, v, 0.3, alibi_slopes=slopes, return_attn_probs=True)
    assert out.requires_grad and not probs.requires_grad and probs.grad_fn is None


@triton.jit
def _halve_score(score, b, h, q_idx, kv_idx):
    return score * 0.5


@pytest.mark.parametrize("layout", ["dense-mods", "varlen"])
@pytest.mark.parametrize("backend", NOT_INTERPRETED, ids=str, indirect=True)
def test_dropout_probs_sign_is_the_drop_mask(backend, layout):
    """With dropout, return_attn_probs gives P in fp32, negated exactly where dropped (torch.signbit, -0.0 too):
    P is the reference's with every option (a mask_mod and a score_mod included), its sign the mask dropout.keep
    draws from the call's seed, and out the reference's under that mask. Odd head dim, negative scale."""
    p_drop, scale, device = 0.3, -0.3, backend.device
    dense = layout == "dense-mods"
    lengths_q, lengths_k = ((21, 21), (26, 26)) if dense else ((7, 0, 12), (9, 4, 12))
    q = torch.randn(sum(lengths_q), 2, 13, dtype=torch.float16, device=device)
    k, v = (torch.randn(sum(lengths_k), 1, 13, dtype=torch.float16, device=device) for _ in range(2))
    starts_q, starts_k = ([0, *accumulate(n)] for n in (lengths_q, lengths_k))
    slopes = torch.rand(len(lengths_q), 2, device=device)
    torch.manual_seed(11)
    seed = int(dropout.draw_seed())  # the seed the call below draws
    torch.manual_seed(11)
    if dense:  # the same tokens as a batch of two, under a sliding window given as a mask_mod, and a score_mod
        mod = ft.Mod(_halve_score)
        batched = (x.unflatten(0, (2, -1)) for x in (q, k, v))
        out, _, probs = ft.flash_attn_func(*batched, p_drop, scale, return_attn_probs=True,
                                           mask_mod=ft.sliding_window_mask(5), score_mod=mod)  # fmt: skip
        out = out.flatten(0, 1)
        i, j = torch.arange(21, device=device)[:, None], torch.arange(26, device=device)
        options = [dict(mask=(j <= i) & (j >= i - 5), score_mod=mod)] * 2
    else:
        cu_q, cu_k = (torch.tensor(s, dtype=torch.int32, device=device) for s in (starts_q, starts_k))
        out, _, probs = ft.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 12, p_drop, scale, causal=True,
                                                  alibi_slopes=slopes, return_attn_probs=True)  # fmt: skip
        options = [dict(causal=True, alibi_slopes=slopes[b : b + 1]) for b in range(3)]
    assert probs.dtype == torch.float32 and probs.shape == (len(lengths_q), 2, max(lengths_q), max(lengths_k))
    for b, (n_q, n_k) in enumerate(zip(lengths_q, lengths_k, strict=True)):
        rows_q, rows_k = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
        q_b, k_b, v_b = q[None, rows_q], k[None, rows_k], v[None, rows_k]
        heads, queries, keys = (torch.arange(n, device=device) for n in (2, n_q, n_k))
        kept = dropout.keep(seed, b, heads[:, None, None], queries[:, None], keys, p_drop)
        assert torch.equal(torch.signbit(probs[b, :, :n_q, :n_k]), ~kept)
        assert not probs[b, :, n_q:].any() and not probs[b, :, :, n_k:].any()
        eye = torch.eye(n_k, dtype=q.dtype, device=device)[None, :, None, :].expand(1, n_k, 1, n_k)
        exact, plain = (
            ft.attention_reference(q_b, k_b, eye, scale, compute_dtype=d, **options[b])[0].transpose(1, 2)
            for d in (torch.float64, None)
        )
        assert_close_to_reference("probs", probs[b : b + 1, :, :n_q, :n_k].abs(), exact, plain)
        dropped = dict(options[b], dropout_p=p_drop, dropout_mask=kept[None])
        exact, plain = (
            ft.attention_reference(q_b, k_b, v_b, scale, compute_dtype=d, **dropped)[0] for d in (torch.float64, None)
        )
        assert_close_to_reference("out", out[None, rows_q], exact, plain)


@pytest.mark.parametrize("backend", NOT_INTERPRETED, ids=str, indirect=True)
def test_compiled_odd_head_dim_and_negative_scale(backend):
    """The padding and the scale's sign are traced by torch.compile(fullgraph=True) without a break."""
    torch._dynamo.reset()
    dtype = torch.float16 if backend.device == "cuda" else torch.float32  # CUDA fp32 would take the PyTorch path
    q, k, v = random_qkv(Shape(1, 20, 20, 2, 1, 5), dtype, backend.device)

    def step(q, k, v):
        return ft.flash_attn_func(q, k, v, softmax_scale=-0.5, causal=True, window_size=[7, 0]).square().sum()

    eager = torch.autograd.grad(step(q, k, v), (q, k, v))
    compiled = torch.compile(step, fullgraph=True, backend="inductor" if backend.device == "cuda" else "aot_eager")
    for a, b in zip(torch.autograd.grad(compiled(q, k, v), (q, k, v)), eager, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
