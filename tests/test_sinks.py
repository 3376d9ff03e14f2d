"""Learnable attention sinks (gpt-oss): flash_attn_func(..., sinks=) and the varlen and packed entry points, forward
and gradients (q, k, v and the sinks) against the fp64 reference on every available target (params.py has the
semantics: one more logit per row, sinks[h], that takes probability mass and multiplies no value).

Sinks are drawn near the rows' LSE, so that each takes a good share of the mass (a kernel that dropped one would
fail), and head 0's is -inf (no sink). On the GPU the shapes reach the sm90 Gluon forward (and the
backward's fused and pair schedules, and its varlen rows); on the CPU targets each case names one dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import pytest
import torch
import triton

import flashtriton as ft
from flashtriton import dropout, ops, schema, triton_backend
from flashtriton.kernels import config
from flashtriton.params import AttentionParams
from helpers import (
    TARGETS,
    Seqlens,
    Shape,
    assert_close_to_reference,
    dtype_name,
    dtypes_for,
    packed_inputs,
    random_qkv,
    reference_outputs,
)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")


@dataclass(frozen=True)
class Case:
    shape: Shape | Seqlens
    dtype: torch.dtype | None = None  # None: every dtype of the target
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    dropout_p: float = 0.0

    def __str__(self) -> str:
        parts = [dtype_name(self.dtype)] if self.dtype else []
        parts.append(str(self.shape))
        parts += ["causal"] * self.causal + [f"w{self.window[0]},{self.window[1]}"] * (self.window != (-1, -1))
        parts += [f"cap{self.softcap:g}"] * bool(self.softcap) + [f"drop{self.dropout_p:g}"] * bool(self.dropout_p)
        return "-".join(parts)


def _sinks(heads: int, device, no_sink_head: bool = True) -> torch.Tensor:
    """Sinks near the LSE of scores of unit variance over tens of keys; head 0's -inf (no sink) if no_sink_head."""
    sinks = torch.randn(heads, device=device) + 2.5
    if no_sink_head:
        sinks[0] = float("-inf")
    return sinks


def _backprop(out, lse, dout, dlse) -> None:
    finite = torch.isfinite(lse)
    ((out * dout).sum() + (lse[finite] * dlse[finite]).sum()).backward()


def _ours(q, k, v, sinks, dout, dlse, cu=None, **options) -> tuple[torch.Tensor, ...]:
    """out, lse, dq, dk, dv, dsinks of one call on fresh leaves (varlen with cu = (cu_q, cu_k, max_q, max_k))."""
    q, k, v, sinks = (x.detach().clone().requires_grad_() for x in (q, k, v, sinks))
    if cu is None:
        out, lse, _ = ft.flash_attn_func(q, k, v, return_attn_probs=True, sinks=sinks, **options)
    else:
        out, lse, _ = ft.flash_attn_varlen_func(q, k, v, *cu, return_attn_probs=True, sinks=sinks, **options)
    _backprop(out, lse, dout, dlse)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad, sinks.grad


def _draw_dropout_seed(torch_seed: int) -> int:
    """Seed torch's generator; return the dropout seed that the next call will draw from it."""
    torch.manual_seed(torch_seed)
    seed = int(dropout.draw_seed())
    torch.manual_seed(torch_seed)
    return seed


