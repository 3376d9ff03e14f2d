"""Numerics of flash_attn_func against the fp64 reference, on every available target."""

import contextlib
from dataclasses import replace

import pytest
import torch

import flashtriton
from flashtriton import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, ops
from flashtriton.params import NO_BOUND, AttentionParams
from helpers import (
    FLOOR_ULPS,
    TARGETS,
    Seqlens,
    Shape,
    assert_close_to_reference,
    dtypes_for,
    max_error,
    packed_inputs,
    random_qkv,
    reference_outputs,
    target_params,
)

# Odd lengths on purpose: 1, 17, 113, 1000 never fill a tile; n_q > n_k under causal leaves rows
# with no visible key; heads != heads_k is GQA/MQA; head dims 40, 72, 96, 160 are padded in-kernel.
SHAPES = {
    "tiny": [
        Shape(1, 1, 1, 1, 1, 16),
        Shape(2, 17, 17, 2, 1, 40),
        Shape(1, 33, 50, 4, 2, 24),
        Shape(1, 50, 21, 2, 2, 16),
        Shape(1, 40, 40, 1, 1, 72),
        Shape(1, 20, 37, 2, 1, 256),  # the largest head dim
    ],
    "cpu": [
        Shape(1, 1, 1, 2, 2, 64),
        Shape(2, 17, 17, 4, 2, 40),
        Shape(1, 113, 113, 4, 1, 72),
        Shape(1, 300, 120, 2, 1, 64),
        Shape(1, 1000, 1000, 2, 2, 96),
        Shape(2, 257, 1000, 4, 2, 160),
    ],
    "gpu": [
        Shape(1, 1, 1, 2, 2, 64),
        Shape(2, 17, 113, 4, 1, 40),
        Shape(1, 113, 17, 4, 4, 72),
        Shape(2, 1000, 1000, 8, 2, 96),
        Shape(1, 1000, 1000, 4, 4, 128),
        Shape(1, 1500, 1500, 4, 2, 160),
        Shape(2, 777, 1300, 4, 2, 256),
        Shape(1, 4096, 4096, 8, 2, 64),
        Shape(1, 3000, 2000, 4, 4, 128),
        Shape(2, 1024, 1024, 8, 4, 128),  # whole 128-row tiles: the sm90 Gluon kernels
        Shape(1, 1280, 1280, 4, 2, 128),  # five 256-row forward tiles: a causal work unit of one tile
        Shape(1, 4096, 4096, 2, 1, 128),  # spans of 2048+ keys: the sm90 fused backward (atomic dQ)
        Shape(2, 2048, 2048, 4, 2, 64),  # batch rows on the fused backward and the D=64 staged O store
        Shape(2, 4096, 4096, 2, 1, 128),  # batch rows on the causal fused backward
        Shape(3, 384, 384, 4, 2, 128),  # causal spans of 256 keys or fewer: the sm90 forward's 64-key tiles
        Shape(2, 512, 512, 4, 1, 64),
        Shape(2, 320, 320, 4, 2, 64),  # causal: 64-row multiples, a 128-row tile whose second warpgroup has no rows
        Shape(1, 8192, 8192, 2, 1, 64),  # causal spans of 4096+: three consumer warpgroups, the last with no rows
        Shape(2, 1024, 1024, 4, 2, 256),  # the sm90 Gluon kernels at D=256 (the backward's warpgroups split D)
        Shape(2, 320, 320, 2, 1, 256),  # and its causal 64-key tiles, a tile whose second warpgroup has no rows
        Shape(3, 1024, 1024, 25, 5, 128),  # the persistent forward over two rounds of 132 SMs and part of a third
        Shape(5, 512, 512, 29, 29, 64),  # and with 64-key tiles (causal)
    ],
}


def _run(q, k, v, causal, dout, dlse, **kwargs):
    out, lse, probs = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, **kwargs)
    assert probs is None
    loss = (out * dout).sum() + (lse[torch.isfinite(lse)] * dlse[torch.isfinite(lse)]).sum()
    loss.backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backend,shape", target_params(SHAPES), indirect=["backend"])
def test_matches_reference(backend, shape, causal):
    """out, LSE and all three gradients (including the gradient through the returned LSE)."""
    for dtype in dtypes_for(backend):
        q, k, v = random_qkv(shape, dtype, backend.device)
        dout = torch.randn(q.shape, dtype=dtype, device=q.device)
        dlse = torch.randn(shape.batch, shape.heads, shape.n_q, device=q.device)
        ours = _run(q, k, v, causal, dout, dlse)
        exact = reference_outputs(q, k, v, dout, dlse, causal)
        plain = reference_outputs(q, k, v, dout, dlse, causal, compute_dtype=None)
        for name, a, e, p in zip(("out", "lse", "dq", "dk", "dv"), ours, exact, plain, strict=True):
            assert a.dtype == (torch.float32 if name == "lse" else dtype), name
            assert_close_to_reference(f"{name} ({dtype})", a, e, p)


