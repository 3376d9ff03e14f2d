"""D=64 dense short forwards (N=512, 1k: NOTES 74's H200 shortfall): the Gluon forward's candidate configs
(config.hopper_forward_candidates) by CUDA-graph replay (benchmarks/ab.py), no LSE as the bench's inference call,
SDPA's cuDNN in the same process; outputs bitwise against the table's config. Writes $OUT/d64_ab.json."""

import json
import os
import sys
import time
from dataclasses import astuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, "benchmarks")
from ab import capture, quartiles, rotated

from flashtriton import triton_backend as tb
from flashtriton.kernels import config
from flashtriton.params import AttentionParams

table = config.hopper_forward_config
out_path = os.path.join(os.environ.get("OUT", "."), "d64_ab.json")
results = []
for n in (512, 1024, 2048):
    start = time.time()
    b, h, d = 16384 // n, 32, 64
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    p = AttentionParams(d**-0.5)
    chosen = table("sm90", d, torch.bfloat16, banded=False, span=n)
    configs = list(dict.fromkeys([chosen, *config.hopper_forward_candidates(d, chosen)]))
    graphs = {}
    for i, cfg in enumerate(configs):
        config.hopper_forward_config = lambda *a, cfg=cfg, **kw: cfg
        tb._PLANS.clear()
        graphs[f"c{i}"] = capture(lambda q=q, k=k, v=v, p=p: tb.forward(q, k, v, p, with_lse=False)[0])
    config.hopper_forward_config = table

    def cudnn(qt=qt, kt=kt, vt=vt):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt)

    graphs["cudnn"] = capture(cudnn)
    same = {x: bool(torch.equal(g[1], graphs["c0"][1])) for x, g in graphs.items() if x != "cudnn"}
    quart = {x: quartiles(t) for x, t in rotated({x: g for x, (g, _) in graphs.items()}).items()}
    row = {
        "case": f"d{d} {n}",
        "configs": {f"c{i}": astuple(c) for i, c in enumerate(configs)},
        "ms_q1_med_q3": quart,
        "bitwise_as_c0": same,
        "seconds": time.time() - start,
    }
    results.append(row)
    with open(out_path, "w") as f:
        json.dump(
            {
                "device": torch.cuda.get_device_name(),
                "fields": list(config.HopperForwardConfig.__dataclass_fields__),
                "rows": results,
            },
            f,
            indent=1,
        )
    med = {x: v[1] for x, v in quart.items()}
    print(row["case"], " ".join(f"{x} {med[x]:.4f} ({med['cudnn'] / med[x]:.3f})" for x in med), same, flush=True)
    del graphs
for i, c in enumerate(configs):
    print(f"c{i}", c)
