"""Launchers: torch tensors in, Triton kernels run, torch tensors out.

Inputs are (batch, seqlen, heads, head_dim) with any strides whose last one is 1; outputs are
new contiguous tensors. Launch parameters come from kernels.config; nothing here is tuned.
"""

from __future__ import annotations

import math

import torch
import triton
from triton import knobs

from .kernels import config
from .kernels.backward import (
    attention_backward_dkdv_kernel,
    attention_backward_dq_kernel,
    attention_backward_preprocess_kernel,
)
from .kernels.forward import attention_forward_kernel

LOG2E = 1.0 / math.log(2.0)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return bool(knobs.runtime.interpret)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get true fp32 products (not tf32): the user asked for fp32 accuracy.
    return "ieee" if dtype == torch.float32 else "tf32"


def _interpreter_dtype(dtype: torch.dtype) -> torch.dtype:
    # Triton 3.6's interpreter computes bf16 tl.dot wrongly (errors ~1e10); run it in fp32 there.
    return torch.float32 if interpreting() and dtype == torch.bfloat16 else dtype


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    """(batch, seq, head) strides of a (B, N, H, D) tensor."""
    return x.stride(0), x.stride(1), x.stride(2)


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """O and natural-log LSE (batch, heads, seqlen_q) fp32, via the fused forward kernel."""
    out_dtype = q.dtype
    run_dtype = _interpreter_dtype(q.dtype)
    q, k, v = (_last_dim_contiguous(x.to(run_dtype)) for x in (q, k, v))
    batch, n_q, heads, head_dim = q.shape
    n_k, heads_k = k.shape[1], k.shape[2]
    out = torch.empty(batch, n_q, heads, head_dim, dtype=run_dtype, device=q.device)
    lse = torch.empty(batch, heads, n_q, dtype=torch.float32, device=q.device)

    arch = config.arch_of(q.device, interpreting())
    cfg = config.forward_config(arch, head_dim, run_dtype)
    grid = (triton.cdiv(n_q, cfg.block_m), batch * heads)
    attention_forward_kernel[grid](
        q, k, v, out, lse,
        *_strides(q), *_strides(k), *_strides(v), *_strides(out),
        n_q, n_k, softmax_scale * LOG2E,
        H=heads, GROUP=heads // heads_k, D=head_dim, BLOCK_D=config.block_d(head_dim),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal, EVEN_M=n_q % cfg.block_m == 0,
        DOT_PRECISION=_dot_precision(run_dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out.to(out_dtype), lse


def backward(
    dout: torch.Tensor,
    dlse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV by recomputation from Q, K, V and the forward's LSE (no N x N buffer)."""
    grad_dtype = q.dtype
    run_dtype = _interpreter_dtype(q.dtype)
    q, k, v, out, dout = (_last_dim_contiguous(x.to(run_dtype)) for x in (q, k, v, out, dout))
    lse = lse.contiguous()
    dlse = dlse.contiguous()
    batch, n_q, heads, head_dim = q.shape
    n_k, heads_k = k.shape[1], k.shape[2]
    group = heads // heads_k
    arch = config.arch_of(q.device, interpreting())
    cfg = config.backward_config(arch, head_dim, run_dtype)
    common = dict(H=heads, D=head_dim, BLOCK_D=config.block_d(head_dim))
    dots = dict(CAUSAL=causal, DOT_PRECISION=_dot_precision(run_dtype))
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    delta = torch.empty_like(lse)
    block = config.PREPROCESS_BLOCK_M
    attention_backward_preprocess_kernel[(triton.cdiv(n_q, block), batch * heads)](
        out, dout, dlse, delta, *_strides(out), *_strides(dout), n_q, BLOCK_M=block, **common
    )

    dq = torch.empty(q.shape, dtype=run_dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=run_dtype, device=q.device)
    dv = torch.empty(v.shape, dtype=run_dtype, device=q.device)
    qk_scale = softmax_scale * LOG2E
    attention_backward_dkdv_kernel[(triton.cdiv(n_k, cfg.block_n_kv), batch * heads_k)](
        q, k, v, dout, lse, delta, dk, dv,
        *_strides(q), *_strides(k), *_strides(v), *_strides(dout), *_strides(dk), *_strides(dv),
        n_q, n_k, qk_scale, softmax_scale,
        GROUP=group, BLOCK_M=cfg.block_m_kv, BLOCK_N=cfg.block_n_kv,
        EVEN_M=n_q % cfg.block_m_kv == 0, EVEN_N=n_k % cfg.block_n_kv == 0,
        **common, **dots, **launch,
    )  # fmt: skip
    attention_backward_dq_kernel[(triton.cdiv(n_q, cfg.block_m_q), batch * heads)](
        q, k, v, dout, lse, delta, dq,
        *_strides(q), *_strides(k), *_strides(v), *_strides(dout), *_strides(dq),
        n_q, n_k, qk_scale, softmax_scale,
        GROUP=group, BLOCK_M=cfg.block_m_q, BLOCK_N=cfg.block_n_q, EVEN_M=n_q % cfg.block_m_q == 0,
        **common, **dots, **launch,
    )  # fmt: skip
    return dq.to(grad_dtype), dk.to(grad_dtype), dv.to(grad_dtype)
