"""The users suite's cases (``flashtriton bench --suite users``): the shapes, layouts and calls users bring.

Groups, bf16 on a GPU; fwd is an inference call (no autograd graph), fwd_bwd a forward and torch.autograd.grad of
q, k and v (fresh gradients per step, as a training step takes them):
- layout: q, k, v as (B, N, H, D) views of a model's (B, H, N, D) storage (what transformers hands over) beside
  contiguous inputs; GQA 16/4, D 128, causal, B1 N8192 and B4 N2048. Peers: cuDNN SDPA on contiguous (B, H, N, D)
  copies (its best ordinary setup), and cuDNN SDPA on our own tensors seen as (B, H, N, D).
- lengths: N = 1000, 3000, 4000, 8000, 15000, each beside its whole-tile neighbour (1024, 3072, 4096, 8192, 16384)
  so that TFLOP/s compare per FLOP; B * N about 16k tokens, H * D = 2048, D 64/128/256, causal and not. Peers:
  cuDNN SDPA and FlexAttention compiled for the shape.
- documents: eight causal documents of ragged lengths packed in 16k tokens, H 16, D 128: flash_attn_varlen_func
  against FlexAttention with the same document-causal block mask.
- short: N = 512 and 1024 (the latter measured in lengths) with B * N = 16k, D 64/128/256, causal and not,
  fwd_bwd, against cuDNN SDPA.
- gqa: 32 query heads on 8 key/value heads, D 128, N 4096, causal, against cuDNN SDPA and FlexAttention.
- host: wall time per call over blocks of calls with one synchronize (timing.HOST_CALLS), at B1 N128 H1 D64 (the
  GPU idles: the host's time) and at a short N, against cuDNN SDPA.
- memory: the allocator's peak beyond the inputs in one causal fwd_bwd at 16k and 128k tokens (B1, H16, D128),
  against cuDNN SDPA; not timed.
Without a GPU the suite runs a tiny case of each group on the CPU (the PyTorch path), SDPA's default as the peer
that runs there; the GPU-only peers are reported unavailable.
"""

from __future__ import annotations

from .cases import OURS, UserCase

TOKENS, HIDDEN = 16384, 2048  # the paper sweep's batch * seqlen and heads * head_dim
HEAD_DIMS = (64, 128, 256)
LENGTHS = ((1000, 1024), (3000, 3072), (4000, 4096), (8000, 8192), (15000, 16384))  # (inside a tile, whole tiles)
SHORT = 512
DOCUMENTS = (3000, 517, 2048, 4444, 1111, 1800, 2213, 1251)  # ragged lengths summing to TOKENS
HOST_SHAPES = ((1, 128, 1, 64), (TOKENS // SHORT, SHORT, 16, 128))  # (B, N, H, D): tiny, short N
MEMORY_TOKENS = (16384, 131072)
GROUPS = ("layout", "lengths", "documents", "short", "gqa", "host", "memory")

CUDNN, CUDNN_VIEW, FLEX, SDPA = "sdpa-cudnn", "sdpa-cudnn-view", "flex", "sdpa"
BOTH, FWD_BWD = ("fwd", "fwd_bwd"), ("fwd_bwd",)


def _case(group, batch, n, heads, heads_k, head_dim, causal, peers, dtype, modes=BOTH, **layout) -> UserCase:
    return UserCase(group, batch, n, heads, heads_k, head_dim, causal, modes, (OURS, *peers), dtype=dtype, **layout)


def gpu_cases(dtype: str = "bfloat16") -> list[UserCase]:
    """The suite on a GPU, in table order (each length beside its whole-tile neighbour)."""
    cases = [
        _case("layout", b, n, 16, 4, 128, True, (CUDNN, CUDNN_VIEW), dtype, layout=layout)
        for b, n in ((1, 8192), (4, 2048))
        for layout in ("model", "contiguous")
    ]
    cases += [
        _case("lengths", TOKENS // n, n, HIDDEN // d, HIDDEN // d, d, causal, (CUDNN, FLEX), dtype)
        for d in HEAD_DIMS
        for causal in (False, True)
        for pair in LENGTHS
        for n in pair
    ]
    cases.append(_case("documents", 1, TOKENS, 16, 16, 128, True, (FLEX,), dtype, documents=DOCUMENTS))
    cases += [
        _case("short", TOKENS // SHORT, SHORT, HIDDEN // d, HIDDEN // d, d, causal, (CUDNN,), dtype, FWD_BWD)
        for d in HEAD_DIMS
        for causal in (False, True)
    ]
    cases.append(_case("gqa", TOKENS // 4096, 4096, 32, 8, 128, True, (CUDNN, FLEX), dtype))
    cases += [
        _case("host", b, n, h, h, d, causal, (CUDNN,), dtype, measure="host")
        for b, n, h, d in HOST_SHAPES
        for causal in (False, True)
    ]
    cases += [
        _case("memory", 1, n, 16, 16, 128, True, (CUDNN,), dtype, FWD_BWD, measure="memory") for n in MEMORY_TOKENS
    ]
    return cases


def cpu_cases(dtype: str = "float32") -> list[UserCase]:
    """A tiny case of each group for a CPU: SDPA's default (which runs there) beside the GPU peers."""
    peers = (SDPA, CUDNN)
    return [
        _case("layout", 1, 64, 4, 1, 16, True, (*peers, CUDNN_VIEW), dtype, layout="model"),
        _case("layout", 1, 64, 4, 1, 16, True, (*peers, CUDNN_VIEW), dtype),
        _case("lengths", 2, 100, 2, 2, 16, False, (*peers, FLEX), dtype),
        _case("documents", 1, 128, 2, 2, 16, True, (FLEX,), dtype, documents=(37, 5, 64, 22)),
        _case("short", 4, 32, 2, 2, 16, True, peers, dtype, FWD_BWD),
        _case("gqa", 1, 64, 4, 2, 16, True, (*peers, FLEX), dtype),
        _case("host", 1, 128, 1, 1, 64, True, peers, dtype, measure="host"),
        _case("memory", 1, 128, 2, 2, 16, True, peers, dtype, FWD_BWD, measure="memory"),
    ]


def first_of_each_group(cases: list[UserCase]) -> list[UserCase]:
    """--quick on a GPU: the first case of each group."""
    first: dict[str, UserCase] = {}
    for case in cases:
        first.setdefault(case.group, case)
    return list(first.values())
