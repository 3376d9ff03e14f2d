"""What a run prints and draws at its end: the table of our results and ratios, its legend, the first calls, what
was unavailable or skipped, and the TFLOP/s plot."""

from __future__ import annotations

from .cases import OURS, Result


def _tflops(x: float) -> str:
    return f"{x:.1f}" if x >= 1 else f"{x:.2g}"  # a CPU's are thousandths


def format_table(results: list[Result], modes) -> str:
    """Our rows, a column of ratios per peer that ran beside us (a peer unavailable on every case has none)."""
    ours = [r for r in results if r.provider == OURS and not r.unavailable]
    peers = [p for p in dict.fromkeys(r.provider for r in results) if any(p in r.ratios for r in ours)]
    lines = []
    header = f"{'case':<22}{'mode':<9}{'ms':>9}{'TFLOP/s':>9}{'max err':>10}{'peak MiB':>10}{'1st s':>8}"
    lines.append(header + "".join(f"{'x ' + p:>17}" for p in peers))
    for r in ours:
        for mode in (m for m in modes if m in r.ms):
            ratios = [r.ratios.get(p, {}).get(mode) for p in peers]
            memory = f"{r.peak_extra_mib:>10.1f}" if r.peak_extra_mib is not None else f"{'-':>10}"
            row = f"{r.case.name:<22}{mode:<9}{r.ms[mode]:>9.3f}{_tflops(r.tflops[mode]):>9}"
            row += f"{r.max_error:>10.1e}{memory}{r.first_call_s:>8.2f}"
            lines.append(row + "".join(f"{x:>17.2f}" if x else f"{'-':>17}" for x in ratios))
    return "\n".join(lines)


TABLE_LEGEND = (
    f"ms, TFLOP/s: {OURS}'s medians; max err: against an fp32 reference; peak MiB: the allocator's peak in one\n"
    "fwd+bwd beyond what was allocated before it; 1st s: the first fwd+bwd call's seconds, JIT compile included;\n"
    f"x peer: peer ms / {OURS} ms (above 1: {OURS} is faster)"
)


def _measured(r: Result) -> list[tuple[str, str, str, str]]:
    """A users-suite result's rows: (mode, our value with its unit, TFLOP/s, the ratios' key)."""
    if r.case.measure == "memory":
        value = f"{r.peak_extra_mib:.1f} MiB" if r.peak_extra_mib is not None else "- MiB"
        return [(mode, value, "", "peak_extra_mib") for mode in r.case.modes]
    if r.case.measure == "host":
        return [(m, f"{r.ms[m] * 1e3:.1f} us", "", m) for m in r.case.modes if m in r.ms]
    return [(m, f"{r.ms[m]:.3f} ms", _tflops(r.tflops[m]), m) for m in r.case.modes if m in r.ms]


def format_users_table(results: list[Result]) -> str:
    """The users suite's table: a row per case and mode of ours (time: device ms; host: wall us per call; memory:
    peak MiB), a column of ratios per peer that ran beside us on any case."""
    ours = [r for r in results if r.provider == OURS and not r.unavailable]
    peers = [p for p in dict.fromkeys(r.provider for r in results) if any(p in r.ratios for r in ours)]
    header = f"{'group':<10}{'case':<36}{'mode':<9}{OURS:>13}{'TFLOP/s':>9}{'max err':>10}"
    lines = [header + "".join(f"{'x ' + p:>17}" for p in peers)]
    for r in ours:
        for mode, value, tflops, key in _measured(r):
            ratios = [r.ratios.get(p, {}).get(key) for p in peers]
            row = f"{r.case.group:<10}{r.case.name:<36}{mode:<9}{value:>13}{tflops:>9}{r.max_error:>10.1e}"
            lines.append(row + "".join(f"{x:>17.2f}" if x else f"{'-':>17}" for x in ratios))
    return "\n".join(lines)


USERS_LEGEND = (
    f"{OURS}: ms, a call's device time (median; L2 flushed before each call, every provider's calls in turn); us,\n"
    "wall time per call over blocks of calls with one synchronize (host cases); MiB, the allocator's peak in one\n"
    "fwd_bwd beyond the inputs (memory cases). fwd_bwd takes fresh gradients (torch.autograd.grad).\n"
    f"x peer: peer / {OURS} (above 1: {OURS} is faster or smaller). sdpa-cudnn: cuDNN SDPA on contiguous\n"
    f"(B, H, N, D) copies; sdpa-cudnn-view: cuDNN SDPA on {OURS}'s own tensors seen as (B, H, N, D); flex:\n"
    "FlexAttention compiled for the shape, the case's block mask; sdpa: SDPA's own choice (CPU runs)"
)


def _rate(x: float) -> str:
    return f"{x:.2f}" if x >= 0.1 else f"{x:.2g}"  # a CPU's are thousandths


