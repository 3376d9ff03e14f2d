"""The PyTorch path's fused calls: which calls ATen's CPU flash-attention kernel serves (torch_backend.fused_serves),
how each is cut into the kernel's calls (torch_backend._pieces), their values and gradients against the fp64
reference, rows that see no key, and bitwise repetition."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from flashtriton import flash_attn_func, flash_attn_varlen_func, ops, torch_backend
from flashtriton.kernels.config import TORCH_BLOCK_M
from flashtriton.mods import causal_mask
from flashtriton.params import AttentionParams
from flashtriton.route import TORCH, Route
from helpers import Shape, assert_close_to_reference, dtype_name, random_qkv, reference_outputs

NAMES = ("out", "lse", "dq", "dk", "dv")
M = TORCH_BLOCK_M  # query rows of a sliding window's piece


@pytest.fixture(autouse=True)
def _torch_path(monkeypatch):
    monkeypatch.setenv("FLASHTRITON_BACKEND", "torch")


@pytest.fixture
def calls(monkeypatch) -> list[tuple]:
    """What the PyTorch path runs, in order: (kind, query rows, keys, K heads, causal, masked, dtype) per call of
    ATen's kernel, kind "fused" in the forward and "fused grad" in the backward; ("tiled",) and ("tiled grad",) per
    dense call of the tiled path."""
    log = []

    def spy(name: str, describe) -> None:
        real = getattr(torch_backend, name)

        def spying(*args, **kwargs):
            log.append(describe(*args, **kwargs))
            return real(*args, **kwargs)

        monkeypatch.setattr(torch_backend, name, spying)

    def kernel_call(kind, q, k, causal, mask):  # q, k: the kernel's (B, H, n, D) views
        return kind, q.shape[2], k.shape[2], k.shape[1], causal, mask is not None, q.dtype

    spy(
        "ATEN_FORWARD", lambda q, k, v, *, is_causal, attn_mask, scale: kernel_call("fused", q, k, is_causal, attn_mask)
    )
    spy(
        "ATEN_BACKWARD",
        lambda dout, q, k, v, out, lse, dropout_p, causal, *, attn_mask, scale: kernel_call(
            "fused grad", q, k, causal, attn_mask
        ),
    )
    spy("_tiled_forward", lambda *args: ("tiled",))
    spy("_tiled_backward", lambda *args: ("tiled grad",))
    return log


@dataclass(frozen=True)
class PathCase:
    name: str
    n_q: int
    n_k: int
    options: dict = field(default_factory=dict)  # flash_attn_func's
    pieces: tuple[tuple[int, int, bool, bool], ...] = ()  # (query rows, keys, causal, masked) per kernel call

    def __str__(self) -> str:
        return self.name


HEADS, HEADS_K = 4, 2  # every case is GQA: the kernel must see K/V with the query heads

PATHS = [
    PathCase("full", 40, 40, {}, ((40, 40, False, False),)),
    PathCase("full-q30-k50", 30, 50, {}, ((30, 50, False, False),)),
    # n_q == n_k: the kernel's top-left causal mask is flash_attn's bottom-right one
    PathCase("causal", 40, 40, {"causal": True}, ((40, 40, True, False),)),
    # the first 20 queries see no key; the other 30 against the 30 keys are top-left causal
    PathCase("causal-q50-k30", 50, 30, {"causal": True}, ((30, 30, True, False),)),
    # every query sees the first 20 keys; the last 30 keys are top-left causal
    PathCase("causal-q30-k50", 30, 50, {"causal": True}, ((30, 20, False, False), (30, 30, True, False))),
    PathCase("right-bound-q40-k60", 40, 60, {"window_size": (-1, 5)}, ((40, 25, False, False), (40, 35, True, False))),
    PathCase("right-bound-q60-k40", 60, 40, {"window_size": (-1, 3)}, ((43, 40, True, False),)),
    PathCase("window-hiding-nothing", 40, 40, {"window_size": (100, 100)}, ((40, 40, False, False),)),
    PathCase("left-bound-q40-k60", 40, 60, {"window_size": (8, -1)}, ((40, 48, False, True),)),
    # a query tile's piece against its band of keys, under the band's mask
    PathCase("sliding-window", M + 44, M + 44, {"window_size": (8, 0)}, ((M, M, False, True), (44, 52, False, True))),
    PathCase("softcap", 40, 40, {"softcap": 5.0}),
    PathCase("alibi", 40, 40, {"alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])}),
    PathCase("dropout", 40, 40, {"dropout_p": 0.1}),
    PathCase("block-mask", 40, 40, {"mask_mod": causal_mask()}),
]


def _loss(out, lse, dout, dlse) -> torch.Tensor:
    finite = torch.isfinite(lse)
    return (out * dout).sum() + (lse[finite] * dlse[finite]).sum()


@pytest.mark.parametrize("case", PATHS, ids=str)
def test_which_calls_take_the_fused_path_and_its_pieces(case, calls):
    """The forward and the backward make the kernel calls the table names (none: the tiled path), and the fused ones
    match the fp64 reference."""
    shape = Shape(2, case.n_q, case.n_k, HEADS, HEADS_K, 32)
    q, k, v = random_qkv(shape, torch.float32, "cpu")
    dout, dlse = torch.randn(q.shape), torch.randn(shape.batch, HEADS, shape.n_q)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **case.options)
    _loss(out, lse, dout, dlse).backward()
    if not case.pieces:
        assert calls == [("tiled",), ("tiled grad",)]
        return
    expected = [
        (kind, *piece[:2], HEADS, *piece[2:], torch.float32)
        for kind in ("fused", "fused grad")
        for piece in case.pieces
    ]
    assert calls == expected
    reference = dict(causal=case.options.get("causal", False), window_size=case.options.get("window_size", (-1, -1)))
    exact = reference_outputs(q, k, v, dout, dlse, **reference)
    plain = reference_outputs(q, k, v, dout, dlse, compute_dtype=None, **reference)
    for name, a, e, p in zip(NAMES, (out.detach(), lse.detach(), q.grad, k.grad, v.grad), exact, plain, strict=True):
        assert_close_to_reference(name, a, e, p)


def test_varlen_runs_the_kernel_per_sequence(calls):
    """Each sequence of a varlen batch is a dense call of its own; an empty one makes none."""
    lens_q, lens_k = (20, 0, 30), (25, 10, 30)
    q = torch.randn(sum(lens_q), HEADS, 32, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), HEADS_K, 32, requires_grad=True) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (lens_q, lens_k))
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True).sum().backward()
    pieces = [(20, 5, False, False), (20, 20, True, False), (30, 30, True, False)]
    assert calls == [(kind, *p[:2], HEADS, *p[2:], torch.float32) for kind in ("fused", "fused grad") for p in pieces]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=dtype_name)
def test_the_kernel_computes_fp16_in_fp32(dtype, calls):
    """fp16 runs the kernel in fp32 (ATen's fp16 kernel is several times slower on CPUs without fp16 matrix units);
    fp32 and bf16 run as they come. With the LSE returned, the backward is our kernel call; without it, fp32 and
    bf16 run ATen's op under torch's autograd, whose backward torch calls (fp16 keeps our Function: its fp32 copies
    are not kept for the backward)."""
    q, k, v = random_qkv(Shape(1, 20, 20, 2, 2, 32), dtype, "cpu")
    flash_attn_func(q, k, v, return_attn_probs=True)[0].sum().backward()
    flash_attn_func(q, k, v).sum().backward()
    expected = torch.float32 if dtype == torch.float16 else dtype
    kinds = ["fused", "fused grad"] * 2 if dtype == torch.float16 else ["fused", "fused grad", "fused"]
    assert [c[0] for c in calls] == kinds
    assert [c[-1] for c in calls] == [expected] * len(kinds)


# (shape, options, ATen's op under torch's autograd): where one kernel call answers a call whole on q, k, v as they
# are: without a window, or with a causal mask that is the kernel's own top-left one (n_q == n_k, or window_right =
# n_q - n_k); not with GQA, fp16 or a strided head dim, whose copies its autograd would keep (see
# test_whole_calls_keep_no_copies)
WHOLE_CASES = [
    pytest.param(Shape(2, 37, 37, 3, 3, 40), {}, True, id="full"),
    pytest.param(Shape(1, 30, 50, 2, 2, 64), {}, True, id="full-q30-k50"),
    pytest.param(Shape(2, 37, 37, 2, 2, 24), dict(causal=True), True, id="causal"),
    pytest.param(Shape(1, 40, 30, 2, 2, 32), dict(window_size=(-1, 10)), True, id="right-bound-top-left"),
    pytest.param(Shape(1, 40, 40, 2, 2, 32), dict(softmax_scale=-0.3), True, id="negative-scale"),
    pytest.param(Shape(1, 30, 50, 2, 2, 32), dict(causal=True), False, id="causal-q30-k50"),
    pytest.param(Shape(1, 40, 40, 2, 2, 32), dict(window_size=(8, 0)), False, id="sliding-window"),
    pytest.param(Shape(2, 37, 37, 4, 1, 24), dict(causal=True), False, id="causal-mqa"),
]


def _graph_nodes(node, depth: int = 4) -> list[str]:
    """The names of the autograd nodes within ``depth`` steps of ``node``."""
    if node is None or depth == 0:
        return []
    return [type(node).__name__, *(name for n, _ in node.next_functions for name in _graph_nodes(n, depth - 1))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=dtype_name)
@pytest.mark.parametrize("shape,options,whole", WHOLE_CASES)
def test_whole_calls_take_atens_op_and_its_autograd(shape, options, whole, dtype):
    """A call that one kernel call answers, its LSE not returned, is ATen's op under torch's own autograd (no Python
    in its backward); others keep the autograd.Function. out and gradients match the fp64 reference either way, in
    the inputs' dtype."""
    q, k, v = random_qkv(shape, dtype, "cpu")
    out = flash_attn_func(q, k, v, **options)
    whole = whole and dtype != torch.float16
    nodes = _graph_nodes(out.grad_fn)
    assert ("ScaledDotProductFlashAttentionForCpuBackward0" in nodes) == whole, nodes
    assert isinstance(out.grad_fn, ops._EagerAttention._backward_cls) != whole, nodes
    dout = torch.randn(q.shape, dtype=dtype)
    (out * dout).sum().backward()
    causal, scale = options.get("causal", False), options.get("softmax_scale")
    window = options.get("window_size", (-1, -1))
    dlse = torch.zeros(shape.batch, shape.heads, shape.n_q)
    exact, plain = (
        reference_outputs(q, k, v, dout, dlse, causal, scale, compute, window_size=window)
        for compute in (torch.float64, None)
    )
    ours = (out.detach(), None, q.grad, k.grad, v.grad)
    for name, a, e, p in zip(NAMES, ours, exact, plain, strict=True):
        if a is not None:
            assert a.dtype == dtype and a.shape == e.shape, name
            assert_close_to_reference(f"{name} ({dtype})", a, e, p)


def test_the_fused_path_is_for_cpu_tensors_only():
    params = AttentionParams(softmax_scale=0.125)
    assert torch_backend.fused_serves(torch.empty(1, 4, 2, 64), params)
    assert not torch_backend.fused_serves(torch.empty(1, 4, 2, 64, device="meta"), params)


# Each piece structure at sizes of several of the kernel's own query blocks: one causal piece under rows that see no
# key, two merged pieces, and a sliding window's masked pieces.
VALUE_CASES = [
    pytest.param(Shape(1, 300, 200, 4, 2, 64), dict(causal=True), id="causal-q300-k200"),
    pytest.param(Shape(2, 200, 300, 2, 1, 40), dict(causal=True), id="causal-q200-k300"),
    pytest.param(Shape(1, M + 100, M + 100, 4, 1, 64), dict(causal=False, window_size=(40, 10)), id="window40,10"),
]
LOSSES = {"out-and-lse": (1, 1), "out": (1, 0), "lse": (0, 1)}  # which of out, lse the loss reads


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=dtype_name)
@pytest.mark.parametrize("shape,options", VALUE_CASES)
def test_fused_path_matches_reference(shape, options, dtype, loss):
    """out, lse and the gradients in each dtype, for a loss on out, on the LSE (the backward then carries dLSE in
    an extra head-dim column) or on both."""
    q, k, v = random_qkv(shape, dtype, "cpu")
    use_out, use_lse = LOSSES[loss]
    dout = torch.randn(q.shape, dtype=dtype) * use_out
    dlse = torch.randn(shape.batch, shape.heads, shape.n_q) * use_lse
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **options)
    _loss(out, lse, dout, dlse).backward()
    exact = reference_outputs(q, k, v, dout, dlse, **options)
    plain = reference_outputs(q, k, v, dout, dlse, compute_dtype=None, **options)
    ours = (out.detach(), lse.detach(), q.grad, k.grad, v.grad)
    for name, a, e, p in zip(NAMES, ours, exact, plain, strict=True):
        assert a.dtype == (torch.float32 if name == "lse" else dtype), name
        assert_close_to_reference(f"{name} ({dtype})", a, e, p)


