"""Where the eager call's extra time goes (NOTES 70's next): ours (main), cols (branch wip/table-columns, package
flashtriton_cols in scratch/ab) and cuDNN's causal N=512 forwards, five ways.
A: CUDA graph of 10 calls, no flush. B: graph of 10 x (flush, call) minus graph of 10 flushes. C: eager, flush before
each call, a synchronize after each (the host on the timed path). D: as C without the flush. E: eager with flush, but
the stream held behind a sleep so the host is never late (host gaps out; bench._cuda_in_turn's way, whose calls are
queued without a synchronize between them). C - E: host gap; E - A: the flush's cost to the kernel."""

import json
import os
import statistics

import torch
import torch.nn.functional as F
from flashtriton_cols import flash_attn_func as cols_func
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtriton import flash_attn_func

out_path = os.path.join(os.environ.get("OUT", "."), "eager_ab.json")
flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
results = []


def med(xs):
    return statistics.median(xs)


def graph_ms(fn, with_flush, reps=10):
    fn()
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            if with_flush:
                flush.zero_()
            fn()
    return g


for d in (128, 64, 256):
    n, b, h = 512, 32, 2048 // d
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def ours(q=q, k=k, v=v):
        return flash_attn_func(q, k, v, causal=True)

    def cols(q=q, k=k, v=v):
        return cols_func(q, k, v, causal=True)

    def cudnn(qt=qt, kt=kt, vt=vt):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    fns = {"ours": ours, "cols": cols, "cudnn": cudnn}
    for f in fns.values():
        for _ in range(3):
            f()
    torch.cuda.synchronize()
    graphs = {("A", x): graph_ms(f, False) for x, f in fns.items()}
    graphs.update({("B", x): graph_ms(f, True) for x, f in fns.items()})
    g_flush = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_flush):
        for _ in range(10):
            flush.zero_()
    graphs[("B", "flush")] = g_flush
    t = {key: [] for key in graphs}
    t.update({(m, x): [] for m in "CDE" for x in fns})
    for i in range(30):
        order = list(graphs) if i % 2 == 0 else list(reversed(graphs))
        for key in order:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graphs[key].replay()
            e.record()
            torch.cuda.synchronize()
            t[key].append(s.elapsed_time(e) / 10)
        names = list(fns) if i % 2 == 0 else list(reversed(fns))
        for x in names:  # C: flush, events, call (host may be late)
            flush.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fns[x]()
            e.record()
            torch.cuda.synchronize()
            t[("C", x)].append(s.elapsed_time(e))
        for x in names:  # D: no flush
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fns[x]()
            e.record()
            torch.cuda.synchronize()
            t[("D", x)].append(s.elapsed_time(e))
        for x in names:  # E: as C behind a sleep, so the whole sequence is queued before the GPU reaches it
            torch.cuda._sleep(2_000_000)
            flush.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fns[x]()
            e.record()
            torch.cuda.synchronize()
            t[("E", x)].append(s.elapsed_time(e))
    row = {"d": d, "ms": {f"{m}:{x}": med(v) for (m, x), v in t.items()}}
    for x in fns:
        row["ms"][f"B:{x}"] -= row["ms"]["B:flush"]
    results.append(row)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)
    ms = row["ms"]
    print(f"d{d} causal 512, flush {ms['B:flush']:.4f}", flush=True)
    for m in "ABCDE":
        print(
            f"  {m}: "
            + "  ".join(f"{x} {ms[m + ':' + x]:.4f}" for x in fns)
            + f"  x cuDNN ours {ms[m + ':cudnn'] / ms[m + ':ours']:.3f} cols {ms[m + ':cudnn'] / ms[m + ':cols']:.3f}",
            flush=True,
        )
