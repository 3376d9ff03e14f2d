"""Two builds of flashtriton over the bench's whole sweep, call for call on one GPU: the no-regression check.

    python benchmarks/ab_sweep.py prepare BASE_COMMIT
    PYTHONPATH=src:ab-base python benchmarks/ab_sweep.py run --head-dims 64 --out ab_d64.json

``prepare`` (in a clone, no GPU needed) writes BASE_COMMIT's package to ``ab-base/flashtriton_base`` (ignored by
git through .git/info/exclude): the package renamed, and its torch custom ops moved to the ``flashtriton_base``
namespace, so that both builds import and register side by side. It then imports both in one process and checks
that a tiny call through the PyTorch path gives the same outputs and gradients. Carry ``ab-base`` to the GPU
machine with the working tree, whose ``src`` is the head build.

``run`` times both builds' ``flash_attn_func`` on each case of the sweep (bf16, B * N = 16k tokens, H * D = 2048,
N = 512..16k, causal and not) in each mode (``fwd``: an inference call, as the bench's; ``fwd_bwd``: forward and
fresh gradients of q, k, v by ``torch.autograd.grad``; on request ``fwd_train``: a training call's forward alone,
which writes the LSE), two ways: eager calls, each after an L2 flush with events
around it (the bench's timing, host time included), and CUDA-graph replays (the kernels alone), each build
captured ``--captures`` times: one capture's memory placement alone moves its replays by up to about 1.5%, so a
round's replay time is the median over the captures. The builds' calls are taken in turn (benchmarks/ab.py), over
``--rounds`` rounds; each time is the median of its rounds. It reports base ms, head ms, head / base (below 1: head
is faster) and the rounds' spread, and flags every case-mode whose ratio exceeds 1 + ``--tolerance`` in either
column. The JSON is rewritten after every case-mode; the table is printed last. At the defaults one head dim is
about 200 s of timed calls (24 case-modes x 2 builds x 7 rounds x 150 ms, eager and three captures) plus compiles,
graph captures and flushes: one device call per head dim.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "src/flashtriton"
BASE_DIR = REPO / "ab-base"
BASE_NAME = "flashtriton_base"
MODES = ("fwd", "fwd_bwd")
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
REPLAY_MS = 2.0  # a graph holds calls up to about this long (ab.REPS at most), so short calls are not all launch

# Where the package's own name appears in code: imports, the torch custom-op namespace, module paths in strings.
# (``import flashtriton.x`` is left as it is: prepare's check then finds the base copy importing the head.)
_RENAMES = (
    (re.compile(r"^(\s*from\s+)flashtriton\b", re.M), rf"\g<1>{BASE_NAME}"),
    (re.compile(r"^(\s*import\s+)flashtriton(\s*)$", re.M), rf"\g<1>{BASE_NAME} as flashtriton\g<2>"),
    (re.compile(r"""(["'])flashtriton(::|\.)"""), rf"\g<1>{BASE_NAME}\g<2>"),
    (re.compile(r"\btorch\.ops\.flashtriton\b"), f"torch.ops.{BASE_NAME}"),
)
_OP = re.compile(rf"""["']{BASE_NAME}::(\w+)["']""")

# Run in a fresh process by prepare: both builds side by side, on the CPU, through the PyTorch path.
_CHECK = """
import importlib, json, pkgutil, sys
import torch
import {base} as base
for info in pkgutil.walk_packages(base.__path__, "{base}."):
    importlib.import_module(info.name)
leaked = sorted(n for n in sys.modules if n == "flashtriton" or n.startswith("flashtriton."))
assert not leaked, f"the base copy imports the head package: {{leaked}}"
for op in json.loads(sys.argv[1]):
    getattr(torch.ops.{base}, op)
import flashtriton as head
assert head.__file__ != base.__file__
torch.manual_seed(0)
q, k, v = (torch.randn(2, 67, 4, 32, requires_grad=True) for _ in range(3))
results = []
for lib in (base, head):
    out = lib.flash_attn_func(q, k, v, causal=True)
    results.append((out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))))
diff = max((a - b).abs().max().item() for a, b in zip(*results))
print(f"both builds import side by side; a tiny causal fwd+bwd on the CPU path differs by {{diff:.1e}}")
assert diff <= 1e-5, diff
"""


