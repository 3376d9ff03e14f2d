"""The kernels' two load paths (TMA descriptors and pointer loads) and the two dispatch paths (eager
autograd.Function and the torch.library ops) give the same answers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.autograd import forward_ad

from flashtriton import (
    create_block_mask,
    flash_attn_func,
    flash_attn_varlen_func,
    ops,
    route,
    torch_backend,
    triton_backend,
)
from flashtriton.kernels import config
from flashtriton.mods import causal_mask
from flashtriton.params import AttentionParams
from helpers import TARGETS

INTERPRETER = any(t.name == "cpu-interp" for t in TARGETS)


def _run(q, k, v, p):
    out, lse = triton_backend.forward(q, k, v, p, route.forward(q, k, v, p, gpu="interpreter"))
    dout = torch.randn_like(out)
    *grads, _ = triton_backend.backward(  # the sinks' gradient: None (no sinks)
        dout,
        torch.zeros_like(lse),
        q,
        k,
        v,
        out,
        lse,
        p,
        route.backward(dout, lse, q, k, v, out, lse, p, gpu="interpreter"),
    )
    return (out, lse, *grads)


def _cases():
    torch.manual_seed(0)
    q = torch.randn(2, 40, 2, 16)
    k, v = torch.randn(2, 40, 1, 16), torch.randn(2, 40, 1, 16)
    cu = torch.tensor([0, 23, 80], dtype=torch.int32)
    mask = create_block_mask(causal_mask(), None, None, 40, 40, block_size=16)
    return {
        "window-gqa": ((q, k, v), AttentionParams(0.25, window_left=9, window_right=3)),
        "causal": ((q, k, v), AttentionParams(0.25, window_right=0)),
        "dense": ((q, k, v), AttentionParams(0.25)),  # the backward folds the ragged tile
        "varlen": (
            (q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)),
            AttentionParams(0.25, window_right=0, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=57, max_seqlen_k=57),
        ),
        "block-mask": ((q, k, v), AttentionParams(0.25, block_mask=mask)),
    }


@pytest.mark.skipif(not INTERPRETER, reason="runs the kernels in Triton's interpreter")
@pytest.mark.parametrize("case", list(_cases()))
def test_tma_and_pointer_loads_agree_bitwise(case, monkeypatch):
    (q, k, v), p = _cases()[case]
    results = []
    for tma in (True, False):
        fwd = dataclasses.replace(config._INTERPRETER_FORWARD, tma=tma)
        bwd = dataclasses.replace(config._INTERPRETER_BACKWARD, tma=tma)
        monkeypatch.setattr(config, "_INTERPRETER_FORWARD", fwd)
        monkeypatch.setattr(config, "_INTERPRETER_BACKWARD", bwd)
        torch.manual_seed(1)
        results.append(_run(q, k, v, p))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("softcap", [0.0, 5.0], ids=["aten-op", "function"])
def test_eager_paths_refuse_double_backward(softcap):
    """Both eager CPU paths: ATen's fused op under torch's autograd (a plain call, torch_backend.aten_serves) and the
    autograd.Function (softcap)."""
    q, k, v = (torch.randn(1, 9, 2, 16, requires_grad=True) for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True, softcap=softcap)
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match=r"once_differentiable|differentiate|derivative for .* is not implemented"):
        dq.sum().backward()


def test_eager_and_op_paths_agree(monkeypatch):
    q, k, v = (torch.randn(1, 9, 2, 16, requires_grad=True) for _ in range(3))
    sinks = torch.randn(2, requires_grad=True)
    grads = []
    for traced in (False, True):
        monkeypatch.setattr(torch.jit, "is_tracing", lambda traced=traced: traced)  # routes through the ops
        out, lse, _ = flash_attn_func(q, k, v, window_size=(3, 1), return_attn_probs=True, sinks=sinks)
        grads.append((out, lse, *torch.autograd.grad((out.sum() + lse.sum()), (q, k, v, sinks))))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_inference_mode_masks_and_cu_seqlens():
    with torch.inference_mode():
        q, k, v = (torch.randn(11, 2, 16) for _ in range(3))
        cu = torch.tensor([0, 4, 11], dtype=torch.int32)
        out = flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True)
        mask = create_block_mask(causal_mask(), None, None, 11, 11, block_size=16)
        assert mask.mean_span() == 11
        assert torch.isfinite(out).all()


def test_ops_module_routes_plain_tensors_past_the_custom_ops(monkeypatch):
    """Plain eager tensors never reach the torch.library ops: with a gradient to take they go through the
    autograd.Function, without one straight to the computation (no autograd node); a CPU call that ATen's fused
    kernel answers whole, and whose LSE is discarded, through ATen's op (torch_backend.aten_serves)."""
    seen = []
    function, aten = ops._EagerAttention.apply, torch_backend.aten_whole
    monkeypatch.setattr(ops._EagerAttention, "apply", lambda *a: seen.append("function") or function(*a))
    monkeypatch.setattr(torch_backend, "aten_whole", lambda *a: seen.append("aten") or aten(*a))
    monkeypatch.setattr(ops, "attention_forward", lambda *a: seen.append("op"))
    for requires_grad in (True, False):
        q, k, v = (torch.randn(1, 5, 1, 16, requires_grad=requires_grad) for _ in range(3))
        for options in ({}, {"return_attn_probs": True}, {"softcap": 2.0}):
            seen.clear()
            out = flash_attn_func(q, k, v, **options)
            out = out[0] if isinstance(out, tuple) else out
            assert seen == (["aten"] if not options else ["function"] if requires_grad else [])
            assert out.requires_grad == requires_grad and torch.isfinite(out).all()
    with torch.no_grad():
        seen.clear()
        assert not flash_attn_func(q.requires_grad_(), k, v, softcap=2.0).requires_grad
        assert seen == []


def test_calls_that_need_no_gradient_keep_autograds_rules():
    q, k, v = (torch.randn(1, 7, 2, 16) for _ in range(3))
    # no gradient reaches ALiBi slopes, whether or not q, k, v take one
    slopes = torch.rand(2, requires_grad=True)
    assert not flash_attn_func(q, k, v, alibi_slopes=slopes).requires_grad
    # forward-mode AD is refused, not answered with a zero tangent
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(q, torch.randn_like(q))
        with pytest.raises(RuntimeError, match="jvp"):
            flash_attn_func(dual, k, v)
