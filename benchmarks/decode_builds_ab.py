"""flash_attn_with_kvcache of two builds in one process, the working tree (src) against a base commit
(ab-base/flashtriton_base), their calls in turn, cuDNN SDPA beside for seqlen_q 1; 32/8 heads, bf16, caches of
random rows (contiguous, or as pages in a shuffled block table). Two timings:

  eager  CUDA events around one call after a 256 MB read (L2 flushed) and a spin that keeps the GPU ahead of the
         host: the decode suite's device time (seqlen_q 1)
  graph  CUDA-graph replays of eight calls back to back (input copies in turn past L2; decode_tune.graph_us),
         seqlen_q 1 and 4 (causal): what a captured decode loop runs

Each build's first output is compared with the other's bitwise.

    python benchmarks/ab_sweep.py prepare BASE_COMMIT      # writes ab-base/flashtriton_base
    PYTHONPATH=src:ab-base python benchmarks/decode_builds_ab.py --out decode_builds_ab.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics

import flashtriton_base
import torch
import torch.nn.functional as F
from decode_tune import graph_us  # (benchmarks/, the script's folder, is on the path)
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtriton
from flashtriton.bench.timing import device_timer

HEADS, HEADS_K = 32, 8
BUILDS = {"base": flashtriton_base, "head": flashtriton}


def _cudnn(q, k, v, causal=False):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def cell(d: int, batch: int, length: int, page: int, n_q: int, mode: str, rounds: int) -> dict:
    nbytes = 2 * batch * length * HEADS_K * d * 2
    copies = 1 if mode == "eager" else max(1, min(8, math.ceil(300e6 / nbytes)))
    caches = [[torch.randn(batch, length, HEADS_K, d, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
              for _ in range(copies)]  # fmt: skip
    seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    table = torch.randperm(batch * length // page, device="cuda").int().view(batch, -1) if page else None
    paged = [[x.view(-1, page, HEADS_K, d) for x in c] if page else c for c in caches]
    q = torch.randn(batch, n_q, HEADS, d, dtype=torch.bfloat16, device="cuda")
    calls = {
        name: lambda i=0, lib=lib: lib.flash_attn_with_kvcache(
            q, *paged[i], cache_seqlens=seqlens, block_table=table, causal=n_q > 1
        )
        for name, lib in BUILDS.items()
    }
    equal = torch.equal(calls["base"](), calls["head"]())
    if n_q == 1:
        qt = q.transpose(1, 2).contiguous()
        dense = [[x.transpose(1, 2).contiguous() for x in c] for c in caches]
        calls["cudnn"] = lambda i=0: _cudnn(qt, *dense[i])
    us: dict[str, list[float]] = {name: [] for name in calls}
    eager = device_timer(torch.device("cuda"), ahead=True)  # the decode suite's timer
    for r in range(rounds):
        order = list(calls) if r % 2 == 0 else list(calls)[::-1]
        times = [ms * 1e3 for ms in eager([calls[name] for name in order])] if mode == "eager" else None
        for j, name in enumerate(order):
            us[name].append(times[j] if times else graph_us(calls[name], copies))
    median = {name: statistics.median(t) for name, t in us.items()}
    return dict(mode=mode, head_dim=d, batch=batch, length=length, page=page, seqlen_q=n_q, us=median,
                head_over_base=median["head"] / median["base"], bitwise_equal=equal)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 32768])
    parser.add_argument("--pages", type=int, nargs="+", default=[0, 16], help="0: a contiguous cache")
    parser.add_argument("--modes", nargs="+", default=["eager", "graph"], choices=["eager", "graph"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="decode_builds_ab.json")
    args = parser.parse_args()
    rows = []
    for mode, d, batch, length, page in itertools.product(
        args.modes, args.head_dims, args.batches, args.lengths, args.pages
    ):
        for n_q in (1,) if mode == "eager" else (1, 4):
            row = cell(d, batch, length, page, n_q, mode, args.rounds)
            rows.append(row)
            us = row["us"]
            cudnn = f" cudnn {us['cudnn']:.2f}" if "cudnn" in us else ""
            equal = "" if row["bitwise_equal"] else " NOT EQUAL"
            name = f"{mode} D{d} B{batch} L{length} pages {page} q{n_q}"
            print(f"{name}: base {us['base']:.2f} head {us['head']:.2f} ({row['head_over_base']:.3f}){cudnn}{equal}")
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