def source_digest(package: Path) -> str:
    """flashtriton's source digest (sha256 over its .py files, as the bench and report.py take it)."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _git(*args: str) -> str:
    return subprocess.check_output(["git", "-C", str(REPO), *args], text=True).strip()


def _exclude(entry: str) -> None:
    """entry in the checkout's .git/info/exclude (ignored by this clone only; .gitignore is left alone)."""
    path = Path(_git("rev-parse", "--path-format=absolute", "--git-path", "info/exclude"))
    lines = path.read_text().splitlines() if path.exists() else []
    if entry not in lines:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join([*lines, entry]) + "\n")


def prepare(base: str, check: bool = True) -> None:
    commit = _git("rev-parse", "--verify", f"{base}^{{commit}}")
    archive = subprocess.check_output(["git", "-C", str(REPO), "archive", "--format=tar", commit, PACKAGE])
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        package = Path(tmp) / PACKAGE
        digest = source_digest(package)
        shutil.rmtree(BASE_DIR, ignore_errors=True)
        BASE_DIR.mkdir()
        shutil.move(package, BASE_DIR / BASE_NAME)
    ops = set()
    for path in (BASE_DIR / BASE_NAME).rglob("*.py"):
        text = path.read_text()
        for pattern, replacement in _RENAMES:
            text = pattern.sub(replacement, text)
        ops.update(_OP.findall(text))
        path.write_text(text)
    subject = _git("log", "-1", "--format=%s", commit)
    (BASE_DIR / "BASE.json").write_text(
        json.dumps({"commit": commit, "subject": subject, "source_digest": digest, "ops": sorted(ops)}, indent=1)
    )
    _exclude("/ab-base/")
    print(f"wrote {BASE_DIR / BASE_NAME}: {commit[:10]} ({subject}), source digest {digest}, ops {sorted(ops)}")
    if check:
        env = {"PYTHONPATH": f"{REPO / 'src'}:{BASE_DIR}", "FLASHTRITON_BACKEND": "torch"}
        command = [sys.executable, "-c", _CHECK.format(base=BASE_NAME), json.dumps(sorted(ops))]
        subprocess.run(command, check=True, env={**os.environ, **env})


# --- run: on the GPU machine ---------------------------------------------------------------------------------------


def _builds():
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(
            "ab_sweep.py run times the builds on a CUDA GPU, and this machine has none (prepare runs anywhere)"
        )
    try:
        base = importlib.import_module(BASE_NAME)
    except ImportError:
        raise SystemExit(
            f"no {BASE_NAME} to import: run `python benchmarks/ab_sweep.py prepare BASE_COMMIT` in the clone, carry "
            "ab-base to this machine and run with PYTHONPATH=src:ab-base"
        ) from None
    import flashtriton as head

    if Path(head.__file__).resolve().parent != (REPO / PACKAGE).resolve():
        print(f"note: the head build is {Path(head.__file__).parent}, not this checkout's {PACKAGE}", file=sys.stderr)
    return base, head


def _flag(ratio: float | None, tolerance: float) -> bool:
    return ratio is not None and ratio > 1 + tolerance


def _summary(rounds: dict[str, list[float]]) -> dict:
    """base and head ms (medians of the rounds), head / base, each round's ratio and the rounds' spread (the larger
    build's max / min - 1)."""
    base, head = statistics.median(rounds["base"]), statistics.median(rounds["head"])
    spread = max(max(r) / min(r) - 1 for r in rounds.values())
    per_round = [h / b for b, h in zip(rounds["base"], rounds["head"], strict=True)]
    return {"base_ms": base, "head_ms": head, "ratio": head / base, "spread": spread, "round_ratios": per_round,
            "base_rounds": rounds["base"], "head_rounds": rounds["head"]}  # fmt: skip


def _difference(a, b) -> float:
    """max |a - b| over the outputs, relative to the largest |a|."""
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if x is not None] if isinstance(a, tuple) else [(a, b)]
    return max(((x.float() - y.float()).abs().max() / x.float().abs().max().clamp_min(1e-30)).item() for x, y in pairs)


