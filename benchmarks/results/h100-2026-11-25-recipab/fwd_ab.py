"""A/B of the Gluon forward: packages flashtriton_old (HEAD), flashtriton_v1 (epilogue by reciprocal) and the
working tree (v1 + Q a tile ahead), with SDPA's cuDNN in the same process. Each variant's forward captured as a CUDA
graph of REPS calls; one replay of each variant in turn (rotated), events around each; median ms per call."""

import json
import os
import statistics

import flashtriton_old.triton_backend as old_tb
import flashtriton_v1.triton_backend as v1_tb
import torch
import torch.nn.functional as F
from flashtriton_old.params import AttentionParams as OldP
from flashtriton_v1.params import AttentionParams as V1P
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtriton import triton_backend as new_tb
from flashtriton.params import NO_BOUND, AttentionParams

CASES = [
    (128, 512, True),
    (64, 512, True),
    (256, 512, True),
    (128, 1024, True),
    (128, 512, False),
    (64, 4096, True),
    (128, 16384, True),
    (64, 16384, False),
]
REPS = 10
out_path = os.path.join(os.environ.get("OUT", "."), "fwd_ab.json")
results = []


def graph(fn):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            res = fn()
    return g, res


for d, n, causal in CASES:
    b, h = 16384 // n, 2048 // d
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    wr = 0 if causal else NO_BOUND
    qkv, scale = (q, k, v), d**-0.5
    fns = {
        "old": lambda qkv=qkv, s=scale, wr=wr: old_tb.forward(*qkv, OldP(s, window_right=wr))[0],
        "v1": lambda qkv=qkv, s=scale, wr=wr: v1_tb.forward(*qkv, V1P(s, window_right=wr))[0],
        "v7": lambda qkv=qkv, s=scale, wr=wr: new_tb.forward(*qkv, AttentionParams(s, window_right=wr))[0],
    }

    def cudnn(qkv=(qt, kt, vt), causal=causal):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(*qkv, is_causal=causal)

    fns["cudnn"] = cudnn
    graphs = {name: graph(fn) for name, fn in fns.items()}
    for g, _ in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    o_old, o_v1, o_v7 = (graphs[x][1] for x in ("old", "v1", "v7"))
    check = {
        "v7_eq_v1": bool(torch.equal(o_v1, o_v7)),
        "v1_vs_old": (o_v1.float() - o_old.float()).abs().max().item(),
        "cudnn_vs_old": (graphs["cudnn"][1].transpose(1, 2).float() - o_old.float()).abs().max().item(),
    }
    names = list(graphs)
    times = {x: [] for x in names}
    pending = []
    for i in range(40):
        order = names[i % len(names) :] + names[: i % len(names)]
        for x in order:
            s_, e_ = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s_.record()
            graphs[x][0].replay()
            e_.record()
            pending.append((x, s_, e_))
        if i % 8 == 7:
            torch.cuda.synchronize()
            for x, s_, e_ in pending:
                times[x].append(s_.elapsed_time(e_) / REPS)
            pending = []
    med = {x: statistics.median(t) for x, t in times.items()}
    q1 = {x: sorted(t)[len(t) // 4] for x, t in times.items()}
    q3 = {x: sorted(t)[3 * len(t) // 4] for x, t in times.items()}
    row = {"case": f"d{d} {'causal ' if causal else ''}{n}", "median": med, "q1": q1, "q3": q3, **check}
    results.append(row)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)
    ratios = " ".join(f"{x} {med['cudnn'] / med[x]:.3f}" for x in ("old", "v1", "v7"))
    print(row["case"], " ".join(f"{x} {med[x]:.4f}" for x in names), f"| x cuDNN {ratios}", check, flush=True)
    del graphs
