"""CUDA graphs: a forward+backward captured after a warm-up call (README: call each shape once before capturing)
replays with new values copied into its static inputs, and gives what an eager call on those values gives."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from itertools import accumulate

import pytest
import torch

from flashtriton import flash_attn_func, flash_attn_varlen_func

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

NAMES = ("out", "dq", "dk", "dv")


def _dense(dtype, batch, n_q, n_k, heads, heads_k, head_dim, **options):
    """(dtype, the shapes of q, k, v, the call) of a dense case."""
    shapes = [(batch, n_q, heads, head_dim), *[(batch, n_k, heads_k, head_dim)] * 2]
    return dtype, shapes, partial(flash_attn_func, **options)


def _varlen(dtype, lengths, heads, heads_k, head_dim, **options):
    """(dtype, the shapes of q, k, v, the call) of a packed self-attention batch."""
    cu = torch.tensor([0, *accumulate(lengths)], dtype=torch.int32, device="cuda")
    total, longest = sum(lengths), max(lengths)
    shapes = [(total, heads, head_dim), *[(total, heads_k, head_dim)] * 2]
    return dtype, shapes, partial(flash_attn_varlen_func, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                  max_seqlen_k=longest, **options)  # fmt: skip


def _features():
    slopes = torch.rand(2, 8, device="cuda")  # ALiBi slopes: a static tensor argument of the graph
    return _dense(torch.float16, 2, 1000, 700, 8, 2, 96, window_size=(300, 50), softcap=3.0, alibi_slopes=slopes)


CASES: dict[str, Callable] = {
    # whole 128-row tiles, causal: on Hopper the Gluon kernels, the forward with the tile schedule the warm-up made
    "causal-tiles": lambda: _dense(torch.bfloat16, 2, 1024, 1024, 8, 2, 128, causal=True),
    # a span of 2048+ keys: on Hopper the fused backward, whose dQ shares are added up in no fixed order
    "long-span": lambda: _dense(torch.bfloat16, 1, 4096, 4096, 4, 2, 128, causal=True),
    # odd lengths and features: the portable kernels
    "features": _features,
    # cu_seqlens read on the host by the warm-up, not during the capture (the same tensors, unmodified)
    "varlen": lambda: _varlen(torch.bfloat16, (256, 0, 1024, 128), 8, 4, 128, causal=True),
}


def _fwd_bwd(call, q, k, v, dout) -> torch.Tensor:
    out = call(q, k, v)
    out.backward(dout)
    return out


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("name", list(CASES))
def test_captured_forward_backward_replays_like_eager(name, deterministic):
    dtype, shapes, call = CASES[name]()
    call = partial(call, deterministic=deterministic)
    q, k, v = (torch.randn(s, device="cuda", dtype=dtype, requires_grad=True) for s in shapes)
    dout = torch.randn(shapes[0], device="cuda", dtype=dtype)

    # warm-up on a side stream, as torch.cuda.graph asks: compiles the kernels, makes the schedule and host reads
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for x in (q, k, v):
                x.grad = None
            _fwd_bwd(call, q, k, v, dout)
    torch.cuda.current_stream().wait_stream(side)

    for x in (q, k, v):
        x.grad = None  # the captured backward allocates the gradients in the graph's pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _fwd_bwd(call, q, k, v, dout)
    static = (out, q.grad, k.grad, v.grad)

    previous = None
    for _ in range(2):
        values = [torch.randn_like(x) for x in (q, k, v, dout)]
        with torch.no_grad():
            for x, value in zip((q, k, v, dout), values, strict=True):
                x.copy_(value)
        graph.replay()
        leaves = [x.clone().requires_grad_() for x in values[:3]]
        eager_out = _fwd_bwd(call, *leaves, values[3])
        eager = (eager_out, *(x.grad for x in leaves))
        torch.cuda.synchronize()
        for label, replayed, expected in zip(NAMES, static, eager, strict=True):
            assert not replayed.isnan().any(), f"{label}: NaN after replay"
            if label == "dq" and not deterministic:  # added up in no fixed order on the fused path
                atol = 1e-2 * expected.abs().amax().item()
                torch.testing.assert_close(replayed, expected, atol=atol, rtol=0, msg=f"{label} after replay")
            else:
                assert torch.equal(replayed, expected), f"{label}: replay differs from eager"
        if previous is not None:  # the replay read the new values, not the captured ones
            assert not torch.equal(out, previous)
        previous = out.clone()