EMPTY_ROWS = [
    pytest.param(dict(causal=True), 20, id="causal"),  # queries i < n_q - n_k
    pytest.param(dict(window_size=(5, 2)), 18, id="window5,2"),  # queries i < n_q - n_k - 2, in masked pieces
]


@pytest.mark.parametrize("options,empty", EMPTY_ROWS)
def test_rows_that_see_no_key(options, empty):
    """out 0, lse +inf, gradients 0, no NaN; the rows after them see keys."""
    q, k, v = random_qkv(Shape(2, 50, 30, 4, 2, 32), torch.float32, "cpu")
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **options)
    _loss(out, lse, torch.randn_like(out), torch.randn_like(lse)).backward()
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    assert torch.isposinf(lse[:, :, :empty]).all() and torch.isfinite(lse[:, :, empty:]).all()
    assert torch.equal(q.grad[:, :empty], torch.zeros_like(q.grad[:, :empty]))
    assert not any(torch.isnan(x).any() for x in (out, q.grad, k.grad, v.grad))
    assert q.grad[:, empty:].abs().amax() > 0


@pytest.mark.parametrize("options,empty", EMPTY_ROWS)
def test_partial_results_give_empty_rows_minus_inf(options, empty):
    """A partial result (empty_lse = -inf, for a log-sum-exp merge) marks the same rows -inf instead."""
    q, k, v = random_qkv(Shape(1, 50, 30, 2, 2, 32), torch.float32, "cpu", requires_grad=False)
    left, right = options.get("window_size", (-1, 0))
    params = AttentionParams(softmax_scale=32**-0.5, window_left=left, window_right=right, empty_lse=-math.inf)
    assert torch_backend.fused_serves(q, params)
    out, lse = torch_backend.forward(q, k, v, params, Route(TORCH))
    assert torch.isneginf(lse[:, :, :empty]).all() and torch.isfinite(lse[:, :, empty:]).all()
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))