def measure(
    builds, head_dim: int, seqlen: int, causal: bool, mode: str, rounds: int, round_ms: float, captures: int = 3
) -> dict:
    import ab
    import torch

    q, k, v = ab.paper_case(head_dim, seqlen)
    grad = torch.randn_like(q.detach())

    def call(lib):
        if mode == "fwd":
            return torch.no_grad()(lambda: lib.flash_attn_func(q, k, v, causal=causal))
        if mode == "fwd_train":  # (out, lse, None): the difference covers the LSE
            return lambda: lib.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        return lambda: torch.autograd.grad(lib.flash_attn_func(q, k, v, causal=causal), (q, k, v), grad)

    calls = {"base": call(builds[0]), "head": call(builds[1])}
    first = {name: fn() for name, fn in calls.items()}  # compiles, records plans
    row = {"head_dim": head_dim, "seqlen": seqlen, "batch": q.shape[0], "heads": q.shape[2], "causal": causal,
           "mode": mode, "difference": _difference(first["base"], first["head"])}  # fmt: skip
    del first
    eager = ab.in_turn(calls, rounds, ab.passes_for(calls, round_ms, flush=True), flush=True)
    row["eager"] = _summary(eager)
    try:
        call_ms = max(statistics.median(t) for t in eager.values())
        reps = max(1, min(ab.REPS, int(REPLAY_MS / call_ms)))
        # each capture has its own memory pool, whose placement alone moves a replay by up to about 1.5%: a build's
        # round is the median over its captures
        graphs = {(name, c): ab.capture(fn, reps)[0] for name, fn in calls.items() for c in range(captures)}
        replays = {key: graph.replay for key, graph in graphs.items()}
        passes = ab.passes_for(replays, round_ms, per_call=reps)
        times = ab.in_turn(replays, rounds, passes, per_call=reps)
        merged = {name: [statistics.median(times[name, c][r] for c in range(captures)) for r in range(rounds)]
                  for name in calls}  # fmt: skip
        per_capture = {name: [statistics.median(times[name, c]) for c in range(captures)] for name in calls}
        row["replay"] = {**_summary(merged), "calls_per_graph": reps, "captures_ms": per_capture}
    except Exception as exc:  # a build that cannot be captured still has its eager column
        row["replay"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
    del calls
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return row


def _header(args, base, head) -> dict:
    import torch
    import triton

    info = json.loads((Path(base.__file__).parents[1] / "BASE.json").read_text())
    head_dir = Path(head.__file__).parent
    header = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "base": info,
        "head": {"source_digest": source_digest(head_dir), "path": str(head_dir)},
        "command": sys.argv,
        "rounds": args.rounds,
        "round_ms": args.round_ms,
        "captures": args.captures,
        "tolerance": args.tolerance,
        "definitions": {
            "ratio": "head ms / base ms: above 1, the head build is slower",
            "eager": "each call after an L2 flush, CUDA events around it, the builds' calls in turn (host time "
            "included, as flashtriton bench times); ms is the median over the rounds of each round's median call",
            "replay": "CUDA-graph replays of calls_per_graph calls, taken in turn as the eager calls, no flush; "
            "each build captured ``captures`` times (placement: a capture's own memory pool moves it by up to about "
            "1.5%), a round's time the median over its captures; captures_ms: each capture's median",
            "spread": "max / min - 1 of a build's round medians, the larger of the two builds'",
            "difference": "max |head - base| / max |base| of the first call's output (fwd), output and LSE "
            "(fwd_train) or gradients (fwd_bwd); the fused Hopper backward adds dq up in no fixed order, so its last "
            "bits differ even within one build",
        },
    }
    try:
        header["head"]["commit"] = _git("rev-parse", "HEAD")
        header["head"]["uncommitted"] = _git("status", "--porcelain", "--", PACKAGE).splitlines()
    except (subprocess.CalledProcessError, FileNotFoundError):
        pass  # a copy without git metadata: the digest names the source
    return header


def _cell(summary: dict) -> str:
    """37 characters: base ms, head ms, head / base, spread; or the error."""
    if "error" in summary:
        return f"{summary['error'][:36]:>37}"
    ms = f"{summary['base_ms']:>9.4f}{summary['head_ms']:>9.4f}{summary['ratio']:>10.4f}"
    spread = f"{100 * summary['spread']:.2f}%" if summary["spread"] < 10 else ">999%"
    return ms + f"{spread:>9}"


