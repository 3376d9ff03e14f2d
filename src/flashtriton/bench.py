"""``flashtriton bench``: flashtriton against its peers, every provider in the same run.

FLOPs (one formula, the FlashAttention-2 paper's): forward 4 * B * H * N_Q * N_K * D, halved
when causal; backward 2.5x the forward, so forward+backward 3.5x. Times are medians of
triton.testing.do_bench on random inputs. Peak extra memory is the allocator's peak during one
forward+backward beyond what the inputs already held. Error is the max abs difference of the
forward output from an fp32 reference on the first (batch, head) of the case.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from .interface import flash_attn_func
from .reference import attention_reference

MODES = ("fwd", "bwd", "fwd_bwd")
TOKENS, HIDDEN = 16384, 2048  # the FlashAttention-2 paper's sweep: batch * seqlen and heads * headdim


def attention_flops(batch, heads, n_q, n_k, head_dim, causal, mode) -> float:
    fwd = 4.0 * batch * heads * n_q * n_k * head_dim * (0.5 if causal else 1.0)
    return fwd * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]


@dataclass(frozen=True)
class Case:
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    causal: bool
    dtype: str = "bfloat16"

    @property
    def name(self) -> str:
        return f"d{self.head_dim}{'-causal' if self.causal else ''}-n{self.seqlen}"


@dataclass
class Result:
    case: Case
    provider: str
    ms: dict[str, float] = field(default_factory=dict)
    tflops: dict[str, float] = field(default_factory=dict)
    peak_extra_mib: float | None = None
    max_error: float | None = None
    first_call_s: float | None = None
    unavailable: str | None = None


# --- providers: (q, k, v) in (B, N, H, D) and causal -> a forward callable returning out -----------


def _sdpa(backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def make(q, k, v, causal):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)

        return run

    return make


def _flex(q, k, v, causal):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.config.recompile_limit = 1000  # never fall back to eager across the sweep's shapes
    compiled = torch.compile(flex_attention)
    mask = None
    if causal:
        offset = k.shape[1] - q.shape[1]
        mask = create_block_mask(
            lambda b, h, i, j: j <= i + offset, None, None, q.shape[1], k.shape[1], device=q.device
        )
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    return lambda: compiled(qt, kt, vt, block_mask=mask).transpose(1, 2)


def _flash_attn_package(q, k, v, causal):
    from flash_attn import flash_attn_func as upstream

    return lambda: upstream(q, k, v, causal=causal)


def _sdpa_default(q, k, v, causal):
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)


PROVIDERS: dict[str, Callable] = {
    "flashtriton": lambda q, k, v, causal: lambda: flash_attn_func(q, k, v, causal=causal),
    "sdpa": _sdpa_default,
    "sdpa-cudnn": _sdpa("CUDNN_ATTENTION"),
    "sdpa-flash": _sdpa("FLASH_ATTENTION"),
    "sdpa-efficient": _sdpa("EFFICIENT_ATTENTION"),
    "flex": _flex,
    "standard": lambda q, k, v, causal: lambda: attention_reference(q, k, v, causal=causal, compute_dtype=None)[0],
    "flash_attn": _flash_attn_package,
}
GPU_ONLY = {"sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "flex", "flash_attn"}


def _timer(device: torch.device):
    if device.type == "cuda":
        import triton

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def cpu_median(fn, reps=3):
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[len(times) // 2]

    return cpu_median


def _standard_fits(case: Case, device: torch.device) -> bool:
    """Standard attention materialises B*H*N^2 scores (several copies for backward): skip when huge."""
    limit = 2**31 if device.type == "cuda" else 2**26
    return case.batch * case.heads * case.seqlen**2 <= limit


def run_case(case: Case, provider: str, device: torch.device, modes=MODES) -> Result:
    result = Result(case, provider)
    if provider in GPU_ONLY and device.type != "cuda":
        result.unavailable = "needs a CUDA GPU"
        return result
    if provider == "standard" and not _standard_fits(case, device):
        result.unavailable = "N x N scores too large"
        return result
    dtype = getattr(torch, case.dtype)
    shape = (case.batch, case.seqlen, case.heads, case.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    try:
        fwd = PROVIDERS[provider](q, k, v, case.causal)
        start = time.perf_counter()
        out = fwd()
        grad = torch.randn_like(out)
        out.backward(grad)
        if device.type == "cuda":
            torch.cuda.synchronize()
        result.first_call_s = time.perf_counter() - start
    except Exception as exc:  # a peer that does not support this case (or is not installed)
        result.unavailable = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        return result
    result.max_error = _forward_error(out, q, k, v, case.causal)
    time_ms = _timer(device)
    for mode in modes:
        if mode == "fwd":
            with torch.no_grad():
                ms = time_ms(fwd)
        elif mode == "fwd_bwd":
            ms = time_ms(lambda: fwd().backward(grad))
        else:
            graph_out = fwd()
            ms = time_ms(lambda graph_out=graph_out: graph_out.backward(grad, retain_graph=True))
        result.ms[mode] = ms
        flops = attention_flops(case.batch, case.heads, case.seqlen, case.seqlen, case.head_dim, case.causal, mode)
        result.tflops[mode] = flops / (ms * 1e-3) / 1e12
    result.peak_extra_mib = _peak_extra_mib(fwd, grad, device)
    return result


def _forward_error(out, q, k, v, causal) -> float:
    one = [x[:1, :, :1].detach() for x in (q, k, v)]
    ref, _ = attention_reference(*one, causal=causal, compute_dtype=torch.float32)
    return (out[:1, :, :1].float() - ref).abs().max().item()


def _peak_extra_mib(fwd, grad, device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fwd().backward(grad)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def environment() -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    with contextlib.suppress(ImportError):
        import triton

        info["triton"] = triton.__version__
    with contextlib.suppress(subprocess.CalledProcessError, FileNotFoundError):
        info["commit"] = subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], text=True, stderr=subprocess.DEVNULL
        ).strip()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        with contextlib.suppress(subprocess.CalledProcessError, FileNotFoundError):
            info["driver"] = subprocess.check_output(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], text=True
            ).strip()
    return info


def default_cases(device: torch.device, head_dims, seqlens, causal_options, dtype) -> list[Case]:
    if device.type != "cuda":
        return [Case(1, n, 4, 64, c, "float32") for c in causal_options for n in seqlens]
    return [
        Case(max(1, TOKENS // n), n, HIDDEN // d, d, c, dtype)
        for d in head_dims
        for c in causal_options
        for n in seqlens
    ]


def _progress(items, enabled):
    total = len(items)
    for i, item in enumerate(items, 1):
        if enabled:
            print(f"\r[{i}/{total}] {item[0].name} {item[1]:<16}", end="", file=sys.stderr, flush=True)
        yield item
    if enabled:
        print(file=sys.stderr)


def format_table(results: list[Result], modes) -> str:
    peers = [p for p in dict.fromkeys(r.provider for r in results) if p != "flashtriton"]
    ours = {r.case: r for r in results if r.provider == "flashtriton" and not r.unavailable}
    lines = []
    header = f"{'case':<22}{'mode':<9}{'ms':>9}{'TFLOP/s':>9}{'max err':>10}{'peak MiB':>10}"
    header += "".join(f"{'x ' + p:>17}" for p in peers)
    lines.append(header)
    for case, r in ours.items():
        for mode in modes:
            if mode not in r.ms:
                continue
            ratios = []
            for p in peers:
                peer = next((x for x in results if x.case == case and x.provider == p), None)
                ratio = peer and mode in peer.ms and peer.ms[mode] / r.ms[mode]
                ratios.append(f"{ratio:>17.2f}" if ratio else f"{'-':>17}")
            memory = f"{r.peak_extra_mib:>10.1f}" if r.peak_extra_mib is not None else f"{'-':>10}"
            row = f"{case.name:<22}{mode:<9}{r.ms[mode]:>9.3f}{r.tflops[mode]:>9.1f}{r.max_error:>10.1e}{memory}"
            lines.append(row + "".join(ratios))
    return "\n".join(lines)


def plot(results: list[Result], path_prefix: str, modes) -> list[str]:
    """One PNG per (head dim, causal, mode): TFLOP/s against seqlen, one line per provider."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    groups = sorted({(r.case.head_dim, r.case.causal) for r in results})
    for (head_dim, causal), mode in ((g, m) for g in groups for m in modes):
        fig, ax = plt.subplots(figsize=(6, 4))
        for provider in dict.fromkeys(r.provider for r in results):
            pts = sorted(
                (r.case.seqlen, r.tflops[mode])
                for r in results
                if r.provider == provider
                and (r.case.head_dim, r.case.causal) == (head_dim, causal)
                and mode in r.tflops
            )
            if pts:
                ax.plot(
                    *zip(*pts, strict=True),
                    marker="o",
                    label=provider,
                    linewidth=2.5 if provider == "flashtriton" else 1,
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"head dim {head_dim}{', causal' if causal else ''}, {mode}")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        path = f"{path_prefix}d{head_dim}{'_causal' if causal else ''}_{mode}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="flashtriton bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few cases only (what `make demo` runs)")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--providers", nargs="+", choices=list(PROVIDERS), default=list(PROVIDERS))
    parser.add_argument("--out", default="bench-out", help="folder for results.json and the plots")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    causal_options = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    if args.quick:
        args.head_dims, args.seqlens = [128], ([4096] if device.type == "cuda" else [1024])
    if device.type != "cuda":
        args.seqlens = [n for n in args.seqlens if n <= 2048] or [1024]
    cases = default_cases(device, args.head_dims, args.seqlens, causal_options, args.dtype)
    work = [(c, p) for c in cases for p in args.providers]
    results = [run_case(c, p, device, args.modes) for c, p in _progress(work, sys.stderr.isatty())]

    os.makedirs(args.out, exist_ok=True)
    payload = {"environment": environment(), "device": str(device), "results": [asdict(r) for r in results]}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(payload, f, indent=1)
    if not args.no_plots:
        plot(results, os.path.join(args.out, ""), args.modes)
    for r in results:
        if r.unavailable:
            print(f"unavailable: {r.provider} on {r.case.name}: {r.unavailable}")
    print(format_table(results, args.modes))
    return 0
