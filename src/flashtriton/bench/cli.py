"""``flashtriton bench``'s options and run: the suite's cases (the paper sweep, the users suite or the decode suite),
then each case measured and written, then the plot and the table."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import decode, decode_calls, ring, users
from .cases import MODES, Case, attach_ratios
from .decode_calls import DECODE_DEFINITIONS, DECODE_GPU_ONLY, DECODE_PROVIDERS, run_decode_case
from .progress import case_weights, progress
from .providers import GPU_ONLY, PROVIDERS
from .results import DEFINITIONS, SCHEMA, environment, resumable, write_json
from .summary import (
    DECODE_LEGEND,
    TABLE_LEGEND,
    USERS_LEGEND,
    first_calls,
    format_decode_table,
    format_table,
    format_users_table,
    plot,
    skipped_lines,
    unavailable_lines,
)
from .timing import HOST_PASSES, TIMING, TIMING_AHEAD, host_calls, run_case
from .users_calls import USERS_DEFINITIONS, USERS_GPU_ONLY, USERS_PROVIDERS, attach_users_ratios, run_user_case

TOKENS, HIDDEN = 16384, 2048  # the FlashAttention-2 paper's sweep: batch * seqlen and heads * headdim
CUDA_HEAD_DIMS = (64, 128, 256)
CUDA_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
CPU_SEQLENS = (512, 1024, 2048)  # kept short on a CPU: a case's time grows as N^2
CPU_BATCH, CPU_HEADS = 1, 4


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (a head dim, a length; benchmarks/ scripts' counts too)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


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


def same_group(case) -> tuple:
    """The cases --part keeps together in the paper sweep and the users suite: one (group, head dim, causal), so a
    length and its whole-tile neighbour are timed in one run."""
    return getattr(case, "group", ""), case.head_dim, case.causal


@dataclass
class Suite:
    """What a run measures: its cases in table order, each case's providers, how a case is run and its ratios
    attached, the sweep's header, the definitions written beside the results, notes for stderr, the table printed
    last with its legend, and the cases --part keeps together (cases alike under ``unit`` and adjacent)."""

    cases: list
    providers_of: Callable[[object], list[str]]
    run_case: Callable[[object], list]
    attach: Callable[[list], None]
    sweep: dict
    definitions: dict
    notes: list[str]
    table: Callable[[list], str]
    legend: str
    unit: Callable[[object], tuple] = same_group


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
        table=lambda results: format_table(results, args.modes),
        legend=TABLE_LEGEND,
    )


def _refuse_paper_flags(args: argparse.Namespace) -> None:
    paper_flags = {
        "--head-dims": args.head_dims, "--seqlens": args.seqlens,
        "--causal": args.causal != "both", "--modes": args.modes != list(MODES),
    }  # fmt: skip
    given = [flag for flag, value in paper_flags.items() if value]
    if given:
        module = f"flashtriton.bench.{args.suite}"
        raise SystemExit(f"--suite {args.suite} chooses its own shapes and modes ({module}): drop {given[0]}")


def _chosen(args: argparse.Namespace, available, gpu_only, cuda: bool) -> tuple[list[str], list[str]]:
    """(the suite's providers that --providers names, all by default; notes on those not run or unavailable)."""
    notes = []
    outside = [p for p in args.providers or () if p not in available]  # `demo --suite users`: the paper's
    if outside:
        notes.append(f"not in the {args.suite} suite, so not run: {', '.join(outside)}")
    chosen = [p for p in args.providers or available if p in available]
    unavailable = [p for p in chosen if p in gpu_only]
    if not cuda and unavailable:
        notes.append(f"no CUDA GPU: {', '.join(unavailable)} will be reported unavailable")
    return chosen, notes


def _own_suite(cases: list, chosen: list[str], run, device: torch.device, rounds: int, **rest) -> Suite:
    """A suite whose cases name their providers (users, decode): each case runs those of them that were chosen."""

    def providers_of(case):
        return [p for p in case.providers if p in chosen]

    return Suite(
        cases=cases, providers_of=providers_of, run_case=lambda case: run(case, providers_of(case), device, rounds),
        **rest,
    )  # fmt: skip


def users_suite(args: argparse.Namespace, device: torch.device) -> Suite:
    """The users suite (users.py): on a GPU its cases (--quick: the first of each group), on a CPU a tiny case of
    each group. Its shapes and modes are its own: the paper sweep's flags for them are refused."""
    _refuse_paper_flags(args)
    cuda = device.type == "cuda"
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    cases = users.gpu_cases(dtype) if cuda else users.cpu_cases(dtype)
    cases = users.first_of_each_group(cases) if args.quick else cases
    chosen, notes = _chosen(args, USERS_PROVIDERS, USERS_GPU_ONLY, cuda)
    if not cuda:
        notes.append(f"no CUDA GPU: a tiny case of each users group, {dtype}")
    sweep = {"suite": "users", "modes": list(users.BOTH), "providers": chosen, "dtype": dtype, "rounds": args.rounds}
    sweep.update(timing=TIMING, host_calls=host_calls(device), host_passes=HOST_PASSES)

    return _own_suite(
        cases,
        chosen,
        run_user_case,
        device,
        args.rounds,
        attach=attach_users_ratios,
        sweep=sweep,
        definitions=USERS_DEFINITIONS,
        notes=notes,
        table=format_users_table,
        legend=USERS_LEGEND,
    )


def decode_suite(args: argparse.Namespace, device: torch.device) -> Suite:
    """The decode suite (decode.py): on a GPU its cases within the memory budget (--quick: one shape), the others
    named as skipped; on a CPU a tiny case per seqlen_q and layout. Its shapes are its own, as the users suite's."""
    _refuse_paper_flags(args)
    cuda = device.type == "cuda"
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    cases, skipped = decode.gpu_cases(dtype) if cuda else (decode.cpu_cases(dtype), {})
    cases = decode.quick(cases) if args.quick and cuda else cases
    chosen, notes = _chosen(args, DECODE_PROVIDERS, DECODE_GPU_ONLY, cuda)
    if not cuda:
        notes.append(f"no CUDA GPU: a tiny case per seqlen_q and cache layout, {dtype}")
    notes += skipped_lines(skipped)
    sweep = {"suite": "decode", "modes": list(decode_calls.MODES), "providers": chosen, "dtype": dtype}
    sweep.update(rounds=args.rounds, timing=TIMING_AHEAD, host_calls=host_calls(device, decode_calls.HOST_CALLS))
    sweep.update(host_passes=HOST_PASSES)
    sweep.update(memory_budget_bytes=decode.MEMORY_BUDGET, skipped=skipped)

    return _own_suite(
        cases,
        chosen,
        run_decode_case,
        device,
        args.rounds,
        attach=attach_ratios,
        sweep=sweep,
        definitions=DECODE_DEFINITIONS,
        notes=notes,
        table=format_decode_table,
        legend=DECODE_LEGEND,
        unit=decode.unit,
    )


def part_of(cases: list, part: tuple[int, int] | None, unit: Callable[[object], tuple] = same_group) -> list:
    """The K-th of N parts of the cases, in order: adjacent cases alike under ``unit`` stay together, each such unit
    in the part that holds its middle."""
    if part is None:
        return cases
    k, n = part
    chosen, start = [], 0
    for _, together in itertools.groupby(cases, key=unit):
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


ALL_PROVIDERS = dict.fromkeys([*PROVIDERS, *USERS_PROVIDERS, *DECODE_PROVIDERS, *ring.PROVIDERS])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench's options (``flashtriton bench`` and ``flashtriton demo``)."""
    parser.add_argument(
        "--suite",
        choices=["paper", "users", "decode", "ring"],
        default="paper",
        help="paper (default): the FlashAttention-2 paper's sweep; users: a model's layout, GQA, lengths inside a "
        "tile, ragged documents, short N, host time per call and peak memory, against cuDNN SDPA and FlexAttention "
        "(fwd and fwd+bwd with fresh gradients); decode: flash_attn_with_kvcache reading contiguous and paged caches "
        "(bandwidth, device and host time per call) against cuDNN SDPA, SDPA's FlashAttention-2 and FlexAttention "
        f"(about {decode.PARTS} parts of under 10 minutes on a GPU); ring: context parallelism's weak scaling under "
        "torchrun (flashtriton.bench.ring). users, decode and ring: no plot here (benchmarks/decode_report.py and "
        "ring_report.py draw decode's and ring's from results.json); the shape flags below are the paper sweep's",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one head dim and one length unless given (what `demo` runs); users: the first case of each group; "
        "decode: one shape",
    )
    parser.add_argument(
        "--head-dims",
        type=positive_int,
        nargs="+",
        help="default 64 128 256 (CPU: 64; --quick: 128 on a GPU, 64 on a CPU)",
    )
    parser.add_argument(
        "--seqlens",
        type=positive_int,
        nargs="+",
        help="default 512 to 16384 (CPU: 512 1024 2048; --quick: 4096, CPU 1024)",
    )
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], help="default bfloat16 (CPU: float32)")
    parser.add_argument(
        "--providers",
        nargs="+",
        choices=list(ALL_PROVIDERS),
        metavar="PROVIDER",
        help=f"any of {', '.join(ALL_PROVIDERS)} (default: all the suite's)",
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
    if args.suite == "ring":  # one process per GPU under torchrun: its own run (bench/ring.py)
        _refuse_paper_flags(args)
        return ring.run(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    paper = args.suite == "paper"
    suite = {"paper": paper_suite, "users": users_suite, "decode": decode_suite}[args.suite](args, device)
    cases, notes = suite.cases, suite.notes

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    json_path = str(out / "results.json")
    plot_path, plot_skipped = str(out / "bench.png"), None
    if not paper:
        plot_skipped = f"the {args.suite} suite draws none"
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
    todo = [c for c in part_of(cases, args.part, suite.unit) if c not in {r.case for r in results}]
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

    for line in unavailable_lines(results) + skipped_lines(suite.sweep.get("skipped", {})):
        print(line)
    print(suite.table(results))
    print(suite.legend)
    print(first_calls(results, "first call" if args.suite == "decode" else "first fwd+bwd call"))
    print(f"results: {json_path}")
    if paper:
        print(f"plot: {plot_path}" if plot_skipped is None else f"plot: skipped ({plot_skipped})")
    return 0
