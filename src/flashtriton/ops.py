"""The attention op as registered torch.library custom ops, with fake (meta) and autograd.

``flashtriton::attention_forward`` and ``flashtriton::attention_backward`` are opaque to
torch.compile, which traces them through their fake implementations (no graph break), and the
autograd formula connects the two. Inputs arrive validated from the public API; these ops only
pick a backend and call its launcher.

Backend: environment variable FLASHTRITON_BACKEND, read at each call:
  auto (default)  Triton kernels for fp16/bf16 CUDA tensors, the PyTorch path for anything else
                  (fp32 included: the kernels' hardware exp2 is approximate, about 4x plain fp32's error)
  triton          Triton kernels (CPU tensors too when TRITON_INTERPRET=1: Triton's interpreter)
  torch           the PyTorch path (torch_backend.py) on any device
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from . import torch_backend

BACKEND_ENV = "FLASHTRITON_BACKEND"
BACKENDS = ("auto", "triton", "torch")


def _triton_backend() -> ModuleType:
    from . import triton_backend  # imported lazily: triton reads TRITON_INTERPRET at import

    return triton_backend


def select_backend(device: torch.device, dtype: torch.dtype) -> ModuleType:
    """The module (triton_backend or torch_backend) that runs attention for these tensors."""
    name = os.environ.get(BACKEND_ENV, "auto")
    if name not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={name!r} is not a backend: use one of {', '.join(BACKENDS)}")
    if name == "torch" or (name == "auto" and (device.type != "cuda" or dtype == torch.float32)):
        return torch_backend
    backend = _triton_backend()
    if device.type != "cuda" and not backend.interpreting():
        raise ValueError(
            f"{BACKEND_ENV}=triton needs CUDA tensors, or TRITON_INTERPRET=1 set before importing "
            f"flashtriton to run the kernels in Triton's CPU interpreter; got {device.type} tensors"
        )
    return backend


@torch.library.custom_op("flashtriton::attention_forward", mutates_args=())
def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool, deterministic: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns out (B, N_Q, H, D) and the natural-log LSE (B, H, N_Q) in fp32."""
    batch, n_q, heads, head_dim = q.shape
    if q.numel() == 0 or k.shape[1] == 0:
        # nothing to compute, or no key at all: every row is empty
        out = q.new_zeros(batch, n_q, heads, head_dim)
        return out, q.new_full((batch, heads, n_q), float("inf"), dtype=torch.float32)
    return select_backend(q.device, q.dtype).forward(q, k, v, softmax_scale, causal)


@attention_forward.register_fake
def _(q, k, v, softmax_scale, causal, deterministic):
    batch, n_q, heads, head_dim = q.shape
    return q.new_empty(batch, n_q, heads, head_dim), q.new_empty(batch, heads, n_q, dtype=torch.float32)


@torch.library.custom_op("flashtriton::attention_backward", mutates_args=())
def attention_backward(
    dout: torch.Tensor,
    dlse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv. Every backend's backward is deterministic, so ``deterministic`` needs no branch."""
    if q.numel() == 0 or k.numel() == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    backend = select_backend(q.device, q.dtype)
    return backend.backward(dout, dlse, q, k, v, out, lse, softmax_scale, causal)


@attention_backward.register_fake
def _(dout, dlse, q, k, v, out, lse, softmax_scale, causal, deterministic):
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
    )


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    ctx.deterministic = deterministic


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    # a caller may use only one of the two outputs
    dout = torch.zeros_like(out) if dout is None else dout
    dlse = torch.zeros_like(lse) if dlse is None else dlse
    dq, dk, dv = attention_backward(dout, dlse, q, k, v, out, lse, ctx.softmax_scale, ctx.causal, ctx.deterministic)
    return dq, dk, dv, None, None, None


attention_forward.register_autograd(_backward, setup_context=_setup_context)
