"""The decode table's search: flash_attn_with_kvcache's GPU time under CUDA-graph replay (no host time) for forced
(block_n, num_warps, num_stages, splits) configs, beside cuDNN SDPA (enable_gqa) in the same run.

    PYTHONPATH=src python benchmarks/decode_tune.py [--out decode_tune.json]
    PYTHONPATH=src python benchmarks/decode_tune.py --paged      # contiguous against pages of 16 (--page), same configs
    PYTHONPATH=src python benchmarks/decode_tune.py --sweep [--paged] --configs 64/4/3 --shapes 8x32768
    PYTHONPATH=src python benchmarks/decode_tune.py --configs --paged   # the table alone (an A/B of two builds)

32/8 heads, D=128 (--head-dim), bf16, seqlen_q 1, the whole cache attended. Splits are taken as ceil(t * SMs /
(B * H_KV)) for t programs per SM (t = 1, 2, 4, 8), capped at a split per tile; --sweep takes
every count from 1 to 32, 48 to 128 by 16 and those that fill whole waves instead, and notes how many programs of
each config one SM holds (the first compiled kernel of that block_n, warps and stages: contiguous, this head dim).
Small caches are replayed from several copies (about 300 MB in all) so that L2 does not hold them. Prints, per
shape, cuDNN's time, the table's current choice and the best forced config; the JSON has every time.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtriton
from flashtriton import decode_backend, route
from flashtriton.kernels import config

HEADS, HEADS_K = 32, 8
SHAPES = ((1, 4096), (1, 32768), (1, 131072), (8, 4096), (8, 32768), (8, 131072), (64, 4096), (64, 32768))
CANDIDATES = ((64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 8, 2), (128, 8, 3), (32, 4, 4), (64, 8, 3))
PROGRAMS_PER_SM = (1, 2, 4, 8)
SWEEP = ((64, 4, 3), (64, 4, 4), (64, 4, 2), (32, 4, 4))

_forced: dict[str, tuple] = {}
_table_config = config.decode_config


def _config(arch, head_dim, dtype, rows, pairs, capacity, sms, num_splits, page_size=0) -> config.DecodeConfig:
    """The table's config, or the forced one (its block_m kept; pages read by tile as the library would)."""
    chosen = _table_config(arch, head_dim, dtype, rows, pairs, capacity, sms, num_splits, page_size)
    if not _forced:
        return chosen
    block_n, warps, stages, splits = _forced["config"]
    splits = max(1, min(splits, -(-capacity // block_n)))
    by_tile = config.tile_pages(block_n, page_size)
    registers = chosen.max_registers if warps == chosen.num_warps else None  # the table's cap holds for its warps
    return config.DecodeConfig(chosen.block_m, block_n, warps, stages, splits, by_tile, registers, pdl=chosen.pdl)


def forget_choices() -> None:
    """Drops the routes and plans made so far: they hold the config they were made with."""
    route._ROUTES.clear()
    decode_backend._PLANS.clear()
    decode_backend._SIGNED.clear()


def _force(value: tuple | None) -> None:
    _forced.clear()
    if value is not None:
        _forced["config"] = value
    forget_choices()


def graph_us(fn, inputs: int) -> float:
    """Median microseconds per call over replays of a graph of max(inputs, 8) calls, input i % inputs each."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(inputs):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph, calls = torch.cuda.CUDAGraph(), max(inputs, 8)
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % inputs)
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def _shape(batch: int, length: int, paged: bool, head_dim: int, page: int = 16):
    """cuDNN's time at this shape and our call on input copy i (paged: the same caches as pages of ``page`` rows in a
    shuffled block table), with the number of copies."""
    nbytes = 2 * batch * length * HEADS_K * head_dim * 2
    copies = max(1, min(8, math.ceil(300e6 / nbytes)))
    q = torch.randn(batch, 1, HEADS, head_dim, dtype=torch.bfloat16, device="cuda")
    caches = [
        tuple(torch.randn(batch, length, HEADS_K, head_dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        for _ in range(copies)
    ]
    lengths = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    qt = q.transpose(1, 2).contiguous()
    dense = [tuple(x.transpose(1, 2).contiguous() for x in cache) for cache in caches]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cudnn = graph_us(lambda i: F.scaled_dot_product_attention(qt, *dense[i], enable_gqa=True), copies)
    dense.clear()  # the peer's copies freed before ours run
    table = None
    if paged:
        pages = batch * length // page
        table = torch.randperm(pages, device="cuda").to(torch.int32).view(batch, -1)

    def ours(i, paged_call=False):
        k, v = caches[i]
        if paged_call:
            k, v = k.view(-1, page, HEADS_K, head_dim), v.view(-1, page, HEADS_K, head_dim)
        return flashtriton.flash_attn_with_kvcache(
            q, k, v, cache_seqlens=lengths, block_table=table if paged_call else None
        )

    return cudnn, ours, copies


def tune(batch: int, length: int, sms: int, paged: bool, head_dim: int, candidates, page: int) -> dict[str, float]:
    cudnn, ours, copies = _shape(batch, length, paged, head_dim, page)
    times = {"cudnn": cudnn}
    layouts = ((False, ""), (True, "paged ")) if paged else ((False, ""),)
    for paged_call, prefix in layouts:
        _force(None)
        times[prefix + "table"] = graph_us(lambda i, p=paged_call: ours(i, p), copies)
        for block_n, warps, stages in candidates:
            for per_sm in PROGRAMS_PER_SM:
                cap = min(-(-length // block_n), config.DECODE_MAX_SPLITS)
                splits = max(1, min(math.ceil(per_sm * sms / (batch * HEADS_K)), cap))
                _force((block_n, warps, stages, splits))
                name = f"{prefix}{block_n}/{warps}/{stages}/s{splits}"
                times[name] = graph_us(lambda i, p=paged_call: ours(i, p), copies)
    _force(None)
    return times


def _resident(block_n: int, warps: int, stages: int) -> int:
    """Split programs one SM holds at once with this config (shared memory and registers of its compiled kernel,
    an H100/H200's limits), 0 if none of that config was compiled."""
    at = decode_backend._SPLIT.names.index("BLOCK_N")
    for (_, values, options), kernel in decode_backend._SPLIT.kernels.items():
        options = dict(options)
        if values[at] == block_n and (options.get("num_warps"), options.get("num_stages")) == (warps, stages):
            by_smem = 228 * 1024 // (kernel.metadata.shared + 1024)
            by_regs = 65536 // (max(kernel.n_regs, 1) * 32 * warps)
            return min(by_smem, by_regs, 32)
    return 0


def sweep(batch: int, length: int, sms: int, head_dim: int, configs, paged: bool, page: int) -> dict[str, float]:
    """Split counts from 1 to 32, 48 to 128 by 16 and those filling whole waves, up to 24 programs per SM, for the
    configs; paged: the paged call's."""
    cudnn, contiguous, copies = _shape(batch, length, paged, head_dim, page)
    ours = (lambda i: contiguous(i, True)) if paged else contiguous
    times = {"cudnn": cudnn}
    _force(None)
    times["table"] = graph_us(ours, copies)
    pairs = batch * HEADS_K
    for block_n, warps, stages in configs:
        cap = min(-(-length // block_n), config.DECODE_MAX_SPLITS)
        counts = {*range(1, 33), *range(48, 129, 16)}
        for waves in range(1, 9):
            counts |= {waves * per_sm * sms // pairs for per_sm in (1, 2, 3)}
        for splits in sorted(s for s in counts if 1 <= s <= cap and s * pairs <= 24 * sms):
            _force((block_n, warps, stages, splits))
            times[f"{block_n}/{warps}/{stages}/s{splits}"] = graph_us(ours, copies)
        times[f"{block_n}/{warps}/{stages}/resident"] = _resident(block_n, warps, stages)
    _force(None)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--paged",
        action="store_true",
        help="also time pages (of --page rows) in a shuffled block table (with --sweep: those alone)",
    )
    parser.add_argument("--page", type=int, default=16, help="rows per page with --paged (default 16)")
    parser.add_argument("--sweep", action="store_true", help="every split count for the configs")
    parser.add_argument(
        "--configs",
        nargs="*",
        default=None,
        help="block_n/warps/stages configs (default: CANDIDATES, or SWEEP with --sweep); none: the table alone",
    )
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--shapes", nargs="*", default=None, help="BxL pairs, e.g. 8x32768 (default: SHAPES)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    shapes = SHAPES if not args.shapes else [tuple(map(int, s.split("x"))) for s in args.shapes]
    if args.paged and any(length % args.page for _, length in shapes):
        parser.error(f"--page {args.page} must divide every cache length: {shapes}")
    configs = SWEEP if args.sweep else CANDIDATES
    if args.configs is not None:
        configs = [tuple(map(int, c.split("/"))) for c in args.configs]
    config.decode_config = _config
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch, length in shapes:
        if args.sweep:
            times = sweep(batch, length, sms, args.head_dim, configs, args.paged, args.page)
        else:
            times = tune(batch, length, sms, args.paged, args.head_dim, configs, args.page)
        rows.append(dict(batch=batch, length=length, page=args.page if args.paged else 0, us=times))
        if args.out:  # after each shape: a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
        best = min(((t, name) for name, t in times.items() if "/s" in name), default=(math.nan, "-"))
        paged = f", paged table {times['paged table']:.1f}" if "paged table" in times else ""
        print(
            f"B{batch} L{length}: cuDNN {times['cudnn']:.1f} us, table {times['table']:.1f}{paged}, best {best[1]} "
            f"{best[0]:.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
