"""The FlashAttention-2 paper's end-to-end table on one GPU: GPT-3-style 1.3B and 2.7B models trained at context 2k
and 8k, the attention from flashtriton and its peers, with examples/train_gpt.py's model, data and step.

    PYTHONPATH=src python benchmarks/train.py [--cells 1.3b:2048 2.7b:8192] [--tokens 16384] [--loss-steps 300]
                                              [--out DIR]

Speed: for each (model, context) cell one model and optimizer take steps (AdamW, bf16 autocast) with each provider's
attention in turn, --rounds rounds of --steps timed steps each (CUDA events, the median round), after two warm-up
steps per provider; every provider runs the same steps of --tokens tokens. Reported: tokens/s, model TFLOP/s (the
paper's formula: GPT.flops_per_sequence), MFU against the GPU's bf16 dense peak, and each provider's peak memory.
A provider that runs out of memory is reported as such ("standard attention where it fits").

Loss: on --loss-cell, a fresh model (seed 0) per provider trains --loss-steps steps on the same batches; the curves
go to loss.json and loss.png. Peers: SDPA's cuDNN and FlashAttention-2 backends, and standard attention. Needs a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_gpt import GPT, MODELS, GPTConfig, batches, make_optimizer, stdlib_bytes, train_step

PROVIDERS = ("flashtriton", "sdpa-cudnn", "sdpa-flash", "standard")
BF16_DENSE_PEAK = {"H100 80GB HBM3": 989.4e12, "H200": 989.4e12}  # SXM datasheets' bf16 dense peak (not PCIe/NVL)
PAPER_A100 = {  # FlashAttention-2 paper, Table 1 (8 x A100 80GB): TFLOP/s per GPU without FlashAttention, FA, FA2
    ("1.3b", 2048): (142, 189, 196),
    ("1.3b", 8192): (72, 170, 220),
    ("2.7b", 2048): (149, 189, 205),
    ("2.7b", 8192): (80, 175, 225),
}


def peak_flops() -> float | None:
    name = torch.cuda.get_device_name()
    return next((peak for gpu, peak in BF16_DENSE_PEAK.items() if gpu in name), None)


def build(model: str, context: int, attention: str) -> GPT:
    cfg = MODELS[model]
    torch.manual_seed(0)
    return GPT(GPTConfig(cfg.layers, cfg.hidden, cfg.heads, context=context), attention).cuda()


def timed_steps(net: GPT, optimizer, data, steps: int) -> float:
    """ms per step over `steps` steps, one CUDA-event pair around them."""
    inputs = [tuple(x.cuda(non_blocking=True) for x in next(data)) for _ in range(steps)]
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for x, y in inputs:
        train_step(net, optimizer, x, y)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def speed_cell(model: str, context: int, args, text: torch.Tensor) -> dict:
    """One (model, context) cell: every provider's ms per step (median round), tokens/s, TFLOP/s, MFU, peak GiB."""
    batch = args.tokens // context
    net = build(model, context, PROVIDERS[0])
    optimizer, _ = make_optimizer(net, 1e-4, 1)
    data = batches(text, batch, context, seed=1)
    rounds, memory, failed = {p: [] for p in args.providers}, {}, {}
    for provider in args.providers:  # warm up (compiles, cuDNN plans), and the provider's peak memory
        net.attention = provider
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            timed_steps(net, optimizer, data, 2)
        except torch.OutOfMemoryError:
            failed[provider] = "out of memory"
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
            continue
        memory[provider] = torch.cuda.max_memory_allocated() / 2**30
    for _ in range(args.rounds):  # the providers in turn
        for provider in memory:
            net.attention = provider
            rounds[provider].append(timed_steps(net, optimizer, data, args.steps))
    flops = net.flops_per_sequence(context) * batch
    peak = peak_flops()
    results = {}
    for provider in args.providers:
        if provider in failed:
            results[provider] = {"error": failed[provider]}
            continue
        ms = statistics.median(rounds[provider])
        tflops = flops / ms / 1e9
        results[provider] = {
            "ms_per_step": ms, "rounds_ms": rounds[provider], "tokens_per_s": args.tokens / ms * 1e3,
            "tflops": tflops, "mfu": tflops * 1e12 / peak if peak else None, "peak_gib": memory[provider],
        }  # fmt: skip
    params = sum(p.numel() for p in net.parameters())
    del net, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    return {"model": model, "context": context, "batch": batch, "params": params, "providers": results}