def table(rows: list[dict], tolerance: float) -> str:
    head = f"{'case':<22}{'mode':<9}"
    columns = f"{'base ms':>9}{'head ms':>9}{'head/base':>10}{'spread':>9}"
    lines = [f"{'':<31}{'eager (L2 flushed)':^37} | {'CUDA-graph replay':^37}", head + columns + " | " + columns]
    for r in rows:
        case = f"d{r['head_dim']}{' causal' if r['causal'] else ''} N={r['seqlen']}"
        flags = [name for name in ("eager", "replay") if _flag(r[name].get("ratio"), tolerance)]
        mark = f"  over {1 + tolerance:.2f}: {', '.join(flags)}" if flags else ""
        lines.append(f"{case:<22}{r['mode']:<9}{_cell(r['eager'])} | {_cell(r['replay'])}{mark}")
    return "\n".join(lines)


def run(args) -> int:
    import ab
    import torch

    builds = _builds()
    header = _header(args, *builds)
    print(f"base {header['base']['commit'][:10]} against head {header['head']['source_digest']} on "
          f"{torch.cuda.get_device_name()}", file=sys.stderr)  # fmt: skip
    cases = [(d, n, c) for d in args.head_dims for c in (False, True) for n in args.seqlens]
    rows, start = [], time.perf_counter()
    for i, (head_dim, seqlen, causal) in enumerate(cases, 1):
        for mode in args.modes:
            rows.append(measure(builds, head_dim, seqlen, causal, mode, args.rounds, args.round_ms, args.captures))
            over = [r for r in rows if any(_flag(r[n].get("ratio"), args.tolerance) for n in ("eager", "replay"))]
            ab.save(args.out, rows, **header, over_tolerance=[(r["head_dim"], r["seqlen"], r["causal"], r["mode"])
                                                               for r in over])  # fmt: skip
            last = rows[-1]
            print(f"[{i}/{len(cases)} {time.perf_counter() - start:5.0f}s] d{head_dim} N={seqlen} causal={causal} "
                  f"{mode}: eager {last['eager']['ratio']:.4f}, replay {last['replay'].get('ratio', float('nan')):.4f}",
                  file=sys.stderr, flush=True)  # fmt: skip
    print(table(rows, args.tolerance))
    for name in ("eager", "replay"):
        measured = [r for r in rows if "ratio" in r[name]]
        if measured:
            worst = max(measured, key=lambda r: r[name]["ratio"])
            print(f"worst {name} head/base {worst[name]['ratio']:.4f}: d{worst['head_dim']} N={worst['seqlen']} "
                  f"causal={worst['causal']} {worst['mode']}")  # fmt: skip
    over = sum(any(_flag(r[n].get("ratio"), args.tolerance) for n in ("eager", "replay")) for r in rows)
    print(f"{over} of {len(rows)} case-modes over {1 + args.tolerance:.2f} x base; wrote {args.out}")
    return 0


def main(argv=None) -> int:
    from flashtriton.bench.cli import positive_int  # here, not at the top: the helpers import without torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="write ab-base/flashtriton_base from a commit (runs anywhere)")
    p.add_argument("base", help="the base commit (the one before the change under test)")
    p.add_argument("--no-check", action="store_true", help="skip importing both builds and the tiny CPU call")
    r = sub.add_parser("run", help="time both builds over the sweep (needs a CUDA GPU and PYTHONPATH=src:ab-base)")
    r.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256], help="one per call keeps it short")
    r.add_argument("--seqlens", type=int, nargs="+", default=list(SEQLENS))
    r.add_argument("--modes", nargs="+", choices=(*MODES, "fwd_train"), default=list(MODES))
    r.add_argument("--rounds", type=int, default=7, help="rounds per timing; times are their medians (default 7)")
    r.add_argument("--round-ms", type=float, default=150.0, help="each build's calls per round, in ms (default 150)")
    r.add_argument(
        "--captures", type=positive_int, default=3, help="graphs captured per build for the replays (default 3)"
    )
    r.add_argument("--tolerance", type=float, default=0.01, help="flag head/base above 1 + this (default 0.01)")
    r.add_argument("--out", default="ab_sweep.json", help="JSON written after every case-mode")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(args.base, check=not args.no_check)
        return 0
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