def format_decode_table(results: list[Result]) -> str:
    """The decode suite's table: a row per case and provider that ran, ours first: device ms, TB/s, host us per call,
    and on a peer's row its ratios to ours (peer / ours: device time, host time)."""
    ours = {r.case: r for r in results if r.provider == OURS}
    header = f"{'case':<45}{'provider':<13}{'ms':>10}{'TB/s':>8}{'host us':>9}{'x ms':>7}{'x host':>7}{'max err':>9}"
    lines = [header]
    for case in dict.fromkeys(r.case for r in results):
        rows = sorted((r for r in results if r.case == case and r.ms), key=lambda r: r.provider != OURS)
        for r in rows:
            ratios = ours[case].ratios.get(r.provider, {}) if case in ours and r.provider != OURS else {}
            x_ms, x_host = (f"{ratios[m]:.2f}" if m in ratios else "-" for m in ("fwd", "host"))
            row = f"{case.name:<45}{r.provider:<13}{r.ms['fwd']:>10.4f}{_rate(r.tb_per_s['fwd']):>8}"
            lines.append(row + f"{r.ms['host'] * 1e3:>9.1f}{x_ms:>7}{x_host:>7}{r.max_error:>9.1e}")
    return "\n".join(lines)


DECODE_LEGEND = (
    "ms: device time per call (median; on a GPU L2 flushed by a read before each call and the GPU kept ahead of the\n"
    "host, so that the kernels alone are timed; every provider's calls in turn); TB/s: the bytes of K and V attended\n"
    "(2 * B * L * H_KV * D * itemsize) / ms; host us: wall time per call over blocks of calls with one synchronize;\n"
    f"x ms, x host: peer / {OURS} (above 1: {OURS} is faster). q4 cases are causal, aligned bottom-right. sdpa-cudnn\n"
    "and sdpa-flash (SDPA pinned to cuDNN or FlashAttention-2, enable_gqa) and flex (FlexAttention compiled for the\n"
    "shape) read contiguous (B, H_KV, L, D) copies of the cache, paged cases too; sdpa: SDPA's own choice (CPU runs)"
)


def skipped_lines(skipped: dict[str, str]) -> list[str]:
    """One line per reason: the cases of the suite's table not run."""
    names: dict[str, list[str]] = {}
    for name, why in skipped.items():
        names.setdefault(why, []).append(name)
    return [f"skipped: {', '.join(cases)}: {why}" for why, cases in names.items()]


def first_calls(results: list[Result], call: str = "first fwd+bwd call") -> str:
    """Each provider's slowest first ``call`` (compile included) over the cases, on one line."""
    timed = [r for r in results if r.first_call_s is not None]
    slowest = {
        p: max((r for r in timed if r.provider == p), key=lambda r: r.first_call_s)
        for p in dict.fromkeys(r.provider for r in timed)
    }
    parts = [f"{p} {r.first_call_s:.2f} s ({r.case.name})" for p, r in slowest.items()]
    return f"{call}, JIT compile included, slowest case: " + (", ".join(parts) or "none ran")


def unavailable_lines(results: list[Result]) -> list[str]:
    """One line per provider and reason: the cases it could not run."""
    cases = {r.case for r in results}
    missed: dict[tuple[str, str], list[str]] = {}
    for r in results:
        if r.unavailable:
            missed.setdefault((r.provider, r.unavailable), []).append(r.case.name)
    return [
        f"unavailable: {provider} on {f'all {len(names)} cases' if len(names) == len(cases) > 1 else ', '.join(names)}"
        f": {why}"
        for (provider, why), names in missed.items()
    ]


def plot(records: list[dict], modes, path: str, title: str) -> None:
    """One PNG: a grid of TFLOP/s-against-seqlen panels, a row per (head dim, causal), a column per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["case"]["head_dim"], r["case"]["causal"]) for r in records})
    providers = list(dict.fromkeys(r["provider"] for r in records))
    size = (4.2 * len(modes), 3.0 * len(groups))
    fig, axes = plt.subplots(len(groups), len(modes), figsize=size, squeeze=False, sharex=True, layout="constrained")
    for (head_dim, causal), row in zip(groups, axes, strict=True):
        for mode, ax in zip(modes, row, strict=True):
            for provider in providers:
                pts = sorted(
                    (r["case"]["seqlen"], r["tflops"][mode])
                    for r in records
                    if r["provider"] == provider
                    and (r["case"]["head_dim"], r["case"]["causal"]) == (head_dim, causal)
                    and mode in r["tflops"]
                )
                if pts:
                    width = 2.5 if provider == OURS else 1
                    ax.plot(*zip(*pts, strict=True), marker="o", markersize=3, label=provider, linewidth=width)
            ax.set_xscale("log", base=2)
            ax.set_title(f"d{head_dim}{' causal' if causal else ''} {mode}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=7)
        row[0].set_ylabel("TFLOP/s")
    for ax in axes[-1]:
        ax.set_xlabel("sequence length")
    handles: dict[str, object] = {}  # one legend for the figure: every provider drawn in any panel
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    if handles:  # none where no provider ran (every one unavailable on this machine)
        fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncol=len(handles), fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
