"""Training-forward A/B by CUDA-graph replay (benchmarks/ab.py): scratch/ab's flashtriton_base (HEAD: the LSE's
log2 by libdevice) against the working tree (lg2.approx), both writing the LSE, and the working tree without the
LSE as the floor; SDPA's cuDNN in the same process. Outputs bitwise against base's, the LSEs' max difference.
Writes $OUT/lg2_ab.json after every case."""

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

from flashtriton import triton_backend as tb
from flashtriton.params import NO_BOUND, AttentionParams

base_tb = importlib.import_module("flashtriton_base.triton_backend")
base_params = importlib.import_module("flashtriton_base.params")
CASES = [
    (64, 16384, True),
    (128, 512, True),
    (64, 1024, True),
    (256, 512, True),
    (128, 16384, True),
    (64, 1024, False),
    (128, 4096, False),
    (256, 4096, False),
    (256, 16384, True),
    (64, 4096, False),
]
out_path = os.path.join(os.environ.get("OUT", "."), "lg2_ab.json")
results = []
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
        "base": capture(lambda q=q, k=k, v=v, bp=bp: base_tb.forward(q, k, v, bp, with_lse=True)),
        "approx": capture(lambda q=q, k=k, v=v, p=p: tb.forward(q, k, v, p, with_lse=True)),
        "nolse": capture(lambda q=q, k=k, v=v, p=p: tb.forward(q, k, v, p, with_lse=False)),
        "cudnn": capture(cudnn),
    }
    for g, _ in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    (o0, l0), (o1, l1) = graphs["base"][1][:2], graphs["approx"][1][:2]
    same = bool(torch.equal(o0, o1)) and bool(torch.equal(o0, graphs["nolse"][1][0]))
    lse_diff = (l0 - l1).abs().max().item()
    times = rotated({x: g for x, (g, _) in graphs.items()})
    quart = {x: quartiles(t) for x, t in times.items()}
    row = {
        "case": f"d{d} {'causal ' if causal else ''}{n}",
        "ms_q1_med_q3": quart,
        "outputs_bitwise": same,
        "lse_max_abs_diff": lse_diff,
        "seconds": time.time() - start,
    }
    results.append(row)
    with open(out_path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": results}, f, indent=1)
    med = {x: v[1] for x, v in quart.items()}
    print(
        f"{row['case']:<16}"
        + " ".join(f"{x} {med[x]:.4f}" for x in med)
        + f" | approx/base {med['approx'] / med['base']:.4f} nolse/base {med['nolse'] / med['base']:.4f}"
        + f" same {same} dlse {lse_diff:.2g} {row['seconds']:.0f}s",
        flush=True,
    )
    del graphs
