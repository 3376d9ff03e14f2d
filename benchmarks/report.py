"""Tables from a ``flashtriton bench`` results.json.

    python benchmarks/report.py benchmarks/results/<run>/results.json

writes the full table (every case, mode and peer) to ``<run>/README.md`` next to the JSON, and the
headline table (ratios against SDPA's cuDNN backend and FlexAttention) into the top-level README.md
between the ``<!-- bench:begin -->`` and ``<!-- bench:end -->`` lines. Both are generated: edit
this script, not the tables. Ratios are peer time / flashtriton time (above 1: flashtriton is faster).
The measured source is named by the commit of this checkout that holds the run's source digest, where there is
one (a device's copy of the checkout can carry stale git metadata). Needs only the standard library and git.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
from pathlib import Path, PurePosixPath

OURS = "flashtriton"
HEADLINE_PEERS = {"sdpa-cudnn": "cuDNN", "flex": "Flex"}
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
REPO = Path(__file__).resolve().parents[1]
PACKAGE = "src/flashtriton"
RESUMED = " (continued with `--resume` after a device time limit cut it short)"


def _group_name(case: dict) -> str:
    return f"d{case['head_dim']}{' causal' if case['causal'] else ''}"


def _case_name(case: dict) -> str:
    return f"{_group_name(case)} N={case['seqlen']}"


def _kilo(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _ratio(x: float | None) -> str:
    return f"{x:.2f}" if x is not None else "-"


def _ours(payload: dict) -> list[dict]:
    return [r for r in payload["results"] if r["provider"] == OURS and not r["unavailable"]]


def _git(*args: str) -> bytes | None:
    try:
        return subprocess.check_output(["git", "-C", str(REPO), *args], stderr=subprocess.DEVNULL)
    except (subprocess.CalledProcessError, FileNotFoundError):
        return None


def package_digest(commit: str, blobs: dict[str, bytes] | None = None) -> str | None:
    """flashtriton.bench's source digest of the package as committed at ``commit``: the same files (every .py below
    src/flashtriton), order (by path, as pathlib sorts) and hashing. ``blobs`` caches file contents by blob id."""
    listing = _git("ls-tree", "-r", "-z", commit, "--", PACKAGE)
    if listing is None:
        return None
    files = {}
    for line in filter(None, listing.decode().split("\0")):
        meta, path = line.split("\t", 1)
        if path.endswith(".py"):
            files[PurePosixPath(path).relative_to(PACKAGE)] = meta.split()[2]
    blobs = {} if blobs is None else blobs
    digest = hashlib.sha256()
    for path in sorted(files):
        blob = files[path]
        if blob not in blobs:
            blobs[blob] = _git("cat-file", "blob", blob) or b""
        digest.update(path.as_posix().encode() + b"\0" + blobs[blob] + b"\0")
    return digest.hexdigest()[:16]


def commit_of(digest: str, depth: int | None = None) -> tuple[str, str] | None:
    """(hash, subject) of the commit among this checkout's last ``depth`` (None: all of them) that introduced the
    package source with ``digest`` (the oldest of the newest run of commits that hold it), or None. A device's copy of
    the checkout can carry stale git metadata, so the run's own commit field may name an older commit plus
    "uncommitted" changes."""
    log = _git("log", *([f"-n{depth}"] if depth else []), "--format=%H %s")
    blobs: dict[str, bytes] = {}
    found = None
    for line in (log or b"").decode().splitlines():
        commit, _, subject = line.partition(" ")
        if package_digest(commit, blobs) == digest:
            found = commit, subject
        elif found is not None:
            break
    return found


def _commit_name(env: dict) -> str:
    """The measured source in a few words: the commit that holds it, else the run's own commit field, else the
    digest (the headline's form; _source_line tells the whole story)."""
    found = commit_of(env["source_digest"]) if env.get("source_digest") else None
    if found is not None:
        return f"commit `{found[0][:10]}`"
    if env.get("commit"):
        return f"commit `{env['commit'][:10]}`" + (" plus uncommitted changes" if env.get("uncommitted") else "")
    return f"package source digest `{env.get('source_digest')}`"


def _source_line(env: dict) -> str:
    digest = env.get("source_digest")
    found = commit_of(digest) if digest else None
    if found is not None:
        state = f"commit `{found[0][:10]}` ({found[1]})"
        named = env.get("commit")
        if named and (env.get("uncommitted") or package_digest(named) != digest):
            label = f"`{named[:10]}`" + (" plus uncommitted changes" if env.get("uncommitted") else "")
            state += f", found by the source digest (the measuring checkout's git named {label})"
    elif env.get("commit"):
        state = f"commit `{env['commit'][:10]}` ({env.get('commit_subject')})"
        if env.get("uncommitted"):
            state += f" plus uncommitted changes to {', '.join(env['uncommitted'])}"
    else:
        state = "a working tree without git metadata"
    return f"{state}; package source digest `{digest}`" if digest else state


def _environment_line(payload: dict) -> str:
    env = payload["environment"]
    return (
        f"{env.get('gpu', payload['device'])}, driver {env.get('driver', '-')}, torch {env['torch']}, "
        f"triton {env.get('triton', '-')}, cuDNN {env.get('cudnn', '-')}, {payload['sweep']['dtype']}, "
        f"measured {env['date'][:10]}" + (", flashtriton's forward configs autotuned" if env.get("autotune") else "")
    )


def _rounds(payload: dict) -> str:
    sweep = payload["sweep"]
    rounds = sweep.get("rounds", 1)
    if rounds == 1:
        return ""
    if sweep.get("timing", "blocks") == "blocks":
        return f"; times are medians over {rounds} rounds, the providers' order rotated each round"
    return f"; times are medians over {rounds} rounds, each taking the providers' calls in turn"


def headline(payload: dict, run_link: str) -> str:
    """Per (head dim, causal, mode): our TFLOP/s at the longest sequence, ratios there and over the sweep; then the
    run's plot."""
    rows: dict[tuple, list[dict]] = {}
    for r in _ours(payload):
        case = r["case"]
        rows.setdefault((case["head_dim"], case["causal"]), []).append(r)
    peers = {p: name for p, name in HEADLINE_PEERS.items() if p in payload["sweep"]["providers"]}
    modes = payload["sweep"]["modes"]
    seqlens = sorted({r["case"]["seqlen"] for r in _ours(payload)})
    span = f"N={_kilo(seqlens[0])}..{_kilo(seqlens[-1])}"
    head = ["case", "mode", "TFLOP/s at longest N"]
    head += [f"x {name} at longest N" for name in peers.values()]
    head += [f"x {name}, {span}" for name in peers.values()]
    lines = [
        f"{_environment_line(payload)}; flashtriton at {_commit_name(payload['environment'])}.",
        f"Ratios are peer time / flashtriton time (above 1: flashtriton is faster){_rounds(payload)}. Full table, "
        f"plot and first-call compile times: [{run_link}]({run_link}). Generated by `benchmarks/report.py`.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for _, results in sorted(rows.items()):
        results.sort(key=lambda r: r["case"]["seqlen"])
        longest = results[-1]
        for mode in (m for m in modes if m in longest["tflops"]):
            cells = [_group_name(longest["case"]), mode.replace("_", "+")]
            cells.append(f"{longest['tflops'][mode]:.0f} (N={_kilo(longest['case']['seqlen'])})")
            cells += [_ratio(longest["ratios"].get(p, {}).get(mode)) for p in peers]
            for p in peers:
                values = [r["ratios"][p][mode] for r in results if mode in r["ratios"].get(p, {})]
                cells.append(f"{min(values):.2f}–{max(values):.2f}" if values else "-")
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"![TFLOP/s against sequence length, one panel per case, peers as lines]({run_link}/bench.png)"]
    return "\n".join(lines)


def full_report(payload: dict) -> str:
    env = payload["environment"]
    peers = [p for p in payload["sweep"]["providers"] if p != OURS]
    modes = payload["sweep"]["modes"]
    command = " ".join(["python -m flashtriton", *env["command"][1:]])
    lines = [
        f"# {env.get('gpu', payload['device'])}, {env['date'][:10]}",
        "",
        "Generated by `benchmarks/report.py` from `results.json` (the file explains its own fields);",
        "what was tried on the kernels, and what it measured, is in `benchmarks/DECISIONS.md`.",
        "",
        f"- {_environment_line(payload)}",
        f"- flashtriton: {_source_line(env)}",
        f"- `{command}`" + (RESUMED if "resumed_environment" in payload else ""),
        "- case: " + payload["definitions"]["case"],
        "- ratios: peer time / flashtriton time (above 1: flashtriton is faster); `-`: peer unavailable",
        "",
        "![TFLOP/s against sequence length](bench.png)",
        "",
        "## First call (JIT compile included), seconds",
        "",
    ]
    lines += _first_call_table(payload)
    head = ["case", "mode", "ms", "TFLOP/s", "max err", "peak MiB", *[f"x {p}" for p in peers]]
    lines += ["", "## Every case", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in _ours(payload):
        for mode in (m for m in modes if m in r["ms"]):
            memory = f"{r['peak_extra_mib']:.0f}" if r["peak_extra_mib"] is not None else "-"
            cells = [_case_name(r["case"]), mode, f"{r['ms'][mode]:.3f}", f"{r['tflops'][mode]:.1f}"]
            cells += [f"{r['max_error']:.1e}", memory]
            cells += [_ratio(r["ratios"].get(p, {}).get(mode)) for p in peers]
            lines.append("| " + " | ".join(cells) + " |")
    missing = [r for r in payload["results"] if r["unavailable"]]
    if missing:
        lines += ["", "## Unavailable", ""]
        reasons: dict[tuple[str, str], list[str]] = {}
        for r in missing:
            reasons.setdefault((r["provider"], r["unavailable"]), []).append(_case_name(r["case"]))
        every = len({_case_name(r["case"]) for r in payload["results"]})
        for (provider, why), cases in reasons.items():
            which = "every case" if len(cases) == every else f"{len(cases)} cases: {', '.join(cases)}"
            lines.append(f"- {provider}: {why} ({which})")
    return "\n".join(lines) + "\n"


def _first_call_table(payload: dict) -> list[str]:
    """Seconds of each JIT-compiled provider's first fwd+bwd: at the shortest seqlen of each (head dim,
    causal), where flashtriton compiles its kernels, and the longest over the other seqlens, where it
    reuses them (Flex is compiled for each shape, so it compiles there too)."""
    providers = [OURS, *(["flex"] if "flex" in payload["sweep"]["providers"] else [])]
    times: dict[tuple, dict[str, list[float]]] = {}
    for r in sorted(payload["results"], key=lambda r: r["case"]["seqlen"]):
        case = r["case"]
        if r["first_call_s"] is not None and r["provider"] in providers:
            per_provider = times.setdefault((case["head_dim"], case["causal"]), {})
            per_provider.setdefault(r["provider"], []).append(r["first_call_s"])
    head = [f"{p}, {which}" for p in providers for which in ("shortest N", "other N (max)")]
    lines = ["| case | " + " | ".join(head) + " |", "|" + "---|" * (len(head) + 1)]
    for (head_dim, causal), per_provider in sorted(times.items()):
        cells = []
        for p in providers:
            first, *rest = per_provider.get(p, [None])
            cells += [f"{first:.2f}" if first is not None else "-", f"{max(rest):.2f}" if rest else "-"]
        lines.append(f"| d{head_dim}{' causal' if causal else ''} | " + " | ".join(cells) + " |")
    return lines


def replace_between_markers(text: str, block: str) -> str:
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise SystemExit(f"README needs exactly one '{BEGIN}' line followed by one '{END}' line")
    before, rest = text.split(BEGIN)
    after = rest.split(END)[1]
    return f"{before}{BEGIN}\n{block}\n{END}{after}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="results.json written by `flashtriton bench`")
    parser.add_argument("--readme", type=Path, default=REPO / "README.md", help="README with the bench markers")
    args = parser.parse_args(argv)

    payload = json.loads(args.results.read_text())
    if not payload.get("complete"):
        raise SystemExit(f"{args.results} is from a run that was cut short: finish it with `bench --resume`")
    run_dir = args.results.parent
    (run_dir / "README.md").write_text(full_report(payload))
    run_link = Path(os.path.relpath(run_dir, args.readme.parent)).as_posix()
    readme = args.readme.read_text()
    args.readme.write_text(replace_between_markers(readme, headline(payload, run_link)))
    print(f"wrote {run_dir / 'README.md'} and the table in {args.readme}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
