"""Head dims between the Gluon kernels' widths (64, 128, 256): the Gluon kernels at the next width, the portable
kernels and cuDNN SDPA, call for call on one Hopper GPU.

    PYTHONPATH=src python benchmarks/head_dims.py [--out head_dims.json]

Cases (bf16): GPT-3 2.7B's heads of 80 at its training shapes (benchmarks/train.py: 16k tokens, 32 heads, causal),
and head dims 32 to 192 at B4 N4096 H16. Each case-mode times flashtriton with the Gluon kernels, flashtriton with
them held back (config.HOPPER_MIN_HEAD_DIM raised: the portable kernels) and cuDNN SDPA (contiguous (B, H, N, D)) as
eager calls after an L2 flush, in turn (benchmarks/ab.py), fwd and fwd_bwd (fresh gradients). Both flashtriton
variants decide their route afresh on every call (the switch needs it), so both pay that host time.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from ab import in_turn, passes_for
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtriton
from flashtriton import route, triton_backend
from flashtriton.bench.results import environment
from flashtriton.kernels import config

# (batch, seqlen, heads, head_dim, causal)
CASES = [
    (8, 2048, 32, 80, True),
    (2, 8192, 32, 80, True),
    (2, 8192, 32, 80, False),
    (16, 1024, 16, 80, False),
    *((4, 4096, 16, d, True) for d in (32, 40, 48, 96, 192)),
]
GLUON_MIN = config.HOPPER_MIN_HEAD_DIM


def _routed(fn, gluon: bool):
    """fn with the Gluon kernels allowed or held back, its route and launches decided afresh."""

    def run():
        config.HOPPER_MIN_HEAD_DIM = GLUON_MIN if gluon else 1 << 30
        route._ROUTES.clear()
        triton_backend._PLANS.clear()
        try:
            return fn()
        finally:
            config.HOPPER_MIN_HEAD_DIM = GLUON_MIN

    return run


def calls(batch, n, heads, head_dim, causal, backward):
    torch.manual_seed(0)
    shape = (batch, n, heads, head_dim)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=backward) for _ in range(4))
    qt, kt, vt, dout_t = (x.detach().transpose(1, 2).contiguous().requires_grad_(backward) for x in (q, k, v, dout))

    def ours():
        out = flashtriton.flash_attn_func(q, k, v, causal=causal)
        return torch.autograd.grad(out, (q, k, v), dout) if backward else out

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        return torch.autograd.grad(out, (qt, kt, vt), dout_t) if backward else out

    return {"gluon": _routed(ours, True), "portable": _routed(ours, False), "cudnn": cudnn}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="head_dims.json")
    args = parser.parse_args()
    rows = []
    for batch, n, heads, head_dim, causal in CASES:
        for mode in ("fwd", "fwd_bwd"):
            runs = calls(batch, n, heads, head_dim, causal, mode == "fwd_bwd")
            for fn in runs.values():
                fn()
            ms = in_turn(runs, args.rounds, passes_for(runs, 100, flush=True), flush=True)
            row = dict(batch=batch, seqlen=n, heads=heads, head_dim=head_dim, causal=causal, mode=mode)
            row.update({name: statistics.median(times) for name, times in ms.items()})
            rows.append(row)
            print(f"B{batch} N{n} H{heads} D{head_dim} {'causal' if causal else 'dense':6s} {mode:7s} "
                  f"gluon {row['gluon']:.3f} portable {row['portable']:.3f} cudnn {row['cudnn']:.3f} ms | "
                  f"cudnn/gluon {row['cudnn'] / row['gluon']:.3f} portable/gluon {row['portable'] / row['gluon']:.3f}",
                  flush=True)  # fmt: skip
    with open(args.out, "w") as f:
        json.dump({"environment": environment(), "rows": rows}, f, indent=1)  # GPU, driver, versions, commit


if __name__ == "__main__":
    main()
