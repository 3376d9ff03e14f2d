"""Masked attention on the GPU: flashtriton against FlexAttention with the same mask, and density sweeps.

    PYTHONPATH=src python benchmarks/masks.py --out OUT_DIR

Cases (bf16, B=1, H=16, D=128, N=16k unless --seqlen): a causal sliding window of 1024 and an
8-document causal mask, each through flashtriton's native path (window_size; varlen) and its
BlockMask path, against FlexAttention (torch.compile(flex_attention) with the same mask) and SDPA
given the same mask as a dense boolean (N, N) attn_mask; then random block layouts at densities
1..100% (the same three providers) to show time proportional to density. Writes masks.json and
masks.png; prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

import flashtriton

WINDOW = 1024
DOCUMENTS = 8


def _time(fn, backward: bool, inputs) -> float:
    if not backward:
        return triton.testing.do_bench(fn, warmup=10, rep=50)
    out = fn()
    grad = torch.randn_like(out)

    def step():
        for x in inputs:
            x.grad = None
        fn().backward(grad)

    return triton.testing.do_bench(step, warmup=10, rep=50)


def _flex(q, k, v, block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    return lambda: compiled(qt, kt, vt, block_mask=block_mask).transpose(1, 2)


def _sdpa(q, k, v, dense_mask):
    """SDPA with the mask materialised: the dense-mask baseline (its backends read all N x N entries)."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    return lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=dense_mask).transpose(1, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("masks.py times kernels on a CUDA GPU, and this machine has none")
    from torch.nn.attention.flex_attention import create_block_mask as flex_block_mask

    torch._dynamo.config.recompile_limit = 64
    n, h, d, dev = args.seqlen, args.heads, args.head_dim, "cuda"
    q, k, v = (torch.randn(1, n, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    doc_len = n // DOCUMENTS
    doc_ids = (torch.arange(n, device=dev) // doc_len).to(torch.int32)
    cu_seqlens = torch.arange(0, n + 1, doc_len, device=dev, dtype=torch.int32)
    # varlen callers hold packed (total, H, D) leaves: slicing q[0] would add a select's backward (a
    # zero-filled copy of each input) to the timed step
    packed = [x[0].detach().requires_grad_() for x in (q, k, v)]
    positions = torch.arange(n, device=dev)

    def flex_window(b, hh, qi, ki):
        return (ki <= qi) & (qi - ki <= WINDOW)

    def flex_document(b, hh, qi, ki):
        return (doc_ids[qi] == doc_ids[ki]) & (ki <= qi)

    # block masks are built once, outside the timed region, as Flex's are
    window_bm = flashtriton.create_block_mask(flashtriton.sliding_window_mask(WINDOW), None, None, n, n, device=dev)
    document_mod = flashtriton.and_masks(flashtriton.document_mask(doc_ids), flashtriton.causal_mask())
    document_bm = flashtriton.create_block_mask(document_mod, None, None, n, n, device=dev)
    cases = {
        "window1024": {
            "flashtriton (window_size)": lambda: flashtriton.flash_attn_func(q, k, v, window_size=(WINDOW, 0)),
            "flashtriton (block mask)": lambda: flashtriton.flash_attn_func(q, k, v, block_mask=window_bm),
            "flex": _flex(q, k, v, flex_block_mask(flex_window, None, None, n, n, device=dev)),
            "sdpa (dense mask)": _sdpa(q, k, v, flex_window(0, 0, positions[:, None], positions[None, :])),
        },
        "document8": {
            "flashtriton (varlen)": lambda: flashtriton.flash_attn_varlen_func(
                *packed, cu_seqlens, cu_seqlens, doc_len, doc_len, causal=True
            ),
            "flashtriton (block mask)": lambda: flashtriton.flash_attn_func(q, k, v, block_mask=document_bm),
            "flex": _flex(q, k, v, flex_block_mask(flex_document, None, None, n, n, device=dev)),
            "sdpa (dense mask)": _sdpa(q, k, v, flex_document(0, 0, positions[:, None], positions[None, :])),
        },
    }

    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    rows = []
    for case, providers in cases.items():
        for provider, fn in providers.items():
            for mode, backward in (("fwd", False), ("fwd_bwd", True)):
                ms = _time(fn, backward, (q, k, v, *packed))
                rows.append(dict(case=case, provider=provider, mode=mode, ms=ms))
    results["masks"] = rows

    tiles = math.ceil(n / 128)
    generator = torch.Generator(device="cpu").manual_seed(0)
    density_rows = []
    for density in (0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0):
        layout = torch.rand(1, 1, tiles, tiles, generator=generator) < density
        layout[..., torch.arange(tiles), torch.arange(tiles)] = True  # no empty query tile
        bm = flashtriton.BlockMask.from_layout(layout.to(dev), block_size=(128, 128), seqlen_q=n, seqlen_k=n)
        dense = layout.to(dev)

        def flex_layout(b, hh, qi, ki, dense=dense):
            return dense[0, 0, qi // 128, ki // 128]

        flex_bm = flex_block_mask(flex_layout, None, None, n, n, device=dev)
        element_mask = dense[0, 0].repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :n]
        for provider, fn in (
            ("flashtriton", lambda bm=bm: flashtriton.flash_attn_func(q, k, v, block_mask=bm)),
            ("flex", _flex(q, k, v, flex_bm)),
            ("sdpa (dense mask)", _sdpa(q, k, v, element_mask)),
        ):
            for mode, backward in (("fwd", False), ("fwd_bwd", True)):
                ms = _time(fn, backward, (q, k, v))
                density_rows.append(dict(density=bm.density(), provider=provider, mode=mode, ms=ms))
    results["density"] = density_rows

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "masks.json").write_text(json.dumps(results, indent=1))
    _plot(density_rows, args.out / "masks.png")
    print(f"{'case':12s} {'provider':28s} {'mode':8s} {'ms':>8s} {'flex/ours':>9s}")
    flex = {(r["case"], r["mode"]): r["ms"] for r in rows if r["provider"] == "flex"}
    for r in rows:
        ratio = flex[r["case"], r["mode"]] / r["ms"]
        print(f"{r['case']:12s} {r['provider']:28s} {r['mode']:8s} {r['ms']:8.3f} {ratio:9.2f}")
    for r in density_rows:
        print(f"density {r['density']:.3f} {r['provider']:12s} {r['mode']:8s} {r['ms']:8.3f}")


def _plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, mode in zip(axes, ("fwd", "fwd_bwd"), strict=True):
        for provider in ("flashtriton", "flex", "sdpa (dense mask)"):
            pts = sorted((r["density"], r["ms"]) for r in rows if r["provider"] == provider and r["mode"] == mode)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=provider)
        ax.set(title=f"random block layout, {mode}", xlabel="density (tiles visited)", ylabel="ms")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