def check_case(target, case: Case, repeat: int = 0) -> None:
    """Ours against the reference in fp64, in each dtype; then ``repeat`` more calls bitwise the same."""
    for dtype in [case.dtype] if case.dtype else dtypes_for(target):
        options = dict(causal=case.causal, window_size=case.window, softcap=case.softcap, dropout_p=case.dropout_p)
        s = case.shape
        sinks = _sinks(s.heads, target.device)
        reference = dict(options, sinks=sinks)
        cu = None
        if isinstance(s, Shape):
            q, k, v = random_qkv(s, dtype, target.device, requires_grad=False)
            dlse = torch.randn(s.batch, s.heads, s.n_q, device=q.device)
        else:
            q, k, v, cu_q, cu_k = packed_inputs(s, dtype, target.device)
            cu = (cu_q, cu_k, max(s.q), max(s.k))
            dlse = torch.randn(s.heads, q.shape[0], device=q.device)
        dout = torch.randn(q.shape, dtype=dtype, device=q.device)
        seed = _draw_dropout_seed(1)
        ours = _ours(q, k, v, sinks, dout, dlse, cu, **options, deterministic=repeat > 0)
        if cu is not None:
            reference.update(cu_seqlens=(cu_q, cu_k), dropout_seed=seed)
        elif case.dropout_p:
            mask = dropout.dropout_mask(seed, case.dropout_p, s.batch, s.heads, s.n_q, s.n_k, q.device)
            reference.update(dropout_mask=mask)
        exact = reference_outputs(q, k, v, dout, dlse, **reference)
        plain = reference_outputs(q, k, v, dout, dlse, compute_dtype=None, **reference)
        for name, a, e, p in zip(NAMES, ours, exact, plain, strict=True):
            assert a.dtype == (F32 if name in ("lse", "dsinks") else dtype), name
            assert_close_to_reference(f"{name} ({dtype})", a, e, p)
        for _ in range(repeat):
            torch.manual_seed(1)  # the first call's dropout seed
            again = _ours(q, k, v, sinks, dout, dlse, cu, **options, deterministic=True)
            for name, a, b in zip(NAMES, ours, again, strict=True):
                assert torch.equal(a, b), f"{name} ({dtype}): a deterministic call did not repeat bit for bit"


def _params(cases: dict[str, list]) -> list:
    return [pytest.param(t, c, id=f"{t}-{c}") for t in TARGETS for c in cases[t.size]]


# n_q > n_k under a window leaves rows with no key (their LSE is the sink); ragged varlen with empty sequences
CASES = {
    "tiny": [
        Case(Shape(2, 33, 40, 4, 2, 24), F16, causal=True),
        Case(Shape(1, 45, 30, 2, 1, 16), F32, window=(6, 2)),
        Case(Seqlens((5, 0, 17, 40, 3), (7, 3, 17, 25, 0), 4, 2, 16), F32, causal=True),
        Case(Shape(2, 40, 40, 2, 1, 16), F32, dropout_p=0.2),
    ],
    "cpu": [
        Case(Shape(2, 300, 260, 4, 2, 72), BF16, causal=True),
        Case(Shape(2, 257, 200, 4, 1, 40), F32, window=(50, 10)),
        Case(Shape(1, 200, 113, 2, 2, 64), F16, softcap=3.0),
        Case(Seqlens((1, 0, 130, 300, 77), (1, 5, 200, 530, 0), 2, 1, 64), F32, causal=True, window=(64, -1)),
        Case(Shape(2, 300, 300, 4, 2, 64), F32, dropout_p=0.15),
    ],
    "gpu": [
        Case(Shape(2, 1024, 1024, 8, 2, 128), causal=True),  # the Gluon forward and pair backward
        Case(Shape(2, 2048, 2048, 8, 8, 64)),  # the Gluon fused backward
        Case(Shape(1, 4096, 4096, 4, 2, 64), causal=True, window=(2500, -1)),
        Case(Shape(2, 1024, 1024, 4, 2, 256), causal=True),
        Case(Shape(2, 1000, 1300, 8, 2, 96), window=(128, 64)),  # the portable kernels
        Case(Seqlens((256, 0, 1024, 128), (256, 0, 1024, 128), 8, 4, 128), causal=True),  # Gluon varlen rows
        Case(Seqlens((1, 0, 1000, 333, 700), (1, 9, 1500, 200, 0), 8, 2, 128), causal=True),
        Case(Shape(2, 1000, 1000, 8, 2, 128), dropout_p=0.1),
    ],
}


@pytest.mark.parametrize("backend,case", _params(CASES), indirect=["backend"])
def test_matches_reference(backend, case):
    check_case(backend, case)