# the portable kernel's odd shapes, and each sm90 Gluon forward (64-key causal tiles, D=256, three warpgroups)
INFERENCE_SHAPES = {
    "tiny": [Shape(2, 17, 17, 2, 1, 40), Shape(1, 33, 50, 4, 2, 24)],
    "cpu": [Shape(2, 300, 200, 4, 2, 72)],
    "gpu": [
        Shape(2, 17, 113, 4, 1, 40),
        Shape(2, 1024, 1024, 8, 4, 128),
        Shape(3, 384, 384, 4, 2, 128),
        Shape(2, 1024, 1024, 4, 2, 256),
        Shape(1, 8192, 8192, 2, 1, 64),
    ],
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backend,shape", target_params(INFERENCE_SHAPES), indirect=["backend"])
def test_inference_call_skips_lse_with_the_same_out(backend, shape, causal, monkeypatch):
    """A call that needs no gradient and no LSE gets none, the Triton kernels are launched without one (they skip
    writing it), and its out is bitwise that of a call that returns the LSE (whose numerics test_matches_reference
    checks)."""
    launched = []
    if backend.backend == "triton":
        from flashtriton import triton_backend

        monkeypatch.setattr(triton_backend, "_PLANS", {})  # the call records its launches, not a replay of others

        def spying(launch):
            def spy(q, k, v, out, lse, *rest):
                launched.append(lse)
                return launch(q, k, v, out, lse, *rest)

            return spy

        for name in ("_hopper_forward", "_portable_forward"):
            monkeypatch.setattr(triton_backend, name, spying(getattr(triton_backend, name)))
    q, k, v = random_qkv(shape, dtype=torch.bfloat16, device=backend.device, requires_grad=False)
    params = AttentionParams(shape.head_dim**-0.5, window_right=0 if causal else NO_BOUND, write_lse=False)
    out, lse = ops.attention(q, k, v, params)
    assert lse is None
    assert launched == ([None] if backend.backend == "triton" else [])
    full, _, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert torch.equal(out, full)
    assert torch.equal(flash_attn_func(q, k, v, causal=causal), full)


ONE_SHAPE = {
    "tiny": [Shape(2, 45, 30, 4, 2, 40)],
    "cpu": [Shape(2, 300, 200, 4, 2, 72)],
    "gpu": [Shape(2, 1000, 700, 8, 2, 72)],
}


@pytest.mark.parametrize("backend,shape", target_params(ONE_SHAPE), indirect=["backend"])
def test_rows_without_keys_are_zero_not_nan(backend, shape):
    """Causal with n_q > n_k: the first n_q - n_k queries see no key."""
    q, k, v = random_qkv(shape, torch.float16, backend.device)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    out.backward(torch.randn_like(out))
    empty = shape.n_q - shape.n_k
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    assert torch.isposinf(lse[:, :, :empty]).all()
    assert torch.isfinite(lse[:, :, empty:]).all()
    assert torch.equal(q.grad[:, :empty], torch.zeros_like(q.grad[:, :empty]))
    for x in (out, q.grad, k.grad, v.grad):
        assert not torch.isnan(x).any()
    assert q.grad[:, empty:].abs().amax() > 0


@pytest.mark.parametrize("backend,shape", target_params(ONE_SHAPE), indirect=["backend"])
def test_unused_lse_gradient_is_zero(backend, shape):
    """An eager call whose LSE gets no gradient runs the backward on shared zeros for dLSE (ops._shared_zeros): the
    gradients equal those of an explicit zero dLSE, and a call with a dLSE between two such calls leaves them be."""
    q, k, v = random_qkv(shape, torch.float16, backend.device)
    dout = torch.randn(q.shape, dtype=q.dtype, device=q.device)

    def grads(lse_weight):
        out, lse, _ = flash_attn_func(q, k, v, causal=True, deterministic=True, return_attn_probs=True)
        outputs, gradients = [out], [dout]
        if lse_weight is not None:
            outputs.append(lse[lse.isfinite()])
            gradients.append(torch.full_like(outputs[-1], lse_weight))
        return torch.autograd.grad(outputs, (q, k, v), gradients)

    unused = grads(None)
    for a, b in zip(unused, grads(0.0), strict=True):
        assert torch.equal(a, b)
    with_lse = grads(0.5)
    assert not torch.equal(with_lse[0], unused[0])
    for a, b in zip(unused, grads(None), strict=True):
        assert torch.equal(a, b)


# ONE_SHAPE's (in the interpreter with fewer heads: the test makes six calls), and causal spans of 2048 keys in whole
# tiles: the sm90 fused backward, which adds dQ up by TMA reductions (at D=256 with the warpgroups splitting D, its
# deterministic form the portable kernels)
REPEATED_SHAPES = {
    **ONE_SHAPE,
    "tiny": [Shape(2, 45, 30, 2, 1, 40)],
    "gpu": [*ONE_SHAPE["gpu"], Shape(1, 4096, 4096, 4, 2, 128), Shape(2, 1024, 1024, 4, 2, 256)],
}


def _repeat_backward(q, k, v, dout, deterministic, times=3):
    runs = []
    for _ in range(times):
        for x in (q, k, v):
            x.grad = None
        out = flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
        out.backward(dout)
        runs.append((out, q.grad, k.grad, v.grad))
    return runs


@pytest.mark.parametrize("backend,shape", target_params(REPEATED_SHAPES), indirect=["backend"])
def test_backward_is_bitwise_deterministic(backend, shape):
    q, k, v = random_qkv(shape, torch.float16, backend.device)
    dout = torch.randn(q.shape, dtype=q.dtype, device=q.device)
    runs = _repeat_backward(q, k, v, dout, deterministic=True)
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert torch.equal(a, b)
    # The default may add dQ's shares in any order (sm90: TMA reductions) and compute dS in another kernel
    # than the deterministic dQ does: dk and dv repeat bitwise, and all agree with the deterministic run to
    # within a few rounding steps of the largest value.
    fast = _repeat_backward(q, k, v, dout, deterministic=False)
    for out, dq, dk, dv in fast:
        assert torch.equal(out, runs[0][0])
        assert torch.equal(dk, fast[0][2]) and torch.equal(dv, fast[0][3])
        for a, b in zip((dq, dk, dv), runs[0][1:], strict=True):
            torch.testing.assert_close(a, b, atol=1e-2 * b.abs().amax().item(), rtol=0)


@pytest.mark.parametrize("backend,shape", target_params(ONE_SHAPE), indirect=["backend"])
def test_packed_and_strided_inputs_match_contiguous(backend, shape):
    """qkv-packed, kv-packed and transposed-storage inputs run without copies and agree."""
    q, k, v = random_qkv(shape, torch.float16, backend.device, requires_grad=False)
    expected = flash_attn_func(q, k, v, causal=True)
    kv = torch.stack([k, v], dim=2)
    torch.testing.assert_close(flash_attn_kvpacked_func(q, kv, causal=True), expected)
    # (batch, heads, seqlen, dim) storage viewed as (batch, seqlen, heads, dim)
    q_t, k_t, v_t = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert not q_t.is_contiguous()
    torch.testing.assert_close(flash_attn_func(q_t, k_t, v_t, causal=True), expected)
    if shape.n_q == shape.n_k and shape.heads == shape.heads_k:
        qkv = torch.stack([q, k, v], dim=2)
        torch.testing.assert_close(flash_attn_qkvpacked_func(qkv, causal=True), expected)


@pytest.mark.parametrize("backend,shape", target_params(ONE_SHAPE), indirect=["backend"])
def test_qkvpacked_gradient_reaches_packed_tensor(backend, shape):
    n = min(shape.n_q, shape.n_k)
    qkv = torch.randn(shape.batch, n, 3, shape.heads, shape.head_dim, device=backend.device, requires_grad=True)
    dout = torch.randn(shape.batch, n, shape.heads, shape.head_dim, device=backend.device)
    flash_attn_qkvpacked_func(qkv, causal=True).backward(dout)
    q, k, v = (x.detach().clone().requires_grad_() for x in qkv.detach().unbind(2))
    flash_attn_func(q, k, v, causal=True).backward(dout)
    torch.testing.assert_close(qkv.grad, torch.stack([q.grad, k.grad, v.grad], dim=2))


def _transposed_storage(x: torch.Tensor) -> torch.Tensor:
    """x's values in other storage: a (B, N, H, D) tensor as a view of (B, H, N, D), any other a fresh copy."""
    return x.transpose(1, 2).contiguous().transpose(1, 2) if x.dim() == 4 else x.clone()


# self-attention (packed qkv); on the GPU the sm90 kernels' fused backward and their dQ pass (D=64 and 128, causal)
HOOKED_SHAPES = {
    "tiny": [Shape(1, 33, 33, 2, 2, 24)],
    "cpu": [Shape(2, 300, 300, 4, 4, 72)],
    "gpu": [Shape(2, 1000, 1000, 4, 4, 72), Shape(2, 2048, 2048, 4, 4, 64), Shape(2, 512, 512, 4, 4, 128)],
}


@pytest.mark.parametrize("backend,shape", target_params(HOOKED_SHAPES), indirect=["backend"])
def test_saved_tensor_hooks_that_move_the_saved_tensors(backend, shape):
    """Saved-tensor hooks hand the backward q, k, v, out and LSE in other storage and strides than the forward
    saw (on the GPU save_on_cpu copies packed qkv's views back contiguous): gradients as exact as without hooks,
    after a call of the same layout without them (whose launches a later call may replay)."""
    qkv = torch.randn(shape.batch, shape.n_q, 3, shape.heads, shape.head_dim, dtype=torch.float16,
                      device=backend.device, requires_grad=True)  # fmt: skip
    dout = torch.randn(shape.batch, shape.n_q, shape.heads, shape.head_dim, dtype=qkv.dtype, device=qkv.device)
    q, k, v = qkv.detach().unbind(2)
    dlse = torch.zeros(shape.batch, shape.heads, shape.n_q, device=qkv.device)
    exact = reference_outputs(q, k, v, dout, dlse, causal=True)[2:]
    plain = reference_outputs(q, k, v, dout, dlse, causal=True, compute_dtype=None)[2:]
    hooks = {
        "no hooks": contextlib.nullcontext(),
        "transposed storage": torch.autograd.graph.saved_tensors_hooks(lambda x: x, _transposed_storage),
        "save_on_cpu": torch.autograd.graph.save_on_cpu(),
        "no hooks again": contextlib.nullcontext(),
    }
    for label, hook in hooks.items():
        qkv.grad = None
        with hook:
            out = flash_attn_qkvpacked_func(qkv, causal=True)
        out.backward(dout)
        for name, a, e, p in zip(("dq", "dk", "dv"), qkv.grad.unbind(2), exact, plain, strict=True):
            assert_close_to_reference(f"{name} ({label})", a, e, p)


@pytest.mark.parametrize("backend,shape", target_params(ONE_SHAPE), indirect=["backend"])
def test_softmax_scale(backend, shape):
    q, k, v = random_qkv(shape, torch.float32, backend.device, requires_grad=False)
    out = flash_attn_func(q, k, v, softmax_scale=0.37, causal=False)
    ref, _ = flashtriton.attention_reference(q, k, v, softmax_scale=0.37, compute_dtype=torch.float64)
    plain, _ = flashtriton.attention_reference(q, k, v, softmax_scale=0.37, compute_dtype=None)
    assert_close_to_reference("out", out, ref, plain)


@pytest.mark.parametrize("backend", TARGETS, ids=str, indirect=True)
@pytest.mark.parametrize("n_q,n_k,batch", [(0, 5, 1), (5, 0, 1), (5, 5, 0)], ids=["no-queries", "no-keys", "no-batch"])
def test_empty_inputs(backend, n_q, n_k, batch):
    q = torch.randn(batch, n_q, 2, 16, device=backend.device, requires_grad=True)
    k = torch.randn(batch, n_k, 2, 16, device=backend.device, requires_grad=True)
    v = torch.randn(batch, n_k, 2, 16, device=backend.device, requires_grad=True)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (batch, 2, n_q)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all()
    out.sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k)) and torch.equal(q.grad, torch.zeros_like(q))


