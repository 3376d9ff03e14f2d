"""D=64 forward configs by CUDA-graph replay (benchmarks/ab.py), no LSE as the bench's inference call, SDPA's
cuDNN in the same process; outputs bitwise against the table's config. Writes $OUT/d64_cfg.json after every case.
(Run from scratch as written before ab.paper_case, ab.cudnn and ab.save existed; folded onto them after: the same
inputs and calls.)"""

import os
import sys
import time
from dataclasses import astuple, replace

import torch

sys.path.insert(0, "benchmarks")
from ab import capture, cudnn, paper_case, quartiles, rotated, save

from flashtriton import triton_backend as tb
from flashtriton.kernels import config

table = config.hopper_forward_config
out_path = os.path.join(os.environ.get("OUT", "."), "d64_cfg.json")
results = []


def variants(t):
    """Named configs beside the table's t."""
    wide = replace(t, consumers=3)
    out = {"table": t}
    if t.consumers == 2:
        out |= {"s2": replace(t, stages=2), "s4": replace(t, stages=4), "pp": replace(t, pingpong=True), "wide": wide}
    out |= {
        "wide_pp": replace(wide, pingpong=True),
        "wide_pp_s2": replace(wide, pingpong=True, stages=2),
        "wide_pp_s4": replace(wide, pingpong=True, stages=4),
    }
    return out


CASES = [(512, False), (1024, False), (2048, False), (4096, False), (8192, False), (16384, False),
         (4096, True), (8192, True), (16384, True)]  # fmt: skip
for n, causal in CASES:
    start = time.time()
    (q, k, v), p = paper_case(64, n, causal)
    configs = variants(table("sm90", 64, torch.bfloat16, banded=causal, span=n))
    graphs = {}
    for name, cfg in configs.items():
        config.hopper_forward_config = lambda *a, cfg=cfg, **kw: cfg
        tb._PLANS.clear()
        graphs[name] = capture(lambda q=q, k=k, v=v, p=p: tb.forward(q, k, v, p, with_lse=False)[0])
    config.hopper_forward_config = table
    graphs["cudnn"] = capture(cudnn(q, k, v, causal))
    same = {x: bool(torch.equal(g[1], graphs["table"][1])) for x, g in graphs.items() if x != "cudnn"}
    quart = {x: quartiles(t) for x, t in rotated({x: g for x, (g, _) in graphs.items()}).items()}
    row = {"case": f"d64 {'causal ' if causal else ''}{n}", "configs": {x: astuple(c) for x, c in configs.items()},
           "ms_q1_med_q3": quart, "bitwise_as_table": same, "seconds": time.time() - start}  # fmt: skip
    results.append(row)
    save(out_path, results, fields=list(config.HopperForwardConfig.__dataclass_fields__))
    med = {x: t[1] for x, t in quart.items()}
    print(row["case"], " ".join(f"{x} {med[x]:.4f} ({med['cudnn'] / med[x]:.3f})" for x in med),
          "all bitwise" if all(same.values()) else same, f"{row['seconds']:.0f}s", flush=True)  # fmt: skip
    del graphs
