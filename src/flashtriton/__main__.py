"""Command line: ``flashtriton COMMAND [options]``; ``flashtriton --help`` lists the commands and
``flashtriton COMMAND --help`` their options."""

from __future__ import annotations

import argparse
import sys

import torch
import triton

from . import __version__, bench, warmup

# The demo's peers. On a GPU: standard attention and SDPA's backends. On a CPU: SDPA first (its CPU kernel is the one
# the PyTorch path's fused calls run, so its column shows what flashtriton adds around it), then standard attention.
DEMO_PROVIDERS = (
    ["flashtriton", "standard", "sdpa", "sdpa-cudnn", "sdpa-flash"]
    if torch.cuda.is_available()
    else ["flashtriton", "sdpa", "standard"]
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashtriton",
        description="FlashAttention-2 in Triton: benchmark it, or compile its kernels ahead of a first call.",
        epilog="flashtriton COMMAND --help lists a command's options.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"flashtriton {__version__} (torch {torch.__version__}, triton {triton.__version__})",
    )
    commands = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")

    described = argparse.RawDescriptionHelpFormatter
    sweep = commands.add_parser(
        "bench",
        help="time flashtriton against its peers; writes results.json and bench.png",
        description=bench.__doc__,
        formatter_class=described,
    )
    bench.add_arguments(sweep)
    sweep.set_defaults(run=bench.run)

    demo = commands.add_parser(
        "demo",
        help="a quick bench: one case per causal flag against standard attention and SDPA, no plot",
        description="`flashtriton bench --quick --no-plots --out out/demo` against standard attention and SDPA "
        f"({', '.join(DEMO_PROVIDERS[1:])} on this machine); the bench's options apply.",
    )
    bench.add_arguments(demo)
    demo.set_defaults(run=bench.run, quick=True, no_plots=True, out="out/demo", providers=DEMO_PROVIDERS)

    warm = commands.add_parser(
        "warmup",
        help="compile the common kernel variants now, so that a first call loads them from Triton's cache",
        description=warmup.__doc__,
        formatter_class=described,
    )
    warmup.add_arguments(warm)
    warm.set_defaults(run=warmup.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
