"""Training-forward A/B by CUDA-graph replay (benchmarks/ab.py): scratch/ab's flashtriton_base (HEAD: the LSE's
log2 by libdevice) against the working tree (lg2.approx, lg2_approx.patch), both writing the LSE, and the working
tree without the LSE as the floor; SDPA's cuDNN in the same process. Outputs bitwise against base's, the LSEs' max
difference. Writes $OUT/lg2_ab.json after every case.

    python lg2_ab.py            # NOTES 76's first run (at 916c773's configs)
    python lg2_ab.py --second   # its second run (d52bbcd's configs; HEAD captured twice): $OUT/lg2_ab2.json

(The first run's script was written before ab.paper_case, ab.cudnn and ab.save existed and folded onto them after,
the second run's on its own and folded in here after: the same inputs and calls.)"""

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
SECOND = "--second" in sys.argv
if SECOND:
    CASES = [
        (64, 512, False),
        (64, 1024, False),
        (64, 2048, False),
        (64, 4096, False),
        (64, 16384, False),
        (64, 1024, True),
        (64, 16384, True),
        (128, 1024, False),
        (128, 4096, False),
        (256, 4096, False),
    ]
else:
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
out_path = os.path.join(os.environ.get("OUT", "."), "lg2_ab2.json" if SECOND else "lg2_ab.json")
results = []
for d, n, causal in CASES:
    start = time.time()
    (q, k, v), p = paper_case(d, n, causal)
    bp = base_params.AttentionParams(d**-0.5, window_right=0 if causal else base_params.NO_BOUND)

    def base(q=q, k=k, v=v, bp=bp):
        return base_tb.forward(q, k, v, bp, with_lse=True)

    graphs = {"base": capture(base)}
    if SECOND:
        graphs["base_again"] = capture(base)
    graphs |= {
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
          + f" | approx/base {med['approx'] / med['base']:.4f} nolse/base {med['nolse'] / med['base']:.4f}"
          + f" same {same} dlse {lse_diff:.2g} {row['seconds']:.0f}s", flush=True)  # fmt: skip
    del graphs
