"""Hopper (sm90) kernels in Gluon: warp-specialised forward, dK/dV and dQ for plain dense and causal attention.

The portable Triton kernels (kernels/forward.py, kernels/backward.py) run one 8-warp program per tile that does its
softmax (or dS) arithmetic between its matrix multiplies, so the tensor cores idle meanwhile. Here a program has
three kinds of partition (config.py's HOPPER_* constants give their warps and registers):

  producer   1 warp: streams tiles through TMA into rings of shared-memory slots (primitives.py)
  consumers  2 warpgroups (the forward: 2 or 3) with a tile of their own each, not synchronised with each
             other (except the fused backward's per-step dS exchange and, with the forward's PINGPONG, turns to
             issue MMAs: FlashAttention-3's ping-pong, by named barriers), so the SM can run one's arithmetic
             beside another's MMAs (wgmma).

  forward.py   attention_forward_sm90_kernel: persistent, one program per SM looping over query tiles
  dkdv.py      attention_backward_dkdv_sm90_kernel: dK, dV and, fused, dQ by TMA reductions
  dq.py        attention_backward_dq_sm90_kernel: dQ and delta without atomics (deterministic=True)

Scope (triton_backend dispatches everything else to the portable kernels): bf16/fp16, head dims 33 to 256
(config.hopper_width), no softcap / ALiBi / dropout / block mask / score_mod; no mask, causal, or a causal sliding
window; self-attention (seqlen_q == seqlen_k, or the same cu_seqlens) of any length, and dense attention without a mask
whose keys are of another length (N_K; a sequence that ends inside a tile sets RAGGED: keys and rows past its end
masked); layouts TMA reads (primitives.py); a Triton
whose private API triton_compat.PRIVATE_API_OK accepts.
"""

from .dkdv import attention_backward_dkdv_sm90_kernel
from .dq import attention_backward_dq_sm90_kernel
from .forward import attention_forward_sm90_kernel

__all__ = ["attention_backward_dkdv_sm90_kernel", "attention_backward_dq_sm90_kernel", "attention_forward_sm90_kernel"]
