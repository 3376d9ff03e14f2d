"""``flashtriton bench``'s options and run: the suite's cases (the paper sweep, or the users suite), then each case
measured and written, then the plot and the table."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import users
from .cases import MODES, Case, attach_ratios
from .progress import case_weights, progress
from .providers import GPU_ONLY, PROVIDERS
from .results import DEFINITIONS, SCHEMA, environment, resumable, write_json
from .summary import TABLE_LEGEND, USERS_LEGEND, first_calls, format_table, format_users_table, plot, unavailable_lines
from .timing import HOST_PASSES, TIMING, host_calls, run_case
from .users_calls import USERS_DEFINITIONS, USERS_GPU_ONLY, USERS_PROVIDERS, attach_users_ratios, run_user_case

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


@dataclass
class Suite:
    """What a run measures: its cases in table order, each case's providers, how a case is run and its ratios
    attached, the sweep's header, the definitions written beside the results, and notes for stderr."""

    cases: list
    providers_of: Callable[[object], list[str]]
    run_case: Callable[[object], list]
    attach: Callable[[list], None]
    sweep: dict
    definitions: dict
    notes: list[str]


def paper_suite(args: argparse.Namespace, device: torch.device) -> Suite:
    providers = args.providers or list(PROVIDERS)
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        raise SystemExit(f"--providers {' '.join(unknown)}: only in --suite users")
    head_dims, seqlens, dtype, notes = sweep_choices(args, device)
    causal_options = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    sweep = {"suite": "paper", "modes": args.modes, "providers": providers, "dtype": dtype, "rounds": args.rounds}
    return Suite(
        cases=default_cases(device, head_dims, seqlens, causal_options, dtype),
        providers_of=lambda case: providers,
        run_case=lambda case: run_case(case, providers, device, args.modes, args.rounds),
        attach=attach_ratios,
        sweep={**sweep, "timing": TIMING},
        definitions=DEFINITIONS,
        notes=notes,
    )


def users_suite(args: argparse.Namespace, device: torch.device) -> Suite:
    """The users suite (users.py): on a GPU its cases (--quick: the first of each group), on a CPU a tiny case of
    each group. Its shapes and modes are its own: the paper sweep's flags for them are refused."""
    paper_flags = {
        "--head-dims": args.head_dims, "--seqlens": args.seqlens,
        "--causal": args.causal != "both", "--modes": args.modes != list(MODES),
    }  # fmt: skip
    given = [flag for flag, value in paper_flags.items() if value]
    if given:
        raise SystemExit(f"--suite users chooses its own shapes and modes (flashtriton.bench.users): drop {given[0]}")
    cuda, notes = device.type == "cuda", []
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    cases = users.gpu_cases(dtype) if cuda else users.cpu_cases(dtype)
    cases = users.first_of_each_group(cases) if args.quick else cases
    outside = [p for p in args.providers or () if p not in USERS_PROVIDERS]  # `demo --suite users`: the paper's
    if outside:
        notes.append(f"not in the users suite, so not run: {', '.join(outside)}")
    chosen = [p for p in args.providers or USERS_PROVIDERS if p in USERS_PROVIDERS]
    if not cuda:
        unavailable = [p for p in chosen if p in USERS_GPU_ONLY]
        notes.append(f"no CUDA GPU: a tiny case of each users group, {dtype}")
        notes += [f"no CUDA GPU: {', '.join(unavailable)} will be reported unavailable"] if unavailable else []
    sweep = {"suite": "users", "modes": list(users.BOTH), "providers": chosen, "dtype": dtype, "rounds": args.rounds}
    sweep.update(timing=TIMING, host_calls=host_calls(device), host_passes=HOST_PASSES)

    def providers_of(case):
        return [p for p in case.providers if p in chosen]

    return Suite(
        cases=cases,
        providers_of=providers_of,
        run_case=lambda case: run_user_case(case, providers_of(case), device, args.rounds),
        attach=attach_users_ratios,
        sweep=sweep,
        definitions=USERS_DEFINITIONS,
        notes=notes,
    )


def part_of(cases: list, part: tuple[int, int] | None) -> list:
    """The K-th of N parts of the cases, in order: the cases of one (group, head dim, causal) stay together (a
    length and its whole-tile neighbour are timed in one run), each such unit in the part that holds its middle."""
    if part is None:
        return cases
    k, n = part
    chosen, start = [], 0
    for _, together in itertools.groupby(cases, key=lambda c: (getattr(c, "group", ""), c.head_dim, c.causal)):
        unit = list(together)
        if int((start + len(unit) / 2) * n / len(cases)) == k - 1:
            chosen += unit
        start += len(unit)
    return chosen