def loss_curves(model: str, context: int, args, text: torch.Tensor) -> dict:
    """Each provider trains a fresh model (seed 0) on the same batches (seed 0): its losses per step."""
    curves = {}
    for provider in args.loss_providers:
        net = build(model, context, provider)
        optimizer, schedule = make_optimizer(net, args.lr, args.warmup)
        data = batches(text, args.loss_batch, context, seed=0)
        losses = []
        for _ in range(args.loss_steps):
            x, y = (t.cuda(non_blocking=True) for t in next(data))
            losses.append(train_step(net, optimizer, x, y))
            schedule.step()
        curves[provider] = torch.stack(losses).tolist()
        print(f"loss {provider}: first {curves[provider][0]:.3f} last {curves[provider][-1]:.3f}", flush=True)
        del net, optimizer
        gc.collect()
        torch.cuda.empty_cache()
    return {"model": model, "context": context, "batch": args.loss_batch, "lr": args.lr, "curves": curves}


def agreement(curves: dict[str, list[float]], window: int = 20) -> dict:
    """Largest gap between two providers' loss curves, smoothed over `window` steps: flashtriton against each peer,
    and the peers among themselves (their gap is the run-to-run noise of equivalent kernels)."""

    def smooth(xs):
        return [statistics.fmean(xs[max(0, i - window + 1) : i + 1]) for i in range(len(xs))]

    smoothed = {name: smooth(xs) for name, xs in curves.items()}
    names = list(smoothed)
    return {
        f"{a} vs {b}": max(abs(x - y) for x, y in zip(smoothed[a], smoothed[b], strict=True))
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    }


def plot(loss: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for provider, losses in loss["curves"].items():
        ax.plot(range(1, len(losses) + 1), losses, label=provider, linewidth=1)
    ax.set(xlabel="step", ylabel="training loss (nats per byte)", yscale="log",
           title=f"GPT-3 {loss['model']}, context {loss['context']}, batch {loss['batch']}")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(cells: list[dict]) -> str:
    lines = ["model  context  provider      ms/step   tokens/s  TFLOP/s    MFU  peak GiB  x flashtriton  paper A100"]
    for cell in cells:
        ours = cell["providers"].get("flashtriton", {}).get("ms_per_step")
        paper = PAPER_A100.get((cell["model"], cell["context"]))
        for provider, r in cell["providers"].items():
            head = f"{cell['model']:5s}  {cell['context']:7d}  {provider:12s}"
            if "error" in r:
                lines.append(f"{head}  {r['error']}")
                continue
            mfu = f"{r['mfu']:6.1%}" if r["mfu"] is not None else "     -"
            # peer time / ours: above 1, ours faster
            ratio = f"{r['ms_per_step'] / ours:13.3f}" if ours else "            -"
            ref = {"flashtriton": 2, "standard": 0}.get(provider)
            lines.append(
                f"{head}  {r['ms_per_step']:7.1f}  {r['tokens_per_s']:9,.0f}  {r['tflops']:7.1f}  {mfu}  "
                f"{r['peak_gib']:8.1f}  {ratio}  {paper[ref] if paper and ref is not None else '':>10}"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", default=["1.3b:2048", "1.3b:8192", "2.7b:2048", "2.7b:8192"])
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per step (batch = tokens / context)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per provider per round")
    parser.add_argument("--loss-cell", default="1.3b:2048")
    parser.add_argument("--loss-steps", type=int, default=300, help="0: no loss curves")
    parser.add_argument("--loss-batch", type=int, default=4)
    parser.add_argument("--loss-providers", nargs="+", default=["flashtriton", "sdpa-cudnn", "sdpa-flash"])
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--out", default=None, help="directory for results.json, loss.json and loss.png")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (examples/train_gpt.py trains on a CPU)")
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    text = stdlib_bytes()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "text_bytes": text.numel()}
    cells = []
    for cell in args.cells:
        model, context = cell.split(":")
        cells.append(speed_cell(model, int(context), args, text))
        print(table(cells[-1:]).split("\n", 1)[1], flush=True)
        if out:
            (out / "results.json").write_text(json.dumps({"meta": meta, "cells": cells}, indent=1))
    if args.loss_steps:
        model, context = args.loss_cell.split(":")
        loss = loss_curves(model, int(context), args, text)
        loss["agreement"] = agreement(loss["curves"])
        print("largest gaps of the smoothed loss curves:", json.dumps(loss["agreement"]))
        if out:
            (out / "loss.json").write_text(json.dumps(loss))
            plot(loss, out / "loss.png")
    print(table(cells))
    if out:
        print(f"results in {out}")


if __name__ == "__main__":
    main()