@pytest.mark.parametrize("backend", TARGETS, ids=str, indirect=True)
def test_autocast_runs_in_autocast_dtype(backend):
    dtype = torch.float16 if backend.device == "cuda" else torch.bfloat16
    q, k, v = (torch.randn(1, 20, 2, 16, device=backend.device) for _ in range(3))
    with torch.autocast(backend.device, dtype=dtype):
        out = flash_attn_func(q, k, v)
    assert out.dtype == dtype
    ref, _ = flashtriton.attention_reference(q, k, v)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)
    # as a model hands them over under autocast: q and k out of an fp32 rotary, v in the autocast dtype
    with torch.autocast(backend.device, dtype=dtype):
        mixed = flash_attn_func(q, k, v.to(dtype))
    torch.testing.assert_close(mixed, out, atol=0, rtol=0)


# fp32 results (AttentionParams.fp32_results): each sm90 Gluon path on the GPU (forward; fused dK/dV at D=64, 128,
# 256; the dQ kernel, deterministic or at D=128 causal; a ragged last tile; D=80 in 128-wide tiles), dense and
# varlen, GQA
FP32_RESULTS_SHAPES = {
    "tiny": [Seqlens((17,), (17,), 2, 1, 16), Seqlens((5, 12), (5, 12), 2, 1, 16)],
    "cpu": [Seqlens((65, 65), (65, 65), 4, 2, 32), Seqlens((30, 70), (30, 70), 4, 2, 32)],
    "gpu": [
        Seqlens((1024, 1024), (1024, 1024), 8, 2, 128),
        Seqlens((2048,), (2048,), 4, 2, 64),
        Seqlens((1024, 1024), (1024, 1024), 4, 2, 256),
        Seqlens((1000,), (1000,), 4, 4, 128),
        Seqlens((512, 1536), (512, 1536), 8, 2, 128),
        Seqlens((300, 1000, 700), (300, 1000, 700), 4, 2, 64),
        Seqlens((300, 1000, 700), (300, 1000, 700), 4, 2, 80),  # register stores of a tile wider than D
        Seqlens((2048,), (2048,), 4, 2, 80),  # and the fused backward's
        Seqlens((1024, 1024), (1024, 1024), 4, 2, 192),  # split D: each warpgroup's half of a 256-wide tile
    ],
}


