"""Targets, shapes and the one tolerance rule shared by the tests."""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import accumulate

import pytest
import torch

from flashtriton import attention_reference
from flashtriton.reference import attention_reference_varlen

hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU"
)


def poison_empty(monkeypatch) -> None:
    """torch.empty fills floating tensors with NaN: an output that a kernel did not write would show."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        x = empty(*args, **kwargs)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", poisoned)


@dataclass(frozen=True)
class Target:
    name: str
    device: str
    backend: str
    size: str  # which shape list applies: "cpu", "tiny" or "gpu"

    def __str__(self) -> str:
        return self.name


def available_targets() -> list[Target]:
    targets = [Target("cpu-torch", "cpu", "torch", "cpu")]
    # The kernels run fp32 on the GPU too, but with approximate exp2 (error ~4x plain fp32's), so
    # fp32 is tested on the PyTorch path and in the interpreter (exact exp2), not on cuda-triton.
    if os.environ.get("TRITON_INTERPRET") == "1":
        targets.append(Target("cpu-interp", "cpu", "triton", "tiny"))
    if torch.cuda.is_available():
        targets.append(Target("cuda-triton", "cuda", "triton", "gpu"))
    return targets


TARGETS = available_targets()


@dataclass(frozen=True)
class Shape:
    batch: int
    n_q: int
    n_k: int
    heads: int
    heads_k: int
    head_dim: int

    def __str__(self) -> str:
        gqa = f"h{self.heads}/{self.heads_k}" if self.heads != self.heads_k else f"h{self.heads}"
        return f"b{self.batch}-q{self.n_q}-k{self.n_k}-{gqa}-d{self.head_dim}"


@dataclass(frozen=True)
class Seqlens:
    """A packed variable-length batch: sequence b has q[b] queries and k[b] keys."""

    q: tuple[int, ...]
    k: tuple[int, ...]
    heads: int
    heads_k: int
    head_dim: int

    def __str__(self) -> str:
        gqa = f"h{self.heads}/{self.heads_k}" if self.heads != self.heads_k else f"h{self.heads}"
        return f"q{','.join(map(str, self.q))}-k{','.join(map(str, self.k))}-{gqa}-d{self.head_dim}"

    @property
    def batch(self) -> int:
        return len(self.q)


def packed_inputs(lens: Seqlens, dtype, device):
    """q (total_q, H, D), k, v (total_k, HKV, D) and int32 cu_seqlens_q, cu_seqlens_k."""
    q = torch.randn(sum(lens.q), lens.heads, lens.head_dim, dtype=dtype, device=device)
    k = torch.randn(sum(lens.k), lens.heads_k, lens.head_dim, dtype=dtype, device=device)
    v = torch.randn(sum(lens.k), lens.heads_k, lens.head_dim, dtype=dtype, device=device)
    cu_q, cu_k = (torch.tensor([0, *accumulate(n)], dtype=torch.int32, device=device) for n in (lens.q, lens.k))
    return q, k, v, cu_q, cu_k


def target_params(shapes_by_size: dict[str, list], targets=None):
    """pytest params (target, item) for every available target and that target's items."""
    params = []
    for target in targets or TARGETS:
        for item in shapes_by_size[target.size]:
            params.append(pytest.param(target, item, id=f"{target}-{item}"))
    return params


def dtypes_for(target: Target) -> list[torch.dtype]:
    """The input dtypes a target is tested in. The interpreter runs bf16 as fp32 (Triton 3.6 computes bf16 tl.dot
    wrongly there), so it has no bf16 of its own."""
    if target.device == "cuda":
        return [torch.float16, torch.bfloat16]
    return [torch.float32, torch.float16] if target.size == "tiny" else [torch.float32, torch.float16, torch.bfloat16]


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def random_qkv(shape: Shape, dtype, device, requires_grad=True):
    q = torch.randn(shape.batch, shape.n_q, shape.heads, shape.head_dim, dtype=dtype, device=device)
    k = torch.randn(shape.batch, shape.n_k, shape.heads_k, shape.head_dim, dtype=dtype, device=device)
    v = torch.randn(shape.batch, shape.n_k, shape.heads_k, shape.head_dim, dtype=dtype, device=device)
    return tuple(x.requires_grad_(requires_grad) for x in (q, k, v))


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0


FLOOR_ULPS = 16


def assert_close_to_reference(name: str, actual, exact, plain) -> None:
    """The one tolerance rule: |actual - exact| <= 2 * |plain - exact| + floor, elementwise max.

    ``exact`` is the fp64 reference, ``plain`` plain PyTorch attention in the inputs' dtype. The
    floor is a few fp32 ulps at the reference's magnitude: the kernels accumulate in fp32, and
    the backward's dP - delta cancels, so fp32 inputs cannot beat that whatever plain does.
    +inf entries (LSE of rows that see no key) must match exactly.
    """
    assert actual.shape == exact.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(exact.shape)}"
    assert not torch.isnan(actual).any(), f"{name}: NaN in output"
    inf = torch.isinf(exact)
    assert torch.equal(torch.isinf(actual), inf), f"{name}: +inf entries differ from the reference"
    actual, exact, plain = actual[~inf], exact[~inf], plain[~inf]
    if not exact.numel():
        return
    floor = FLOOR_ULPS * torch.finfo(torch.float32).eps * max(1.0, exact.abs().max().item())
    err, base = max_error(actual, exact), max_error(plain, exact)
    assert err <= 2 * base + floor, f"{name}: error {err:.3e} > 2 x plain PyTorch's {base:.3e} + {floor:.1e}"


def reference_outputs(
    q, k, v, dout, dlse, causal, softmax_scale=None, compute_dtype=torch.float64, *, cu_seqlens=None, **options
):
    """out, lse, dq, dk, dv of the reference on copies of q, k, v (loss = <out, dout> + <lse, dlse>), and dsinks
    after them when options give sinks.

    options: attention_reference's keyword options (window_size, softcap, alibi_slopes, dropout_p,
    dropout_mask, sinks). With cu_seqlens = (cu_seqlens_q, cu_seqlens_k): the varlen reference on packed
    q, k, v, whose options take dropout_seed instead of dropout_mask.
    """
    inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    if options.get("sinks") is not None:
        options["sinks"] = options["sinks"].detach().clone().requires_grad_()
        inputs.append(options["sinks"])
    common = dict(softmax_scale=softmax_scale, causal=causal, compute_dtype=compute_dtype, **options)
    if cu_seqlens is None:
        out, lse = attention_reference(*inputs[:3], **common)
    else:
        out, lse = attention_reference_varlen(*inputs[:3], *cu_seqlens, **common)
    finite = torch.isfinite(lse)
    loss = (out * dout.to(out.dtype)).sum() + (lse[finite] * dlse[finite].to(lse.dtype)).sum()
    loss.backward()
    return (out.detach(), lse.detach(), *(x.grad for x in inputs))
