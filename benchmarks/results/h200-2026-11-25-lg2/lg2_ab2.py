"""lg2.approx again (NOTES 76's D=64 1k outlier), at d52bbcd's configs: base (scratch/ab's copy of HEAD, captured
twice: the noise floor) against the tree with lg2_approx.patch applied, both writing the LSE, and the tree without
the LSE. Writes $OUT/lg2_ab2.json after every case."""

import importlib
import os
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from ab import capture, cudnn, paper_case, quartiles, rotated, save

from flashtriton import triton_backend as tb

base_tb = importlib.import_module("flashtriton_base.triton_backend")
base_params = importlib.import_module("flashtriton_base.params")
CASES = [(64, 512, False), (64, 1024, False), (64, 2048, False), (64, 4096, False), (64, 16384, False),
         (64, 1024, True), (64, 16384, True), (128, 1024, False), (128, 4096, False), (256, 4096, False)]  # fmt: skip
out_path = os.path.join(os.environ.get("OUT", "."), "lg2_ab2.json")
results = []
for d, n, causal in CASES:
    start = time.time()
    (q, k, v), p = paper_case(d, n, causal)
    bp = base_params.AttentionParams(d**-0.5, window_right=0 if causal else base_params.NO_BOUND)
    graphs = {
        "base": capture(lambda q=q, k=k, v=v, bp=bp: base_tb.forward(q, k, v, bp, with_lse=True)),
        "base_again": capture(lambda q=q, k=k, v=v, bp=bp: base_tb.forward(q, k, v, bp, with_lse=True)),
        "approx": capture(lambda q=q, k=k, v=v, p=p: tb.forward(q, k, v, p, with_lse=True)),
        "nolse": capture(lambda q=q, k=k, v=v, p=p: tb.forward(q, k, v, p, with_lse=False)),
        "cudnn": capture(cudnn(q, k, v, causal)),
    }
    for g, _ in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    (o0, l0), (o1, l1) = graphs["base"][1][:2], graphs["approx"][1][:2]
    same = bool(torch.equal(o0, o1)) and bool(torch.equal(o0, graphs["nolse"][1][0]))
    lse_diff = (l0 - l1).abs().max().item()
    quart = {x: quartiles(t) for x, t in rotated({x: g for x, (g, _) in graphs.items()}).items()}
    row = {"case": f"d{d} {'causal ' if causal else ''}{n}", "ms_q1_med_q3": quart, "outputs_bitwise": same,
           "lse_max_abs_diff": lse_diff, "seconds": time.time() - start}  # fmt: skip
    results.append(row)
    save(out_path, results)
    med = {x: t[1] for x, t in quart.items()}
    print(f"{row['case']:<16}" + " ".join(f"{x} {med[x]:.4f}" for x in med)
          + f" | approx/base {med['approx'] / med['base']:.4f} again/base {med['base_again'] / med['base']:.4f}"
          + f" nolse/base {med['nolse'] / med['base']:.4f} same {same} dlse {lse_diff:.2g}", flush=True)  # fmt: skip
    del graphs
