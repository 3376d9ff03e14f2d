"""How fast this GPU reads a decode step's K and V at all: a plain streaming read of the same bytes beside
flash_attn_with_kvcache and cuDNN SDPA (enable_gqa, on (B, H_KV, L, D) copies), timed as the decode suite times them
(calls in turn, L2 flushed by a read, a spin keeping the GPU ahead of the host). The best read's TB/s over a few
configs is what streaming those bytes once reaches on the card: the reference a decode kernel's effective bandwidth
compares with at that size (issue 36: 4.5 TB/s at B8 32k).

    PYTHONPATH=src python benchmarks/read_roofline.py [--out read_roofline.json]

32 query heads on 8 K/V heads, bf16, seqlen_q 1, contiguous caches, the whole cache attended.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtriton
from flashtriton.bench.timing import device_timer

HEADS, HEADS_K = 32, 8
SHAPES = ((8, 4096, 128), (1, 32768, 128), (8, 32768, 64), (8, 32768, 128), (8, 131072, 64), (8, 131072, 128),
          (64, 4096, 128), (64, 32768, 128))  # fmt: skip


@triton.jit
def _read_kernel(x_ptr, sums_ptr, n, steps, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """Grid-stride: at step s program i adds up the UNROLL blocks of BLOCK elements from (s * programs + i) * BLOCK *
    UNROLL, whose loads are independent, so all are in flight at once (one fp32 store: the reads are the traffic)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(steps):
        base = (s * programs + pid).to(tl.int64) * (BLOCK * UNROLL)
        for u in tl.static_range(UNROLL):
            offsets = base + u * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32)
    tl.store(sums_ptr + pid, tl.sum(acc))


def _reads(kv: torch.Tensor, sms: int) -> dict:
    """Streaming reads of all of kv: Triton grid-stride loops (16 bytes per thread per load, 2 or 4 loads in flight,
    4 to 16 programs of 4 or 8 warps per SM), and torch's own sum."""
    flat = kv.view(-1)
    sums = torch.empty(sms * 16, dtype=torch.float32, device=kv.device)
    calls = {"read torch.sum": lambda: flat.sum(dtype=torch.float32)}
    for per_sm, warps, unroll in itertools.product((4, 8, 16), (4, 8), (2, 4)):
        block = warps * 32 * 16 // flat.element_size()
        programs = sms * per_sm
        steps = triton.cdiv(flat.numel(), programs * block * unroll)

        def call(programs=programs, steps=steps, block=block, warps=warps, unroll=unroll):
            _read_kernel[(programs,)](flat, sums, flat.numel(), steps, BLOCK=block, UNROLL=unroll, num_warps=warps)

        calls[f"read {per_sm}/SM {warps}w x{unroll}"] = call
    return calls


def measure(batch: int, length: int, head_dim: int, sms: int) -> dict:
    device, dtype = "cuda", torch.bfloat16
    kv = torch.randn(2, batch, length, HEADS_K, head_dim, dtype=dtype, device=device)  # K and V back to back
    k_cache, v_cache = kv.unbind(0)
    q = torch.randn(batch, 1, HEADS, head_dim, dtype=dtype, device=device)
    lengths = torch.full((batch,), length, dtype=torch.int32, device=device)
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k_cache, v_cache))

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    calls = {
        "flashtriton": lambda: flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths),
        "sdpa-cudnn": cudnn,
        **_reads(kv, sms),
    }
    ms = dict(zip(calls, device_timer(torch.device(device), ahead=True)(list(calls.values())), strict=True))
    tbs = {name: kv.numel() * kv.element_size() / t / 1e9 for name, t in ms.items()}
    best = max((name for name in tbs if name.startswith("read")), key=tbs.__getitem__)
    return {"batch": batch, "length": length, "head_dim": head_dim, "bytes": kv.numel() * kv.element_size(),
            "ms": ms, "tb_s": tbs, "best_read": best}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="read_roofline.json")
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch, length, head_dim in SHAPES:
        rows.append(measure(batch, length, head_dim, sms))
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"{'B':>3} {'L':>7} {'D':>4} {'MB':>6}  TB/s: {'ours':>5} {'cuDNN':>5} {'read':>5}  ours/read  best read")
    for r in rows:
        t = r["tb_s"]
        print(f"{r['batch']:>3} {r['length']:>7} {r['head_dim']:>4} {r['bytes'] / 1e6:>6.0f}        "
              f"{t['flashtriton']:>5.2f} {t['sdpa-cudnn']:>5.2f} {t[r['best_read']]:>5.2f}  "
              f"{t['flashtriton'] / t[r['best_read']]:>9.3f}  {r['best_read']}")  # fmt: skip


if __name__ == "__main__":
    main()
