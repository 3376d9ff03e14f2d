"""What a dense Gluon forward loses per FLOP at a length that ends inside a tile, against its whole-tile neighbour:
the descriptors' rank (rank-4 against the flat view that whole-tile batches take), the RAGGED variant's masks (forced
on a whole-tile length), and the rest (the ragged length itself, at the same tile count).

    PYTHONPATH=src python benchmarks/ragged_probe.py      # on a Hopper GPU; writes $OUT/ragged_probe.json (or ./)

Each variant's forward launch (writing the LSE, as a training call's) is built once through the launcher, with
triton_backend._flat or route.whole_sequences patched where the variant says, and replayed as a bare Bound; device
time by the decode suite's timer (events around each call, L2 flushed by a read, a spin ahead), the variants in turn,
5 rounds. Prints us, TFLOP/s and TFLOP/s over the whole-tile length's (the second row of each group).
"""

import json
import os
import statistics
from contextlib import contextmanager

import torch

from flashtriton import interface, route, triton_backend
from flashtriton.bench.timing import device_timer
from flashtriton.launch import Recorder

HEADS = 16
# (head dim, batch, [(length, variant)]): B * N about 16k tokens
GROUPS = [
    (128, 4, [(4000, {}), (4096, {}), (4096, dict(flat=False)), (4096, dict(flat=False, ragged=True)), (3968, {})]),
    (64, 4, [(4000, {}), (4096, {}), (4096, dict(flat=False)), (4096, dict(flat=False, ragged=True))]),
    (256, 4, [(4000, {}), (4096, {}), (4096, dict(flat=False)), (4096, dict(flat=False, ragged=True))]),
    (128, 16, [(1000, {}), (1024, {}), (1024, dict(flat=False)), (1024, dict(flat=False, ragged=True))]),
    (128, 2, [(8000, {}), (8192, {}), (8192, dict(flat=False)), (8192, dict(flat=False, ragged=True))]),
]


@contextmanager
def patched(flat: bool | None = None, ragged: bool | None = None):
    """flat=False: rank-4 descriptors; ragged=True: the RAGGED kernel variant, whatever the length."""
    flat0, whole0 = triton_backend._flat, route.whole_sequences
    if flat is False:
        triton_backend._flat = lambda common, *xs: False
    if ragged:
        route.whole_sequences = lambda p, n, tile: False
    try:
        yield
    finally:
        triton_backend._flat, route.whole_sequences = flat0, whole0


def build(head_dim: int, batch: int, n: int, **variant):
    """(a call replaying the variant's forward launch, its FLOPs, its max error against SDPA on fp32 copies)."""
    q, k, v = (torch.randn(batch, n, HEADS, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    p = interface._params(q, k, v, None, False, (-1, -1), 0.0, None, 0.0, False, True, batch)
    r = route.forward(q, k, v, p)
    assert r.family == route.HOPPER, r
    out = torch.empty_like(q)
    lse = torch.empty(batch, HEADS, n, device="cuda", dtype=torch.float32)
    with patched(**variant):
        bound, tensors = triton_backend._hopper_forward(q, k, v, out, lse, p, r.config, Recorder(q=q, k=k, v=v))
    assert bound is not None, "no Bound: a launch hook, or another Triton than the tested one"
    bound(tensors)
    ref = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2).float() for x in (q, k, v)))
    error = (out.float() - ref.transpose(1, 2)).abs().max().item()
    return (lambda: bound(tensors)), 4 * batch * HEADS * n * n * head_dim, error


def main() -> None:
    timer = device_timer(torch.device("cuda"), ahead=True)
    rows = []
    for head_dim, batch, variants in GROUPS:
        built = [(n, variant, *build(head_dim, batch, n, **variant)) for n, variant in variants]
        times = [[] for _ in built]
        for _ in range(5):
            for i, ms in enumerate(timer([call for _, _, call, _, _ in built])):
                times[i].append(ms)
        group = []
        for (n, variant, _, flops, error), ms_rounds in zip(built, times, strict=True):
            ms = statistics.median(ms_rounds)
            group.append(dict(head_dim=head_dim, batch=batch, n=n, variant=variant, ms=ms, tflops=flops / ms / 1e9,
                              max_error=error, ms_rounds=ms_rounds))  # fmt: skip
        whole = group[1]["tflops"]
        for row in group:
            row["over_whole"] = row["tflops"] / whole
            name = f"D{head_dim} B{batch} N{row['n']} {row['variant']!s:34s}"
            print(f"{name} {row['ms'] * 1e3:8.1f} us {row['tflops']:6.1f} TFLOP/s  x whole {row['over_whole']:.3f}  "
                  f"err {row['max_error']:.1e}")  # fmt: skip
        rows += group
    with open(os.path.join(os.environ.get("OUT", "."), "ragged_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