DETERMINISTIC = {
    "tiny": [Case(Shape(1, 30, 37, 2, 1, 16), F32, causal=True)],
    "cpu": [Case(Shape(2, 170, 200, 4, 2, 64), F32, window=(40, -1))],
    "gpu": [Case(Shape(2, 2048, 2048, 8, 2, 128), causal=True), Case(Shape(2, 1000, 700, 8, 2, 72), dropout_p=0.1)],
}


@pytest.mark.parametrize("backend,case", _params(DETERMINISTIC), indirect=["backend"])
def test_deterministic_repeats(backend, case):
    """deterministic=True: right, and bitwise the same out, LSE and gradients (the sinks' too) twice more."""
    check_case(backend, case, repeat=2)


EMPTY_ROWS = {
    "tiny": [Shape(2, 40, 25, 4, 2, 16)],
    "cpu": [Shape(2, 500, 300, 4, 2, 64)],
    "gpu": [Shape(2, 2000, 900, 8, 2, 128)],
}


@pytest.mark.parametrize("backend,shape", _params(EMPTY_ROWS), indirect=["backend"])
def test_rows_without_keys_get_the_sink_alone(backend, shape):
    """Rows that see no key: out 0 and LSE sinks[h] (+inf where the sink is -inf), dq 0, no NaN anywhere; the
    sinks' gradient there is dLSE's (they hold all the row's mass)."""
    window = (5, 2)
    q, k, v = random_qkv(shape, F16, backend.device)
    sinks = _sinks(shape.heads, backend.device).requires_grad_()
    out, lse, _ = ft.flash_attn_func(q, k, v, window_size=window, sinks=sinks, return_attn_probs=True)
    empty = shape.n_q - shape.n_k - window[1]  # rows i < empty see no key
    dlse = torch.zeros_like(lse)
    dlse[:, :, :empty] = 1.0
    _backprop(out, lse, torch.zeros_like(out), dlse)  # the loss is the empty rows' LSE alone
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    expected = sinks.detach().view(1, -1, 1).expand(shape.batch, -1, empty).float()
    expected = expected.masked_fill(torch.isneginf(expected), float("inf"))
    torch.testing.assert_close(lse[:, :, :empty], expected, rtol=1e-6, atol=0)
    assert lse[:, :, empty:].isfinite().all()
    assert torch.equal(q.grad[:, :empty], torch.zeros_like(q.grad[:, :empty]))
    for x in (out, q.grad, k.grad, v.grad, sinks.grad):
        assert not torch.isnan(x).any()
    counts = torch.full((shape.heads,), float(shape.batch * empty), device=backend.device)
    counts[0] = 0.0  # the -inf sink's head
    torch.testing.assert_close(sinks.grad, counts, rtol=1e-6, atol=0)


MINUS_INF = {
    "tiny": [Shape(1, 37, 30, 2, 1, 24)],
    "cpu": [Shape(2, 300, 200, 4, 2, 64)],
    "gpu": [Shape(2, 1024, 1024, 8, 2, 128), Shape(2, 1000, 700, 8, 2, 72)],  # the Gluon kernels, the portable ones
}


@pytest.mark.parametrize("backend,shape", _params(MINUS_INF), indirect=["backend"])
def test_minus_inf_sinks_are_no_sinks(backend, shape):
    """Every sink -inf: bitwise the call without sinks (under a causal window, where n_q > n_k with rows that see no
    key), and the sinks' gradient is 0."""
    options = dict(causal=True, window_size=(9, -1), deterministic=True)
    q, k, v = random_qkv(shape, dtypes_for(backend)[-1], backend.device, requires_grad=False)
    dout = torch.randn_like(q)
    dlse = torch.randn(shape.batch, shape.heads, shape.n_q, device=q.device)
    sinks = torch.full((shape.heads,), float("-inf"), device=q.device)
    with_sinks = _ours(q, k, v, sinks, dout, dlse, **options)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse, _ = ft.flash_attn_func(*leaves, return_attn_probs=True, **options)
    _backprop(out, lse, dout, dlse)
    if shape.n_q > shape.n_k:
        assert torch.isposinf(lse).any()  # the first rows see no key
    for name, a, b in zip(NAMES, with_sinks, (out, lse, *(x.grad for x in leaves)), strict=False):
        assert torch.equal(a, b), name
    assert torch.equal(with_sinks[-1], torch.zeros_like(sinks))