def _dense_or_packed(lens: Seqlens, dtype, device):
    """Equal lengths: a dense (batch, n, heads, dim) batch; else a packed one. (q, k, v, dout, dlse, cu_seqlens or
    None)."""
    q, k, v, cu_q, _ = packed_inputs(lens, dtype, device)
    if len(set(lens.q)) == 1:
        q, k, v = (x.view(lens.batch, lens.q[0], *x.shape[1:]) for x in (q, k, v))
        cu_q = None
    dout = torch.randn_like(q)
    lse_shape = (q.shape[1], q.shape[0]) if cu_q is not None else (q.shape[0], q.shape[2], q.shape[1])
    return q, k, v, dout, torch.randn(lse_shape, device=device), cu_q


@pytest.mark.parametrize("deterministic", [False, True], ids=["any-order", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backend,lens", target_params(FP32_RESULTS_SHAPES), indirect=["backend"])
def test_fp32_results_are_fp32_and_no_less_accurate(backend, lens, causal, deterministic):
    """out and dq, dk, dv asked for in fp32 come out fp32, at least as close to the fp64 reference as the same call's
    results in the inputs' dtype (the backwards given the same out, in the inputs' dtype as autograd's is), and within
    the one tolerance rule."""
    dtype = torch.bfloat16
    q, k, v, dout, dlse, cu = _dense_or_packed(lens, dtype, backend.device)
    varlen = {}
    if cu is not None:
        varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens.q), max_seqlen_k=max(lens.k))
    rounded = AttentionParams(
        lens.head_dim**-0.5, window_right=0 if causal else NO_BOUND, deterministic=deterministic, **varlen
    )
    wide = replace(rounded, fp32_results=True)
    out, lse = ops.forward(q, k, v, rounded)
    out_wide = ops.forward(q, k, v, wide)[0]
    grads = ops.backward(dout, dlse, q, k, v, out, lse, rounded)[:3]
    grads_wide = ops.backward(dout, dlse, q, k, v, out, lse, wide)[:3]
    cu_seqlens = None if cu is None else (cu, cu)
    exact = reference_outputs(*(x.double() for x in (q, k, v, dout, dlse)), causal, cu_seqlens=cu_seqlens)
    plain = reference_outputs(q, k, v, dout, dlse, causal, compute_dtype=None, cu_seqlens=cu_seqlens)
    exact, plain = [exact[0], *exact[2:5]], [plain[0], *plain[2:5]]
    for name, r, w, e, p in zip(("out", "dq", "dk", "dv"), (out, *grads), (out_wide, *grads_wide), exact, plain,
                                strict=True):  # fmt: skip
        assert w.dtype == torch.float32 and r.dtype == dtype, name
        floor = FLOOR_ULPS * torch.finfo(torch.float32).eps * max(1.0, e.abs().max().item())
        assert max_error(w, e) <= max_error(r, e) + floor, f"{name}: fp32 {max_error(w, e):.3e} > {max_error(r, e):.3e}"
        assert_close_to_reference(name, w, e, p)
