"""D=128 backward below its fused span (config: 2048), and D=64's for comparison: fused (dQ by TMA reductions in the
dK/dV kernel) against the Gluon pair (dQ kernel, then dK/dV), whole backward by CUDA-graph replay (benchmarks/ab.py),
one process. Writes $OUT/bwd128_ab.json after every case. (Run from scratch as written before ab.paper_case and
ab.save existed; folded onto them after: the same inputs and calls.)"""

import functools
import os
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, "benchmarks")
from ab import capture, paper_case, quartiles, rotated, save

from flashtriton import triton_backend as tb
from flashtriton.kernels import config

table = config.hopper_backward_config
out_path = os.path.join(os.environ.get("OUT", "."), "bwd128_ab.json")
CASES = [(128, 512, False), (128, 1024, False), (128, 2048, False), (128, 1024, True), (128, 2048, True),
         (128, 4096, True), (64, 512, False), (64, 1024, True)]  # fmt: skip
results = []
for d, n, causal in CASES:
    start = time.time()
    (q, k, v, dout), p = paper_case(d, n, causal, count=4)
    out, lse = tb.forward(q, k, v, p, with_lse=True)
    dlse = torch.zeros_like(lse)
    graphs = {}
    for name, span in (("fused", 0), ("pair", 1 << 30)):
        config.hopper_backward_config = lambda *a, span=span, **kw: replace(table(*a, **kw), fused_span=span)
        tb._PLANS.clear()
        graphs[name] = capture(functools.partial(tb.backward, dout, dlse, q, k, v, out, lse, p))
    config.hopper_backward_config = table
    for g, _ in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    diff = {x: (a.float() - c.float()).abs().max().item()
            for x, a, c in zip("qkv", graphs["fused"][1], graphs["pair"][1], strict=True)}  # fmt: skip
    quart = {x: quartiles(t) for x, t in rotated({x: g for x, (g, _) in graphs.items()}).items()}
    row = {"case": f"d{d} {'causal ' if causal else ''}{n}", "ms_q1_med_q3": quart, "max_abs_diff": diff,
           "table_fused_span": table("sm90", d, torch.bfloat16).fused_span, "seconds": time.time() - start}  # fmt: skip
    results.append(row)
    save(out_path, results)
    med = {x: t[1] for x, t in quart.items()}
    print(f"{row['case']:<16}", " ".join(f"{x} {med[x]:.4f}" for x in med),
          f"fused/pair {med['fused'] / med['pair']:.3f}", {x: f"{e:.2g}" for x, e in diff.items()},
          f"{row['seconds']:.0f}s", flush=True)  # fmt: skip
    del graphs