def _part(text: str) -> tuple[int, int]:
    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise argparse.ArgumentTypeError(f"expected K/N with 1 <= K <= N, such as 1/2; got {text!r}")
    return int(k), int(n)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench's options (``flashtriton bench`` and ``flashtriton demo``)."""
    parser.add_argument(
        "--suite",
        choices=["paper", "users"],
        default="paper",
        help="paper (default): the FlashAttention-2 paper's sweep; users: a model's layout, GQA, lengths inside a "
        "tile, ragged documents, short N, host time per call and peak memory, against cuDNN SDPA and FlexAttention "
        "(fwd and fwd+bwd with fresh gradients; no plot; the shape flags below are the paper sweep's)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one head dim and one length unless given (what `demo` runs); users: the first case of each group",
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
        choices=list(dict.fromkeys([*PROVIDERS, *USERS_PROVIDERS])),
        metavar="PROVIDER",
        help=f"any of {', '.join(dict.fromkeys([*PROVIDERS, *USERS_PROVIDERS]))} (default: all the suite's)",
    )
    parser.add_argument(
        "--rounds", type=_at_least_one, default=3, help="timing rounds per case, the provider order rotated (default 3)"
    )
    parser.add_argument("--out", default="bench-out", help="folder for results.json and bench.png (default bench-out)")
    parser.add_argument("--no-plots", action="store_true", help="do not draw bench.png")
    parser.add_argument(
        "--resume", metavar="RESULTS_JSON", help="continue a run cut short: keep its finished cases, measure the rest"
    )
    parser.add_argument(
        "--part",
        type=_part,
        metavar="K/N",
        help="measure the K-th of N parts of the suite's cases (each fits a shorter time limit); with --resume "
        "RESULTS_JSON of the other parts, into one results.json",
    )


PLOT_NEEDS = "matplotlib is not installed: pip install 'flashtriton[bench]' adds it"


def run(args: argparse.Namespace) -> int:
    """The suite ``add_arguments``' options describe: results.json after every case, then the plot (paper sweep)
    and the table."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    paper = args.suite == "paper"
    suite = paper_suite(args, device) if paper else users_suite(args, device)
    cases, notes = suite.cases, suite.notes

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    json_path = str(out / "results.json")
    plot_path, plot_skipped = str(out / "bench.png"), None
    if not paper:
        plot_skipped = "the users suite draws none"
    elif args.no_plots:
        plot_skipped = "--no-plots"
    elif importlib.util.find_spec("matplotlib") is None:
        plot_skipped = PLOT_NEEDS
        notes.append(f"the plot will be skipped ({PLOT_NEEDS}); the table and results.json still come out")
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"writing {json_path} after every case", file=sys.stderr)

    env = environment()
    header = {"schema": SCHEMA, "definitions": suite.definitions, "environment": env, "device": str(device)}
    header["sweep"] = suite.sweep
    if args.part:
        header["part"] = "/".join(map(str, args.part))
    results = []
    if args.resume:
        header["resumed_environment"], results = resumable(args.resume, env, suite.sweep, cases, suite.providers_of)
    todo = [c for c in part_of(cases, args.part) if c not in {r.case for r in results}]
    for case in progress(todo, case_weights(todo, device)):
        results += suite.run_case(case)
        suite.attach(results)
        write_json(json_path, header, results, complete=False)
    results.sort(key=lambda r: (cases.index(r.case), suite.providers_of(r.case).index(r.provider)))
    write_json(json_path, header, results, complete=set(cases) <= {r.case for r in results})
    if plot_skipped is None:
        source = env.get("commit", env["source_digest"])[:10]
        title = f"{env.get('gpu', device)}, {suite.sweep['dtype']}, flashtriton {source}"
        plot([asdict(r) for r in results], args.modes, plot_path, title)

    for line in unavailable_lines(results):
        print(line)
    print(format_table(results, args.modes) if paper else format_users_table(results))
    print(TABLE_LEGEND if paper else USERS_LEGEND)
    print(first_calls(results))
    print(f"results: {json_path}")
    if paper:
        print(f"plot: {plot_path}" if plot_skipped is None else f"plot: skipped ({plot_skipped})")
    return 0
