"""Forward A/B by CUDA-graph replay: the working tree's flashtriton against scratch/ab's package copies named on the
command line (default: flashtriton_cols flashtriton_arrive, from branches wip/table-columns and wip/thread-arrive),
SDPA's cuDNN in the same process. Each variant's forward captured as a graph of REPS calls
one replay of each
variant in turn (rotated), events around each
median ms per call, quartiles
outputs bitwise against main's.
Writes $OUT/next_ab.json after every case, so a cut-short call still leaves its cases."""

import importlib
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

NAMES = ["flashtriton"] + (sys.argv[1:] or ["flashtriton_cols", "flashtriton_arrive"])
PKGS = {x: (importlib.import_module(f"{x}.triton_backend"), importlib.import_module(f"{x}.params")) for x in NAMES}
CASES = [
    (128, 512, True),
    (64, 512, True),
    (256, 512, True),
    (128, 1024, True),
    (128, 512, False),
    (128, 16384, True),
    (64, 16384, False),
    (256, 2048, False),
]
REPS = 10
out_path = os.path.join(os.environ.get("OUT", "."), "next_ab.json")
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
    start = time.time()
    b, h = 16384 // n, 2048 // d
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    fns = {}
    for x, (tb, params) in PKGS.items():
        p = params.AttentionParams(d**-0.5, window_right=0 if causal else params.NO_BOUND)
        fns[x] = lambda tb=tb, p=p, q=q, k=k, v=v: tb.forward(q, k, v, p)[0]

    def cudnn(qt=qt, kt=kt, vt=vt, causal=causal):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    fns["cudnn"] = cudnn
    graphs = {x: graph(fn) for x, fn in fns.items()}
    for g, _ in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    same = {x: bool(torch.equal(graphs[x][1], graphs["flashtriton"][1])) for x in NAMES[1:]}
    names = list(graphs)
    times = {x: [] for x in names}
    pending = []
    for i in range(40):
        for x in names[i % len(names) :] + names[: i % len(names)]:
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
    quart = {x: [sorted(t)[len(t) // 4], statistics.median(t), sorted(t)[3 * len(t) // 4]] for x, t in times.items()}
    row = {
        "case": f"d{d} {'causal ' if causal else ''}{n}",
        "ms_q1_med_q3": quart,
        "bitwise_as_main": same,
        "seconds": time.time() - start,
    }
    results.append(row)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)
    med = {x: v[1] for x, v in quart.items()}
    print(
        f"{row['case']:<18}"
        + " ".join(f"{x.replace('flashtriton', 'ft')} {med[x]:.4f}" for x in names)
        + " | x cuDNN "
        + " ".join(f"{med['cudnn'] / med[x]:.3f}" for x in NAMES)
        + f" {same} {row['seconds']:.0f}s",
        flush=True,
    )
    del graphs
