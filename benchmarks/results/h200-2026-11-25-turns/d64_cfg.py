"""D=64 forward configs by CUDA-graph replay (benchmarks/ab.py), no LSE as the bench's inference call, SDPA's
cuDNN in the same process; outputs bitwise against the table's config. Writes $OUT/d64_cfg.json after every case."""

import json
import os
import sys
import time
from dataclasses import astuple, replace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, "benchmarks")
from ab import capture, quartiles, rotated

from flashtriton import triton_backend as tb
from flashtriton.kernels import config
from flashtriton.params import NO_BOUND, AttentionParams

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


CASES = [
    (512, False),
    (1024, False),
    (2048, False),
    (4096, False),
    (8192, False),
    (16384, False),
    (4096, True),
    (8192, True),
    (16384, True),
]
for n, causal in CASES:
    start = time.time()
    b, h, d = 16384 // n, 32, 64
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    p = AttentionParams(d**-0.5, window_right=0 if causal else NO_BOUND)
    chosen = table("sm90", d, torch.bfloat16, banded=causal, span=n)
    configs = variants(chosen)
    graphs = {}
    for name, cfg in configs.items():
        config.hopper_forward_config = lambda *a, cfg=cfg, **kw: cfg
        tb._PLANS.clear()
        graphs[name] = capture(lambda q=q, k=k, v=v, p=p: tb.forward(q, k, v, p, with_lse=False)[0])
    config.hopper_forward_config = table

    def cudnn(qt=qt, kt=kt, vt=vt, causal=causal):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    graphs["cudnn"] = capture(cudnn)
    same = {x: bool(torch.equal(g[1], graphs["table"][1])) for x, g in graphs.items() if x != "cudnn"}
    quart = {x: quartiles(t) for x, t in rotated({x: g for x, (g, _) in graphs.items()}).items()}
    row = {
        "case": f"d{d} {'causal ' if causal else ''}{n}",
        "configs": {x: astuple(c) for x, c in configs.items()},
        "ms_q1_med_q3": quart,
        "bitwise_as_table": same,
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
    print(
        row["case"],
        " ".join(f"{x} {med[x]:.4f} ({med['cudnn'] / med[x]:.3f})" for x in med),
        "all bitwise" if all(same.values()) else same,
        f"{row['seconds']:.0f}s",
        flush=True,
    )
    del graphs
