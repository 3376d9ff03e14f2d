"""Decoding against a KV cache: effective bandwidth (bytes of K and V read / time) of flash_attn_with_kvcache
against cuDNN SDPA (enable_gqa) and SDPA's FlashAttention-2 backend, in one process, calls taken in turn, each
after an L2 flush with CUDA events around it; host microseconds per call beside (wall clock over blocks of calls).

    PYTHONPATH=src python benchmarks/decode_bw.py [--batches 1 8] [--lengths 4096 32768 131072] [--out decode.json]

Shapes: 32 query heads, 8 K/V heads, D=128, bf16, seqlen_q 1, the whole cache attended (cache_seqlens = length).
SDPA gets the cache as contiguous (B, H_KV, L, D) copies. A first measurement ahead of ``flashtriton bench --suite
decode`` (issue 36), which will cover paged caches, D=64 and seqlen_q 4.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtriton

HEADS, HEADS_K, HEAD_DIM = 32, 8, 128
ROUNDS, HOST_CALLS = 50, 200


def providers(batch: int, length: int) -> dict:
    dtype, device = torch.bfloat16, "cuda"
    q = torch.randn(batch, 1, HEADS, HEAD_DIM, dtype=dtype, device=device)
    k_cache, v_cache = (torch.randn(batch, length, HEADS_K, HEAD_DIM, dtype=dtype, device=device) for _ in range(2))
    lengths = torch.full((batch,), length, dtype=torch.int32, device=device)
    qt = q.transpose(1, 2).contiguous()
    kt, vt = (x.transpose(1, 2).contiguous() for x in (k_cache, v_cache))

    def ours():
        return flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)

    def sdpa(backend):
        def call():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)

        return call

    calls = {
        "flashtriton": ours,
        "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
    }
    reference = calls["sdpa-flash"]().float()
    errors = {name: (call().float() - reference).abs().max().item() for name, call in calls.items()}
    return calls, errors, 2 * k_cache.numel() * k_cache.element_size()


def device_ms(calls: dict) -> dict:
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    events = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, call in calls.items():
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) for s, e in pairs) for name, pairs in events.items()}


def host_us(calls: dict) -> dict:
    out = {}
    for name, call in calls.items():
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(HOST_CALLS):
            call()
        torch.cuda.synchronize()
        out[name] = (time.perf_counter() - start) / HOST_CALLS * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for batch in args.batches:
        for length in args.lengths:
            calls, errors, nbytes = providers(batch, length)
            for call in calls.values():  # compile, plan
                call()
            ms = device_ms(calls)
            us = host_us(calls)
            tbps = {name: nbytes / (t * 1e-3) / 1e12 for name, t in ms.items()}
            rows.append(
                {"batch": batch, "length": length, "ms": ms, "tb_per_s": tbps, "host_us": us, "max_error": errors}
            )
            line = "  ".join(f"{name} {tbps[name]:.2f} TB/s {us[name]:.0f} us" for name in calls)
            print(f"B{batch} L{length}: {line}  (cudnn/ours {ms['sdpa-cudnn'] / ms['flashtriton']:.2f}x)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
