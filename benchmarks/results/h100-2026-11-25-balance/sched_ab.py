"""Forward A/B by CUDA-graph replay (benchmarks/ab.py): scratch/ab's flashtriton_base (HEAD before this change:
LSE always written, greedy schedule) against the working tree with and without the LSE and with and without
schedule._balance; SDPA's cuDNN (no LSE asked for) in the same process. Outputs bitwise against base's.
Writes $OUT/sched_ab.json after every case."""

import functools
import importlib
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, "benchmarks")
from ab import capture, quartiles, rotated

from flashtriton import schedule
from flashtriton import triton_backend as tb
from flashtriton.params import NO_BOUND, AttentionParams

base_tb = importlib.import_module("flashtriton_base.triton_backend")
base_params = importlib.import_module("flashtriton_base.params")
CASES = [
    (128, 512, True),
    (256, 512, True),
    (64, 512, True),
    (128, 1024, True),
    (256, 1024, True),
    (256, 2048, True),
    (64, 1024, True),
    (64, 16384, True),
    (128, 16384, True),
    (128, 512, False),
]
if len(sys.argv) > 1:  # cases as D:N:causal (0 or 1)
    CASES = [(int(d), int(n), bool(int(c))) for d, n, c in (x.split(":") for x in sys.argv[1:])]
out_path = os.path.join(os.environ.get("OUT", "."), "sched_ab.json")
greedy = functools.partial(schedule.causal_forward, balance=False)
balanced = schedule.causal_forward
keep = []
results = []


def ours(q, k, v, p, with_lse, balance):
    schedule.causal_forward = balanced if balance else greedy
    tb._schedule.cache_clear()
    keep.extend(tb._PLANS.values())  # the graphs hold their tables' addresses
    tb._PLANS.clear()
    return capture(lambda: tb.forward(q, k, v, p, with_lse=with_lse)[0])


for d, n, causal in CASES:
    start = time.time()
    b, h = 16384 // n, 2048 // d
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    p = AttentionParams(d**-0.5, window_right=0 if causal else NO_BOUND)
    bp = base_params.AttentionParams(d**-0.5, window_right=0 if causal else base_params.NO_BOUND)

    def cudnn(qt=qt, kt=kt, vt=vt, causal=causal):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    graphs = {
        "base": capture(lambda q=q, k=k, v=v, bp=bp: base_tb.forward(q, k, v, bp)[0]),
        "nolse": ours(q, k, v, p, False, False),
        "bal": ours(q, k, v, p, True, True),
        "nolse_bal": ours(q, k, v, p, False, True),
        "cudnn": capture(cudnn),
    }
    for g, _ in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    same = {x: bool(torch.equal(graphs[x][1], graphs["base"][1])) for x in ("nolse", "bal", "nolse_bal")}
    err = (graphs["base"][1].float() - graphs["cudnn"][1].transpose(1, 2).float()).abs().max().item()
    times = rotated({x: g for x, (g, _) in graphs.items()})
    quart = {x: quartiles(t) for x, t in times.items()}
    row = {
        "case": f"d{d} {'causal ' if causal else ''}{n}",
        "ms_q1_med_q3": quart,
        "bitwise_as_base": same,
        "max_abs_vs_cudnn": err,
        "seconds": time.time() - start,
    }
    results.append(row)
    with open(out_path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": results}, f, indent=1)
    med = {x: v[1] for x, v in quart.items()}
    print(
        f"{row['case']:<16}"
        + " ".join(f"{x} {med[x]:.4f}" for x in med)
        + " | x cuDNN "
        + " ".join(f"{med['cudnn'] / med[x]:.3f}" for x in med if x != "cudnn")
        + f" {same} err {err:.3g} {row['seconds']:.0f}s",
        flush=True,
    )
    del graphs
