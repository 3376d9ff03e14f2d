"""``flashtriton bench``'s options and run: the sweep's cases, then each case timed and written, then the plot
and the table."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from .cases import MODES, Case, attach_ratios
from .progress import case_weights, progress
from .providers import GPU_ONLY, PROVIDERS
from .results import DEFINITIONS, SCHEMA, environment, resumable, write_json
from .summary import TABLE_LEGEND, first_calls, format_table, plot, unavailable_lines
from .timing import TIMING, run_case

TOKENS, HIDDEN = 16384, 2048  # the FlashAttention-2 paper's sweep: batch * seqlen and heads * headdim
CUDA_HEAD_DIMS = (64, 128, 256)
CUDA_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
CPU_SEQLENS = (512, 1024, 2048)  # kept short on a CPU: a case's time grows as N^2
CPU_BATCH, CPU_HEADS = 1, 4


def default_cases(device: torch.device, head_dims, seqlens, causal_options, dtype) -> list[Case]:
    if device.type != "cuda":
        return [Case(CPU_BATCH, n, CPU_HEADS, d, c, dtype) for d in head_dims for c in causal_options for n in seqlens]
    return [
        Case(max(1, TOKENS // n), n, HIDDEN // d, d, c, dtype)
        for d in head_dims
        for c in causal_options
        for n in seqlens
    ]


def sweep_choices(args: argparse.Namespace, device: torch.device) -> tuple[list[int], list[int], str, list[str]]:
    """(head dims, lengths, dtype) to run: those given on the command line, else the device's defaults (--quick:
    one of each); and a note naming each CPU default that differs from the GPU sweep, so none is chosen silently."""
    cuda = device.type == "cuda"
    quick = args.quick
    head_dims = args.head_dims or ([128] if quick and cuda else list(CUDA_HEAD_DIMS) if cuda else [64])
    seqlens = args.seqlens or ([4096 if cuda else 1024] if quick else list(CUDA_SEQLENS if cuda else CPU_SEQLENS))
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    notes = []
    if not cuda:
        chosen = [
            f"head dim {head_dims[0]} (--head-dims)" * (args.head_dims is None),
            "float32 (--dtype)" * (args.dtype is None),
            f"lengths {' '.join(map(str, seqlens))} (--seqlens)" * (args.seqlens is None),
        ]
        if any(chosen):
            notes.append(
                f"no CUDA GPU: a CPU run of batch {CPU_BATCH}, {CPU_HEADS} heads, "
                f"{', '.join(c for c in chosen if c)}; the flags in brackets choose others"
            )
        gpu_only = [p for p in (args.providers or PROVIDERS) if p in GPU_ONLY]
        if gpu_only:
            notes.append(f"no CUDA GPU: {', '.join(gpu_only)} will be reported unavailable")
    return head_dims, seqlens, dtype, notes


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench's options (``flashtriton bench`` and ``flashtriton demo``)."""
    parser.add_argument(
        "--quick", action="store_true", help="one head dim and one length unless given (what `demo` runs)"
    )
    parser.add_argument(
        "--head-dims", type=int, nargs="+", help="default 64 128 256 (CPU: 64; --quick: 128 on a GPU, 64 on a CPU)"
    )
    parser.add_argument(
        "--seqlens", type=int, nargs="+", help="default 512 to 16384 (CPU: 512 1024 2048; --quick: 4096, CPU 1024)"
    )
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], help="default bfloat16 (CPU: float32)")
    parser.add_argument(
        "--providers",
        nargs="+",
        choices=list(PROVIDERS),
        metavar="PROVIDER",
        help=f"any of {', '.join(PROVIDERS)} (default: all)",
    )
    parser.add_argument(
        "--rounds", type=_at_least_one, default=3, help="timing rounds per case, the provider order rotated (default 3)"
    )
    parser.add_argument("--out", default="bench-out", help="folder for results.json and bench.png (default bench-out)")
    parser.add_argument("--no-plots", action="store_true", help="do not draw bench.png")
    parser.add_argument(
        "--resume", metavar="RESULTS_JSON", help="continue a run cut short: keep its finished cases, measure the rest"
    )


PLOT_NEEDS = "matplotlib is not installed: pip install 'flashtriton[bench]' adds it"


def run(args: argparse.Namespace) -> int:
    """The sweep ``add_arguments``' options describe: results.json after every case, then the plot and the table."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    providers = args.providers or list(PROVIDERS)
    head_dims, seqlens, dtype, notes = sweep_choices(args, device)
    causal_options = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    cases = default_cases(device, head_dims, seqlens, causal_options, dtype)

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    json_path = str(out / "results.json")
    plot_path, plot_skipped = str(out / "bench.png"), None
    if args.no_plots:
        plot_skipped = "--no-plots"
    elif importlib.util.find_spec("matplotlib") is None:
        plot_skipped = PLOT_NEEDS
        notes.append(f"the plot will be skipped ({PLOT_NEEDS}); the table and results.json still come out")
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"writing {json_path} after every case", file=sys.stderr)

    env = environment()
    header = {"schema": SCHEMA, "definitions": DEFINITIONS, "environment": env, "device": str(device)}
    header["sweep"] = {
        "modes": args.modes, "providers": providers, "dtype": dtype, "rounds": args.rounds, "timing": TIMING,
    }  # fmt: skip
    results = []
    if args.resume:
        header["resumed_environment"], results = resumable(args.resume, env, header["sweep"], cases)
    todo = [c for c in cases if c not in {r.case for r in results}]
    for case in progress(todo, case_weights(todo, device)):
        results += run_case(case, providers, device, args.modes, args.rounds)
        attach_ratios(results)
        write_json(json_path, header, results, complete=False)
    results.sort(key=lambda r: (cases.index(r.case), providers.index(r.provider)))
    write_json(json_path, header, results, complete=True)
    if plot_skipped is None:
        source = env.get("commit", env["source_digest"])[:10]
        title = f"{env.get('gpu', device)}, {dtype}, flashtriton {source}"
        plot([asdict(r) for r in results], args.modes, plot_path, title)

    for line in unavailable_lines(results):
        print(line)
    print(format_table(results, args.modes))
    print(TABLE_LEGEND)
    print(first_calls(results))
    print(f"results: {json_path}")
    print(f"plot: {plot_path}" if plot_skipped is None else f"plot: skipped ({plot_skipped})")
    return 0