@pytest.mark.parametrize(
    "options", [{}, dict(causal=True), dict(window_size=(40, 10))], ids=["full", "causal", "window40,10"]
)
def test_fused_path_repeats_bitwise(options):
    """deterministic=True: three calls, on two threads, give the same out, lse and gradients bit for bit (through
    the LSE too: the widened backward)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q, k, v = random_qkv(Shape(2, 150, 200, 4, 2, 32), torch.float32, "cpu")
        dout, dlse = torch.randn(q.shape), torch.randn(2, 4, 150)
        runs = []
        for _ in range(3):
            for x in (q, k, v):
                x.grad = None
            out, lse, _ = flash_attn_func(q, k, v, deterministic=True, return_attn_probs=True, **options)
            _loss(out, lse, dout, dlse).backward()
            runs.append((out, lse, q.grad, k.grad, v.grad))
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        for name, a, b in zip(NAMES, runs[0], other, strict=True):
            assert torch.equal(a, b), f"{name} differs between two calls"


@pytest.mark.parametrize("layout", ["contiguous", "heads-first", "fp16", "gqa", "strided-head-dim"], ids=str)
def test_whole_calls_keep_no_copies(layout):
    """What autograd keeps for the backward of a plain call is q, k, v's own storage and the output's, whichever
    eager path takes it: ATen's op on views of the inputs, or the autograd.Function for inputs it would copy."""
    heads_k = 1 if layout == "gqa" else 4
    dtype = torch.float16 if layout == "fp16" else torch.float32
    shapes = [(1, 64, 4, 32), (1, 64, heads_k, 32), (1, 64, heads_k, 32)]
    if layout == "heads-first":
        q, k, v = (torch.randn(s[0], s[2], s[1], s[3]).transpose(1, 2).requires_grad_() for s in shapes)
    elif layout == "strided-head-dim":
        q, k, v = (torch.randn(*s[:3], 2 * s[3])[..., ::2].requires_grad_() for s in shapes)
    else:
        q, k, v = (torch.randn(s, dtype=dtype, requires_grad=True) for s in shapes)
    kept = {}

    def pack(x):
        kept[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = flash_attn_func(q, k, v, causal=True)
    inputs = {x.untyped_storage().data_ptr() for x in (q, k, v)}
    others = [n for ptr, n in kept.items() if ptr not in inputs]
    assert sum(others) <= out.untyped_storage().nbytes() + 4 * 64 * 4, kept  # the output, and an LSE
