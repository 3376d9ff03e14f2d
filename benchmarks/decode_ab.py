"""The decode table of another commit against the working tree's: flash_attn_with_kvcache on one GPU, in one process,
each build's config.decode_config in turn (the kernels and launchers are the working tree's), timed by CUDA-graph
replay (no host time), cuDNN SDPA beside for seqlen_q 1.

    python benchmarks/decode_ab.py --base 8e23105 --list          # the cells whose choice differs (no GPU needed)
    PYTHONPATH=src python benchmarks/decode_ab.py --base 8e23105 --out decode_ab.json
    PYTHONPATH=src python benchmarks/decode_ab.py --base-config base_config.py ...   # where git lacks that commit:
        # the file from `git show 8e23105:src/flashtriton/kernels/config.py`

Cells: D (--head-dims) x B (--batches) x cache rows (--lengths) x seqlen_q 1 and 4 (causal) x a contiguous cache and
pages of 16 and 256 in shuffled block tables; 32/8 heads, bf16. Prints each cell's head / base time, and the JSON
holds every median.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from flashtriton.kernels import config

HEADS, HEADS_K = 32, 8
LAYOUTS = (0, 16, 256)  # page size; 0: contiguous
QUERIES = ((1, False), (4, True))  # (seqlen_q, causal)


def base_table(rev: str | None, path: str | None):
    """The base's decode_config: its config.py loaded as a module of its own."""
    if path is None:
        source = subprocess.run(["git", "show", f"{rev}:src/flashtriton/kernels/config.py"], check=True,
                                capture_output=True, text=True).stdout  # fmt: skip
        path = Path(tempfile.mkdtemp()) / "base_config.py"
        path.write_text(source)
    spec = importlib.util.spec_from_file_location("decode_ab_base_config", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    head_table = config.decode_config  # (the working tree's: time_cells swaps config.decode_config later)

    def table(*args, **kwargs) -> config.DecodeConfig:
        """The base's choices as the working tree's DecodeConfig, which its launchers read: a field the base lacks
        (pdl, say) keeps the working tree's value, so that only the table's choices differ."""
        chosen, head = module.decode_config(*args, **kwargs), head_table(*args, **kwargs)
        fields = {f.name: getattr(chosen, f.name) for f in dataclasses.fields(chosen) if hasattr(head, f.name)}
        return dataclasses.replace(head, **fields)

    return table


def cells(head_dims, batches, lengths):
    return itertools.product(head_dims, batches, lengths, QUERIES, LAYOUTS)


def _choice(table, cell, sms: int) -> tuple:
    head_dim, batch, length, (n_q, _), page = cell
    c = table("sm90", head_dim, torch.bfloat16, HEADS // HEADS_K * n_q, batch * HEADS_K, length, sms, 0, page)
    return c.block_m, c.block_n, c.num_warps, c.num_stages, c.splits, c.tile_pages, c.max_registers


def time_cells(base, head_dims, batches, lengths, rounds: int, budget: float) -> list[dict]:
    """Each (head dim, batch, length) whose K and V take at most ``budget`` bytes: _time_shape's rows."""
    rows = []
    for head_dim, batch, length in itertools.product(head_dims, batches, lengths):
        nbytes = 4 * batch * length * HEADS_K * head_dim  # K and V
        if nbytes > budget:
            print(f"D{head_dim} B{batch} L{length}: skipped, K and V take {nbytes / 1e9:.1f} GB", flush=True)
            continue
        rows += _time_shape(base, head_dim, batch, length, rounds, copies=max(1, min(8, math.ceil(300e6 / nbytes))))
        torch.cuda.empty_cache()
    return rows


def _time_shape(base, head_dim: int, batch: int, length: int, rounds: int, copies: int) -> list[dict]:
    """Rows of one shape, seqlen_q 1 and 4: the medians of ``rounds`` rounds, the builds' calls and cuDNN's in turn,
    on ``copies`` copies of the caches (past L2)."""
    import torch.nn.functional as F
    from decode_tune import forget_choices, graph_us
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashtriton

    head = config.decode_config

    def build(table) -> None:
        config.decode_config = table
        forget_choices()

    shape = (batch, length, HEADS_K, head_dim)
    caches = [[torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(2)] for _ in range(copies)]
    seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    tables = {page: torch.randperm(batch * length // page, device="cuda").int().view(batch, -1) for page in LAYOUTS[1:]}
    rows = []
    for n_q, causal in QUERIES:
        q = torch.randn(batch, n_q, HEADS, head_dim, dtype=torch.bfloat16, device="cuda")

        def ours(i: int, page: int, q=q, causal=causal):
            k, v = caches[i]
            if page:
                k, v = (x.view(-1, page, HEADS_K, head_dim) for x in (k, v))
            return flashtriton.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=tables.get(page),
                                                       causal=causal)  # fmt: skip

        times: dict[str, list[float]] = {}
        for _ in range(rounds):
            if n_q == 1:
                qt = q.transpose(1, 2).contiguous()
                dense = [[x.transpose(1, 2).contiguous() for x in cache] for cache in caches]
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    cudnn = graph_us(lambda i, qt=qt, dense=dense: F.scaled_dot_product_attention(
                        qt, *dense[i], enable_gqa=True), copies)  # fmt: skip
                times.setdefault("cudnn", []).append(cudnn)
                del dense
            for page, (name, table) in itertools.product(LAYOUTS, (("base", base), ("head", head))):
                build(table)
                times.setdefault(f"{name}/{page}", []).append(graph_us(lambda i, page=page: ours(i, page), copies))
        build(head)
        us = {name: statistics.median(values) for name, values in times.items()}
        rows.append(dict(head_dim=head_dim, batch=batch, length=length, seqlen_q=n_q, us=us))
        ratios = " ".join(f"p{page} {us[f'head/{page}'] / us[f'base/{page}']:.3f}" for page in LAYOUTS)
        print(f"D{head_dim} B{batch} L{length} q{n_q}: head / base time {ratios}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    base = parser.add_mutually_exclusive_group(required=True)
    base.add_argument("--base", help="the commit whose table is the base")
    base.add_argument("--base-config", help="that commit's src/flashtriton/kernels/config.py, as a file")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 32768, 131072])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-gb", type=float, default=20, help="skip cells whose K and V take more (cuDNN's "
                        "dense copies take as much again)")  # fmt: skip
    parser.add_argument("--sms", type=int, default=132, help="--list: the SM count to choose for (an H100/H200's)")
    parser.add_argument("--list", action="store_true", help="print the cells whose choice differs; time nothing")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    table = base_table(args.base, args.base_config)
    if args.list:
        for cell in cells(args.head_dims, args.batches, args.lengths):
            before, after = _choice(table, cell, args.sms), _choice(config.decode_config, cell, args.sms)
            if before != after:
                print(cell, "block_m, block_n, warps, stages, splits, tile_pages, registers:", before, "->", after)
        return
    rows = time_cells(table, args.head_dims, args.batches, args.lengths, args.rounds, args.max_gb * 1e9)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