# the entry points only pass the sinks on, whatever the backend: the interpreter's kernels are tested above
PACKED = {
    "tiny": [],
    "cpu": [Shape(2, 97, 97, 4, 4, 40)],
    "gpu": [Shape(2, 1024, 1024, 8, 8, 128)],
}


def _packed_calls(q: torch.Tensor, sinks: torch.Tensor) -> dict:
    """Each packed entry point's causal self-attention of x = q = k = v: name -> (its inputs, the call)."""
    batch, n = q.shape[:2]
    cu = torch.arange(0, (batch + 1) * n, n, dtype=torch.int32, device=q.device)
    qkv, kv = torch.stack([q, q, q], 2), torch.stack([q, q], 2)
    return {
        "qkvpacked": ([qkv], lambda qkv: ft.flash_attn_qkvpacked_func(qkv, causal=True, sinks=sinks)),
        "kvpacked": ([q, kv], lambda q, kv: ft.flash_attn_kvpacked_func(q, kv, causal=True, sinks=sinks)),
        "varlen-qkvpacked": (
            [qkv.flatten(0, 1)],
            lambda qkv: ft.flash_attn_varlen_qkvpacked_func(qkv, cu, n, causal=True, sinks=sinks).unflatten(
                0, (batch, n)
            ),
        ),
        "varlen-kvpacked": (
            [q.flatten(0, 1), kv.flatten(0, 1)],
            lambda q, kv: ft.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, n, n, causal=True, sinks=sinks).unflatten(
                0, (batch, n)
            ),
        ),
    }


@pytest.mark.parametrize("backend,shape", _params(PACKED), indirect=["backend"])
def test_packed_entry_points_take_sinks(backend, shape):
    """flash_attn_qkvpacked / kvpacked and their varlen forms pass the sinks on: out and the sinks' gradient as
    flash_attn_func's with the same sinks (which differs from a call without them)."""
    dtype = F32 if backend.device == "cpu" else F16
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == F32 else dict(rtol=1e-2, atol=1e-2)
    x = random_qkv(shape, dtype, backend.device, requires_grad=False)[0]
    sinks = _sinks(shape.heads, backend.device).requires_grad_()
    expected = ft.flash_attn_func(x, x, x, causal=True, sinks=sinks)
    (dsinks,) = torch.autograd.grad(expected.sum(), sinks)
    assert (ft.flash_attn_func(x, x, x, causal=True) - expected).abs().max() > 0.05
    for name, (inputs, call) in _packed_calls(x, sinks).items():
        out = call(*inputs)
        torch.testing.assert_close(out, expected, **tolerance, msg=name)
        torch.testing.assert_close(torch.autograd.grad(out.sum(), sinks)[0], dsinks, **tolerance, msg=name)


