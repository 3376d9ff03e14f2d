"""Command line: ``flashtriton bench [...]`` (the benchmark) and ``flashtriton demo`` (a quick one).

Ratios in the table are peer time / flashtriton time: above 1 means flashtriton is faster.
"""

from __future__ import annotations

import sys

from . import bench

USAGE = "usage: flashtriton {bench,demo} [options]   (flashtriton bench --help for the options)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("bench", "demo"):
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] == "demo":
        peers = ["flashtriton", "standard", "sdpa", "sdpa-cudnn", "sdpa-flash"]
        return bench.main(["--quick", "--no-plots", "--out", "out/demo", "--providers", *peers, *argv[1:]])
    return bench.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
