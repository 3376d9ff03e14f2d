"""Sweep launch configs of the portable Triton kernels on the local GPU; each candidate is checked against
the reference before it is timed. Prints the best per case and writes every row as JSON.

    PYTHONPATH=src python benchmarks/tune.py --out tune.json [--head-dims 64 128] [--seqlen 8192]

The winners go into src/flashtriton/kernels/config.py by hand, with the numbers in benchmarks/DECISIONS.md.
A case that the portable kernels do not serve (on Hopper, the Gluon kernels' head dims) is reported and skipped:
every candidate would time the same kernel. FLASHTRITON_AUTOTUNE=1 tunes the forward at run time instead.
"""

from __future__ import annotations

import argparse
import itertools
import json
from unittest import mock

import torch
import triton

from flashtriton import flash_attn_func
from flashtriton.kernels import config
from flashtriton.reference import attention_reference

FWD_CANDIDATES = [
    config.ForwardConfig(bm, bn, w, s, e)
    for bm, bn, w, s, e in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3), (None, 1, 2))
]
BWD_CANDIDATES = [
    config.BackwardConfig(mkv, nkv, mq, nq, w, s_kv, s_q)
    for (mkv, nkv, mq, nq), w, s_kv, s_q in itertools.product(
        ((32, 128, 128, 32), (64, 128, 128, 64), (32, 64, 64, 32), (64, 64, 64, 64), (16, 128, 128, 16)),
        (4, 8),
        (1, 2, 3),
        (2, 3),
    )
]


def _inputs(batch, seqlen, heads, head_dim, dtype):
    return [
        torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)
    ]


def _error(q, k, v, causal, mode):
    small = [x[:1, :1024].detach().clone().requires_grad_() for x in (q, k, v)]
    out = flash_attn_func(*small, causal=causal)
    ref, _ = attention_reference(*(x.detach().double().requires_grad_() for x in small), causal=causal)
    if mode == "fwd":
        return (out.double() - ref).abs().max().item()
    do = torch.randn_like(out)
    out.backward(do)
    ref_inputs = [x.detach().double().requires_grad_() for x in small]
    ref, _ = attention_reference(*ref_inputs, causal=causal)
    ref.backward(do.double())
    return max((a.grad.double() - b.grad).abs().max().item() for a, b in zip(small, ref_inputs, strict=True))


def sweep(head_dim, causal, seqlen, mode, dtype=torch.bfloat16):
    batch, heads = max(1, 16384 // seqlen), 2048 // head_dim
    q, k, v = _inputs(batch, seqlen, heads, head_dim, dtype)
    flops = 4 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0) * (1.0 if mode == "fwd" else 3.5)
    rows = []
    candidates = FWD_CANDIDATES if mode == "fwd" else BWD_CANDIDATES
    target = "forward_config" if mode == "fwd" else "backward_config"
    served = []  # whether the portable kernels asked for a config: on Hopper the Gluon kernels may serve the case
    for cfg in candidates:
        with mock.patch.object(config, target, lambda *a, cfg=cfg, **kw: served.append(True) or cfg):
            try:
                err = _error(q, k, v, causal, mode)
                if not served:
                    return {"head_dim": head_dim, "causal": causal, "seqlen": seqlen, "mode": mode, "rows": [],
                            "best": None, "skipped": "the portable kernels do not serve this case"}  # fmt: skip
                if mode == "fwd":
                    fn = lambda: flash_attn_func(q, k, v, causal=causal)
                else:
                    fn = lambda: flash_attn_func(q, k, v, causal=causal).backward(q)
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            except Exception as exc:  # out of shared memory, register spills that fail to compile, ...
                rows.append({"config": cfg.__dict__, "error": type(exc).__name__})
                continue
        rows.append({"config": cfg.__dict__, "ms": ms, "tflops": flops / ms * 1e-9, "max_err": err})
    ok = [r for r in rows if "ms" in r and r["max_err"] < 0.05]
    best = max(ok, key=lambda r: r["tflops"]) if ok else None
    return {"head_dim": head_dim, "causal": causal, "seqlen": seqlen, "mode": mode, "rows": rows, "best": best}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwd_bwd"])
    parser.add_argument("--out", default="tune.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune.py times kernels on a CUDA GPU, and this machine has none")
    results = []
    for head_dim, causal, mode in itertools.product(args.head_dims, (False, True), args.modes):
        res = sweep(head_dim, causal, args.seqlen, mode)
        results.append(res)
        b = res["best"]
        if "skipped" in res:
            print(f"d={head_dim} causal={causal} {mode}: skipped, {res['skipped']}", flush=True)
            continue
        print(
            f"d={head_dim} causal={causal} {mode}: best {b and b['config']} {b and round(b['tflops'])} TFLOP/s",
            flush=True,
        )
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