@pytest.mark.parametrize("backend", TARGETS, ids=str, indirect=True)
def test_bf16_sinks_are_cast(backend):
    """A bf16 sinks parameter (a model's) runs as its fp32 value, and its gradient comes back in bf16."""
    q, k, v = random_qkv(Shape(1, 19, 23, 2, 1, 16), F32 if backend.device == "cpu" else F16, backend.device)
    sinks = _sinks(2, backend.device, no_sink_head=False).to(BF16).requires_grad_()
    as_fp32 = sinks.detach().float().requires_grad_()
    out = ft.flash_attn_func(q, k, v, sinks=sinks)
    expected = ft.flash_attn_func(q, k, v, sinks=as_fp32)
    assert torch.equal(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert sinks.grad.dtype == BF16
    assert torch.equal(sinks.grad, as_fp32.grad.to(BF16))


def _compile_cases(device):
    shape = Shape(2, 37, 37, 4, 2, 16)
    q, k, v = random_qkv(shape, F32, device)
    sinks = _sinks(4, device).requires_grad_()
    cu = torch.tensor([0, 5, 37, 74], dtype=torch.int32, device=device)
    packed = [x.detach().flatten(0, 1).requires_grad_() for x in (q, k, v)]
    return {
        "dense": (lambda q, k, v, s: ft.flash_attn_func(q, k, v, causal=True, window_size=(7, -1), sinks=s), (q, k, v)),
        "lse-loss": (lambda q, k, v, s: ft.flash_attn_func(q, k, v, sinks=s, return_attn_probs=True)[1], (q, k, v)),
        "varlen": (lambda q, k, v, s: ft.flash_attn_varlen_func(q, k, v, cu, cu, 37, 37, causal=True, sinks=s), packed),
    }, sinks


# the ops' schema and autograd are the same whatever kernels run: not traced again in the interpreter
COMPILED = [
    pytest.param(t, name, id=f"{t}-{name}")
    for t in TARGETS
    for name in ("dense", "lse-loss", "varlen")
    if t.name != "cpu-interp"
]


@pytest.mark.parametrize(("backend", "name"), COMPILED, indirect=["backend"])
def test_fullgraph_matches_eager(backend, name):
    """torch.compile(fullgraph=True) traces a call with sinks through the custom ops (aot_eager on CPU, inductor on
    the GPU); its value and its gradients, the sinks' included, are the eager call's."""
    torch._dynamo.reset()
    cases, sinks = _compile_cases(backend.device)
    loss_of, inputs = cases[name]
    inputs = (*inputs, sinks)

    def step(*inputs):
        return loss_of(*inputs).float().square().sum()

    eager = step(*inputs)
    grads_eager = torch.autograd.grad(eager, inputs)
    compiler = "inductor" if backend.device == "cuda" else "aot_eager"
    compiled = torch.compile(step, fullgraph=True, backend=compiler)(*inputs)
    grads = torch.autograd.grad(compiled, inputs)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert grads[-1].abs().max() > 0
    for grad, grad_eager in zip(grads, grads_eager, strict=True):
        torch.testing.assert_close(grad, grad_eager, rtol=1e-5, atol=1e-5)


def test_opcheck_with_sinks():
    """torch.library's checks of the schema, fake and autograd registrations, with sinks that need a gradient."""
    q, k, v = (torch.randn(1, 9, 2, 16, requires_grad=True) for _ in range(3))
    params = AttentionParams(0.25, window_left=3, window_right=0, sinks=torch.randn(2, requires_grad=True))
    assert "Tensor? sinks" in schema.SIGNATURE
    torch.library.opcheck(torch.ops.flashtriton.attention_forward.default, (q, k, v, *schema.to_schema(params)))


def test_gluon_rows_gathered_as_the_lse():
    """The Gluon backward's varlen delta rows (sequence b from (cdiv(its start, ALIGN) + b) * ALIGN, as
    kernels/hopper/primitives.rows_start places them) read back in the LSE's (nheads, total_q) layout: dsinks on sm90
    takes them so, and no CPU target runs that backward. The rows are laid out here by a loop over the sequences,
    apart from _unaligned's vectorised gather; whether the kernels write that layout, only the GPU tests see."""
    align, heads = config.LSE_ROWS_ALIGN, 3
    lengths = [align + 5, 0, 1, 2 * align, 7]
    starts = [0, *accumulate(lengths)]
    cu = torch.tensor(starts, dtype=torch.int32)
    total = starts[-1]
    rows = torch.full((heads, (-(-total // align) + len(lengths)) * align), float("nan"))
    expected = torch.randn(heads, total)
    for b, (start, n) in enumerate(zip(starts, lengths, strict=False)):
        first = (-(-start // align) + b) * align
        rows[:, first : first + n] = expected[:, start : start + n]
    params = AttentionParams(1.0, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=2 * align, max_seqlen_k=2 * align)
    assert torch.equal(triton_backend._unaligned(rows, params, expected.shape), expected)
    dense = torch.randn(2, heads, 2 * align)
    assert torch.equal(
        triton_backend._unaligned(dense, AttentionParams(1.0), (2, heads, align + 3)), dense[..., : align + 3]
    )


@triton.jit
def _forward_only(score, b, h, q_idx, kv_idx):
    return score * 0.5


def test_a_forward_only_score_mod_is_refused_when_only_the_sinks_learn(monkeypatch):
    """The sinks' gradient needs the backward, through the score_mod: a score_mod without grad is refused before
    anything runs when the sinks alone require grad, as when q, k or v do."""
    monkeypatch.setattr(ops, "forward", lambda *args: pytest.fail("ops.forward ran"))
    q, k, v = random_qkv(Shape(1, 8, 8, 4, 2, 16), F32, "cpu", requires_grad=False)
    with pytest.raises(ValueError, match="forward-only"):
        ft.flash_attn_func(q, k, v, score_mod=ft.Mod(_forward_only), sinks=torch.zeros(4, requires_grad=True))


@pytest.mark.parametrize(
    "sinks, error, message",
    [
        ([1.0, 2.0], TypeError, "sinks must be a torch.Tensor"),
        (torch.ones(4, dtype=torch.int32), TypeError, "floating tensor"),
        (torch.ones(2), ValueError, r"shape \(nheads,\) = \(4,\)"),
        (torch.ones(1, 4), ValueError, r"shape \(nheads,\) = \(4,\)"),
        (torch.ones(4, device="meta"), ValueError, "sinks is on meta"),
    ],
    ids=["list", "int32", "kv-heads", "2d", "device"],
)
def test_bad_sinks_raise_before_launch(sinks, error, message, monkeypatch):
    """Every entry point checks its sinks before anything runs (ops.forward is never reached)."""
    monkeypatch.setattr(ops, "forward", lambda *args: pytest.fail("ops.forward ran"))
    q, k, v = random_qkv(Shape(2, 8, 8, 4, 2, 16), F32, "cpu")
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    with pytest.raises(error, match=message):
        ft.flash_attn_func(q, k, v, sinks=sinks)
    with pytest.raises(error, match=message):
        ft.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 8, 8, sinks=sinks)
    with pytest.raises(error, match=message):
        ft.flash_attn_kvpacked_func(q, torch.stack([k, v], 2), sinks=sinks)


def test_learnable_sink_is_sinks_by_flash_attn_4s_name(monkeypatch):
    """learnable_sink= (flash_attn 4's name, which transformers passes where a function's signature has it) is
    sinks= on flash_attn_func and flash_attn_varlen_func; both at once raise before anything runs."""
    q, k, v = random_qkv(Shape(2, 8, 8, 4, 2, 16), F32, "cpu", requires_grad=False)
    sinks = _sinks(4, "cpu")
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    packed = (q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 8, 8)
    by_name = ft.flash_attn_func(q, k, v, learnable_sink=sinks)
    assert torch.equal(by_name, ft.flash_attn_func(q, k, v, sinks=sinks))
    assert not torch.allclose(by_name, ft.flash_attn_func(q, k, v))  # the sinks took mass: not dropped
    assert torch.equal(
        ft.flash_attn_varlen_func(*packed, learnable_sink=sinks), ft.flash_attn_varlen_func(*packed, sinks=sinks)
    )
    monkeypatch.setattr(ops, "forward", lambda *args: pytest.fail("ops.forward ran"))
    with pytest.raises(ValueError, match="not both"):
        ft.flash_attn_func(q, k, v, sinks=sinks, learnable_sink=sinks)
    with pytest.raises(ValueError, match="not both"):
        ft.flash_attn_varlen_func(*packed, sinks=sinks, learnable_sink=sinks)
