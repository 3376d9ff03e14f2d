"""A/B of the fused backward's dQ sums (NOTES 68): eb5c248's row-major sums (``old``, imported as the package
``flashtriton_old``: that commit's src/flashtriton renamed, with its custom ops' namespace renamed too) against
fragment order with rows of 256 (``f256``) and of 32 fp32 values (``f32``, 128-byte swizzle) from this checkout.

Whole ``triton_backend.backward`` by CUDA-graph replay, one replay of each variant in turn (rotated), 15-60 of each,
with events around every replay, so that all variants share the card's clock state; medians. dK and dV are checked
bitwise against old, dQ by its largest difference relative to its largest value (its sums run in another order).
This is run 3's form; runs 1 and 2 timed blocks of about 300 ms per variant in rotated rounds (the README says why
that changed)."""

import json
import os
import statistics

import flashtriton_old.triton_backend as old_tb
import torch
from flashtriton_old.params import AttentionParams as OldParams

from flashtriton import triton_backend as new_tb
from flashtriton.kernels import config
from flashtriton.params import NO_BOUND, AttentionParams

# (name, D, N, heads, K/V heads, causal); batch x N = 16k tokens
CASES = [
    ("d128 causal 16k", 128, 16384, 16, 16, True),
    ("d128 causal 4k", 128, 4096, 16, 16, True),
    ("d128 dense 2k", 128, 2048, 16, 16, False),
    ("d128 dense 16k", 128, 16384, 16, 16, False),
    ("d64 causal 16k", 64, 16384, 32, 32, True),
    ("d64 causal 2k", 64, 2048, 32, 32, True),
    ("d64 dense 4k", 64, 4096, 32, 32, False),
]
VARIANTS = {
    "old": (old_tb, OldParams, None),
    "f256": (new_tb, AttentionParams, 256),
    "f32": (new_tb, AttentionParams, 32),
}


def inputs(d, n, h, hk, causal):
    """The backward's arguments but the params: (dO, dLSE, Q, K, V, O, LSE)."""
    torch.manual_seed(0)
    q, do = (torch.randn(16384 // n, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(16384 // n, n, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = new_tb.forward(q, k, v, AttentionParams(d**-0.5, window_right=0 if causal else NO_BOUND))
    return do, torch.zeros_like(lse), q, k, v, out, lse


def captured(variant, args, d, causal):
    """(CUDA graph of one backward, its (dQ, dK, dV))."""
    tb, params, cols = VARIANTS[variant]
    if cols:
        config.DQ_FRAGMENT_COLS = cols
        tb._PLANS.clear()
    p = params(d**-0.5, window_right=0 if causal else NO_BOUND)
    for _ in range(2):
        tb.backward(*args, p)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = tb.backward(*args, p)
    return graph, grads


def interleaved(graphs):
    """ms of each graph's replays, taken one replay of each in turn."""
    names = list(graphs)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graphs["old"].replay()
    end.record()
    torch.cuda.synchronize()
    iters = max(15, min(60, int(3000 / (start.elapsed_time(end) * len(names)))))
    events = []
    for i in range(iters):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[name].replay()
            end.record()
            events.append((name, start, end))
    torch.cuda.synchronize()
    times = {name: [] for name in names}
    for name, start, end in events:
        times[name].append(start.elapsed_time(end))
    return times


results = []
for case, d, n, h, hk, causal in CASES:
    args = inputs(d, n, h, hk, causal)
    made = {name: captured(name, args, d, causal) for name in VARIANTS}
    dq0, dk0, dv0 = made["old"][1]
    new = [made[name][1] for name in ("f256", "f32")]
    same = all(torch.equal(dk0, dk) and torch.equal(dv0, dv) for _, dk, dv in new)
    finite = all(bool(torch.isfinite(dq).all()) for dq, _, _ in new)
    rel = max(((dq0.float() - dq.float()).abs().max() / dq0.float().abs().max()).item() for dq, _, _ in new)
    times = interleaved({name: graph for name, (graph, _) in made.items()})
    row = dict(case=case, dkdv_bitwise=same, dq_finite=finite, dq_rel=rel, rounds=times)
    row.update({name: statistics.median(t) for name, t in times.items()})
    results.append(row)
    print(
        f"{case:18s} old {row['old']:.4f} f256 {row['f256']:.4f} f32 {row['f32']:.4f} "
        f"old/f256 {row['old'] / row['f256']:.3f} old/f32 {row['old'] / row['f32']:.3f} "
        f"dkdv_same={same} finite={finite} dq_rel={rel:.1e}",
        flush=True,
    )
    del made, args
    torch.cuda.empty_cache()
with open(os.environ.get("OUT", ".") + "/frag_ab.json", "w") as f:
    json.dump(results, f, indent=1)
