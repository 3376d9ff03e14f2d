"""Users' shapes, this tree against a base build and cuDNN SDPA, call for call on one GPU.

    python benchmarks/ab_sweep.py prepare BASE_COMMIT          # on any machine: writes ab-base/flashtriton_base
    PYTHONPATH=src:ab-base python benchmarks/users_ab.py --out users_ab.json

Cases (bf16): a model's (B, H, N, D) storage seen as (B, N, H, D) beside contiguous inputs (GQA 16/4, D=128,
causal), lengths that end inside a tile beside their whole-tile neighbours (B * N about 16k tokens, H * D = 2048),
and a few paper-sweep shapes for the no-regression check. Each case-mode times head, base and cuDNN SDPA (given
contiguous (B, H, N, D)) as eager calls after an L2 flush, in turn (benchmarks/ab.py), fwd (an inference call) and
fwd_bwd (fresh gradients by torch.autograd.grad). Prints ms and the ratios cuDNN / head and head / base.
"""

from __future__ import annotations

import argparse
import statistics

import flashtriton_base
import torch
import torch.nn.functional as F
from ab import in_turn, passes_for, save
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtriton

# (name, batch, seqlen, heads, heads_k, head_dim, causal, model layout)
CASES = [
    ("gqa model b1 n8192", 1, 8192, 16, 4, 128, True, True),
    ("gqa contiguous b1 n8192", 1, 8192, 16, 4, 128, True, False),
    ("gqa model b4 n2048", 4, 2048, 16, 4, 128, True, True),
    ("gqa contiguous b4 n2048", 4, 2048, 16, 4, 128, True, False),
    ("d128 dense n1000", 16, 1000, 16, 16, 128, False, False),
    ("d128 dense n1024", 16, 1024, 16, 16, 128, False, False),
    ("d128 causal n4000", 4, 4000, 16, 16, 128, True, False),
    ("d128 causal n4096", 4, 4096, 16, 16, 128, True, False),
    ("d64 causal n3000", 5, 3000, 32, 32, 64, True, False),
    ("d64 causal n3072", 5, 3072, 32, 32, 64, True, False),
    ("d256 causal n1000", 16, 1000, 8, 8, 256, True, False),
    ("d128 dense n8000", 2, 8000, 16, 16, 128, False, False),
    ("d64 dense n4000", 4, 4000, 32, 32, 64, False, False),
    ("d256 dense n4000", 4, 4000, 8, 8, 256, False, False),
    ("d128 causal n2048", 8, 2048, 16, 16, 128, True, False),
    ("d64 dense n4096", 4, 4096, 32, 32, 64, False, False),
    ("d256 causal n1024", 16, 1024, 8, 8, 256, True, False),
    ("d128 dense n2048", 8, 2048, 16, 16, 128, False, False),
    ("d128 causal n512", 32, 512, 16, 16, 128, True, False),
    ("d64 causal n1024", 16, 1024, 32, 32, 64, True, False),
    ("d64 causal n8192", 2, 8192, 32, 32, 64, True, False),
    ("d256 dense n4096", 4, 4096, 8, 8, 256, False, False),
    ("d128 causal n16384", 1, 16384, 16, 16, 128, True, False),
]


def inputs(batch, n, heads, heads_k, head_dim, model):
    torch.manual_seed(0)

    def make(h):
        shape = (batch, h, n, head_dim) if model else (batch, n, h, head_dim)
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        return x, (x.transpose(1, 2) if model else x)

    return [make(h) for h in (heads, heads_k, heads_k)]


def calls(case, mode):
    _, batch, n, heads, heads_k, head_dim, causal, model = case
    made = inputs(batch, n, heads, heads_k, head_dim, model)
    leaves = [leaf for leaf, _ in made]
    q, k, v = (view for _, view in made)
    # SDPA's best ordinary setup: contiguous (B, H, N, D)
    qs, ks, vs = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(q)
    dout_s = dout.transpose(1, 2).contiguous()

    def ours(module):
        def fwd():
            with torch.no_grad():
                return module.flash_attn_func(q, k, v, causal=causal)

        def fwd_bwd():
            out = module.flash_attn_func(q, k, v, causal=causal)
            return torch.autograd.grad(out, leaves, dout)

        return fwd if mode == "fwd" else fwd_bwd

    def sdpa():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            if mode == "fwd":
                with torch.no_grad():
                    return F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=heads != heads_k)
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=heads != heads_k)
            return torch.autograd.grad(out, (qs, ks, vs), dout_s)

    return {"head": ours(flashtriton), "base": ours(flashtriton_base), "cudnn": sdpa}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="users_ab.json")
    parser.add_argument("--cases", nargs="*", help="names to run (default: all)")
    args = parser.parse_args()
    rows = []
    for case in CASES:
        if args.cases and case[0] not in args.cases:
            continue
        for mode in ("fwd", "fwd_bwd"):
            runs = calls(case, mode)
            times = in_turn(runs, args.rounds, passes_for(runs, 100, flush=True), flush=True)
            ms = {name: statistics.median(t) for name, t in times.items()}
            rows.append(dict(case=case[0], mode=mode, ms=ms, cudnn_over_head=ms["cudnn"] / ms["head"],
                             head_over_base=ms["head"] / ms["base"]))  # fmt: skip
            save(args.out, rows)
            del runs
            torch.cuda.empty_cache()
    heads = ("head ms", "base ms", "cudnn ms", "cudnn/head", "head/base")
    print(f"{'case':26s} {'mode':8s} " + " ".join(f"{h:>10s}" for h in heads))
    for r in rows:
        ms = r["ms"]
        print(f"{r['case']:26s} {r['mode']:8s} {ms['head']:10.3f} {ms['base']:10.3f} {ms['cudnn']:10.3f} "
              f"{r['cudnn_over_head']:10.2f} {r['head_over_base']:10.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
