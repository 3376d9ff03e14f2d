"""A table and a plot from a ``flashtriton bench --suite ring`` results.json.

    python benchmarks/ring_report.py benchmarks/results/<run>/bench-ring/results.json

writes the table (every case and provider: ms, TFLOP/s per GPU, per-GPU efficiency against the ring on one GPU at
the same tokens per GPU, peak memory) to ``README.md`` next to the JSON, and the weak-scaling plot to ``ring.png``
there (needs matplotlib: the ``[bench]`` extra). Both are generated: edit this script, not them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

NAMES = {"ring": "ring", "ulysses": "Ulysses", "torch-cp": "torch context_parallel + SDPA"}


def _group(case: dict) -> tuple:
    """The weak-scaling series a case belongs to: everything but its world size."""
    return case["ragged"], case["tokens"], case["heads"], case["heads_k"], case["head_dim"]


def _series_name(group: tuple) -> str:
    ragged, tokens, heads, heads_k, head_dim = group
    tokens = f"{tokens // 1024}k" if tokens >= 1024 else str(tokens)
    heads = f"H{heads}" if heads == heads_k else f"GQA {heads}/{heads_k}"
    return f"{'ragged documents' if ragged else 'causal'}, {tokens} per GPU, {heads}, D={head_dim}"


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(payload: dict) -> str:
    lines = [
        "| series | world | provider | ms | TFLOP/s per GPU | efficiency | peak MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = sorted(payload["results"], key=lambda r: (_group(r["case"]), r["case"]["world"], r["provider"]))
    for r in rows:
        name, world, provider = _series_name(_group(r["case"])), r["case"]["world"], NAMES.get(r["provider"])
        if r.get("unavailable"):
            lines.append(f"| {name} | {world} | {provider} | unavailable: {r['unavailable']} | | | |")
            continue
        efficiency = None if r.get("efficiency") is None else f"{r['efficiency']:.1%}"
        lines.append(
            f"| {name} | {world} | {provider} | {_fmt(r['ms'], '.2f')} | {_fmt(r['tflops_per_gpu'], '.0f')} | "
            f"{efficiency or '-'} | {_fmt(r.get('peak_mib'), '.0f')} |"
        )
    return "\n".join(lines)


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({_group(r["case"]) for r in payload["results"]})
    rows = [[g for g in groups if g[0] == ragged] for ragged in (False, True)]
    rows = [row for row in rows if row]  # dense causal above, ragged documents below
    columns = max(len(row) for row in rows)
    fig, axes = plt.subplots(len(rows), columns, figsize=(3.6 * columns, 3.2 * len(rows)), sharey=True, squeeze=False)
    for ax_row, row in zip(axes, rows, strict=True):
        for ax in ax_row[len(row) :]:  # a row with fewer series than the other
            ax.set_visible(False)
        for ax, group in zip(ax_row, row, strict=False):
            for provider, label in NAMES.items():
                points = sorted(
                    (r["case"]["world"], r["efficiency"])
                    for r in payload["results"]
                    if _group(r["case"]) == group and r["provider"] == provider and r.get("efficiency") is not None
                )
                if points:
                    ax.plot([w for w, _ in points], [e * 100 for _, e in points], marker="o", label=label)
            ax.set_xticks(sorted({r["case"]["world"] for r in payload["results"] if _group(r["case"]) == group}))
            ax.set_title(_series_name(group), fontsize=8)
            ax.set_xlabel("GPUs")
            ax.grid(alpha=0.3)
        ax_row[0].set_ylabel("per-GPU efficiency, % of one GPU")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"fwd+bwd weak scaling, {payload['environment'].get('gpu', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results")
    args = parser.parse_args()
    path = Path(args.results)
    payload = json.loads(path.read_text())
    env = payload["environment"]
    note = (
        f"{env.get('gpu')}, torch {env.get('torch')}, triton {env.get('triton')}, world {payload['world']}, source "
        f"{str(env.get('commit', env.get('source_digest')))[:7]}. ms: median fwd+bwd per call of the slowest rank, "
        "providers' calls in turn; efficiency: per-GPU TFLOP/s against the ring on one GPU at the same tokens per GPU."
    )
    (path.parent / "README.md").write_text(f"# Ring suite\n\n{note}\n\n{table(payload)}\n")
    if importlib.util.find_spec("matplotlib") is None:
        print("ring.png: skipped (matplotlib is not installed: pip install 'flashtriton[bench]' adds it)")
    else:
        plot(payload, path.parent / "ring.png")


if __name__ == "__main__":
    main()
