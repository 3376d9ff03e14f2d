"""The providers: (q, k, v) in (B, N, H, D) and causal -> a forward callable returning out."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..interface import flash_attn_func
from ..reference import attention_reference
from .cases import OURS


def _sdpa(backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def make(q, k, v, causal):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)

        return run

    return make


def compiled_flex() -> Callable:
    """flex_attention compiled for static shapes: each case compiles for its own shape, as a user with one shape
    gets it (by default dynamo recompiles with dynamic shapes from the second shape on, which times another
    kernel)."""
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.recompile_limit = 1000
    torch._functorch.config.donated_buffer = False  # the "bwd" mode calls backward(retain_graph=True)
    return torch.compile(flex_attention, dynamic=False)


def _flex(q, k, v, causal):
    from torch.nn.attention.flex_attention import create_block_mask

    compiled = compiled_flex()
    mask = None
    if causal:
        offset = k.shape[1] - q.shape[1]
        mask = create_block_mask(
            lambda b, h, i, j: j <= i + offset, None, None, q.shape[1], k.shape[1], device=q.device
        )
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    return lambda: compiled(qt, kt, vt, block_mask=mask).transpose(1, 2)


def _flash_attn_package(q, k, v, causal):
    from flash_attn import flash_attn_func as upstream

    return lambda: upstream(q, k, v, causal=causal)


def _sdpa_default(q, k, v, causal):
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)


PROVIDERS: dict[str, Callable] = {
    OURS: lambda q, k, v, causal: lambda: flash_attn_func(q, k, v, causal=causal),
    "sdpa": _sdpa_default,
    "sdpa-cudnn": _sdpa("CUDNN_ATTENTION"),
    "sdpa-flash": _sdpa("FLASH_ATTENTION"),
    "sdpa-efficient": _sdpa("EFFICIENT_ATTENTION"),
    "flex": _flex,
    "standard": lambda q, k, v, causal: lambda: attention_reference(q, k, v, causal=causal, compute_dtype=None)[0],
    "flash_attn": _flash_attn_package,
}
GPU_ONLY = {"sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "flex", "flash_attn"}
