"""Tables and a plot from a ``flashtriton bench --suite decode`` results.json.

    python benchmarks/decode_report.py benchmarks/results/<run>/bench-decode/results.json

writes the full table (every case and provider) to ``README.md`` next to the JSON, the bandwidth plot to
``decode.png`` there (needs matplotlib), and the headline table into the top-level README.md between the
``<!-- decode:begin -->`` and ``<!-- decode:end -->`` lines. All three are generated: edit this script, not them.
Ratios are peer time / flashtriton time (above 1: flashtriton is faster).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

OURS = "flashtriton"
PEERS = {"sdpa-cudnn": "cuDNN", "sdpa-flash": "FA2", "flex": "Flex"}
BEGIN, END = "<!-- decode:begin -->", "<!-- decode:end -->"
README = Path(__file__).resolve().parents[1] / "README.md"
LAYOUTS = {0: "contiguous", 16: "pages of 16", 256: "pages of 256"}


def _k(n: int) -> str:
    return f"{n // 1024}k"


def _cases(payload: dict) -> dict[tuple, dict[str, dict]]:
    """{(head_dim, seqlen_q, batch, cache_len, page_size): {provider: result}} of the measured cases."""
    cases: dict[tuple, dict[str, dict]] = {}
    for r in payload["results"]:
        c = r["case"]
        key = c["head_dim"], c["seqlen_q"], c["batch"], c["cache_len"], c["page_size"]
        if r.get("ms"):
            cases.setdefault(key, {})[r["provider"]] = r
    return cases


def _ratio(results: dict[str, dict], peer: str, mode: str = "fwd") -> str:
    value = results[OURS]["ratios"].get(peer, {}).get(mode)
    return "-" if value is None or value != value else f"{value:.2f}"


def full_table(payload: dict) -> str:
    peers = [p for p in PEERS if p in payload["sweep"]["providers"]]
    head = "| D | seqlen_q | B | cache | layout | ours TB/s | ours ms | ours host µs | " + " | ".join(
        f"x {PEERS[p]} (ms, host)" for p in peers
    )
    lines = [head + " |", "|" + "---|" * (6 + len(peers) + 2)]
    for (d, n_q, b, length, page), results in sorted(_cases(payload).items()):
        ours = results[OURS]
        ratios = " | ".join(f"{_ratio(results, p)}, {_ratio(results, p, 'host')}" for p in peers)
        lines.append(
            f"| {d} | {n_q} | {b} | {_k(length)} | {LAYOUTS[page]} | {ours['tb_per_s']['fwd']:.2f} | "
            f"{ours['ms']['fwd']:.4f} | {ours['ms']['host'] * 1000:.0f} | {ratios} |"
        )
    return "\n".join(lines)


def headline(payload: dict) -> str:
    """seqlen_q 1 at D=128 and D=64: our bandwidth and the device-time ratios to cuDNN per layout, to FA2, and the
    host time beside cuDNN's; then seqlen_q 4 (causal) against FlexAttention, the peer that takes the mask natively."""
    cases = _cases(payload)
    lines = [
        "| D | B | cache | ours TB/s | x cuDNN: contiguous / pages of 16 / 256 | x FA2 | host µs: ours / cuDNN |",
        "|---|---|---|---|---|---|---|",
    ]
    for d, b, length in sorted({(k[0], k[2], k[3]) for k in cases if k[1] == 1}, key=lambda x: (-x[0], x[1], x[2])):
        rows = {page: cases.get((d, 1, b, length, page)) for page in LAYOUTS}
        if rows[0] is None:
            continue
        ours, cudnn = rows[0][OURS], rows[0]["sdpa-cudnn"]
        layouts = " / ".join(_ratio(rows[p], "sdpa-cudnn") if rows[p] else "-" for p in LAYOUTS)
        lines.append(
            f"| {d} | {b} | {_k(length)} | {ours['tb_per_s']['fwd']:.2f} | {layouts} | {_ratio(rows[0], 'sdpa-flash')} "
            f"| {ours['ms']['host'] * 1000:.0f} / {cudnn['ms']['host'] * 1000:.0f} |"
        )
    flex = [r[OURS]["ratios"]["flex"]["fwd"] for k, r in cases.items() if k[1] == 4 and "flex" in r[OURS]["ratios"]]
    if flex:
        lines.append("")
        lines.append(
            f"seqlen_q 4, causal (aligned bottom-right): x Flex {min(flex):.2f} to {max(flex):.2f} over "
            f"{len(flex)} cases (SDPA takes that mask only as a dense tensor: see the full table)."
        )
    return "\n".join(lines)


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = _cases(payload)
    batches = sorted({k[2] for k in cases})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 3.6), sharey=True, squeeze=False)
    axes = axes[0]  # one row, however many batches
    for ax, b in zip(axes, batches, strict=True):
        lengths = sorted({k[3] for k in cases if k[2] == b and (128, 1, b, k[3], 0) in cases})
        lines = [(OURS, 0, "flashtriton"), (OURS, 16, "flashtriton, pages of 16")]
        lines += [(p, 0, name) for p, name in PEERS.items()]
        for provider, page, label in lines:
            values = [cases[(128, 1, b, n, page)].get(provider) for n in lengths]
            tbs = [v["tb_per_s"]["fwd"] if v else float("nan") for v in values]
            ax.plot(lengths, tbs, marker="o", label=label, linestyle="--" if page else "-")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [_k(n) for n in lengths])
        ax.set_title(f"B={b}, 32/8 heads, D=128, seqlen_q 1")
        ax.set_xlabel("cache length")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("TB/s of K and V read (eager call)")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"flash_attn_with_kvcache, {payload['environment'].get('gpu', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results")
    args = parser.parse_args()
    path = Path(args.results)
    payload = json.loads(path.read_text())
    env = payload["environment"]
    if payload["sweep"].get("timing") == "in turn, ahead":
        flush = "L2 flushed by a read before each call and the GPU kept ahead of the host by a spin (the kernels alone)"
    else:
        flush = "L2 flushed before each call (a call whose host time exceeds its kernels' shows its host time)"
    note = (
        f"{env.get('gpu')}, torch {env.get('torch')}, triton {env.get('triton')}, {payload['sweep']['dtype']}; "
        f"source digest {env.get('source_digest')}. Device ms: median per call, {flush}, the providers' calls in "
        "turn; host µs: wall clock per call over blocks of calls."
    )
    (path.parent / "README.md").write_text(f"# Decode suite\n\n{note}\n\n{full_table(payload)}\n")
    plot(payload, path.parent / "decode.png")
    text = README.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    README.write_text(text[:start] + "\n" + headline(payload) + "\n" + text[end:])


if __name__ == "__main__":
    main()
