"""``flashtriton warmup``: compile the common kernel variants ahead of a first call.

Triton compiles a kernel variant at its first launch, seconds each, and keeps it in its on-disk cache
(TRITON_CACHE_DIR), from which a later process loads it instead of compiling it again. This runs a forward
(no grad) and a forward+backward through ``flash_attn_func`` on the GPU for each head dim x causal flag x
dtype, at whole-tile lengths short and long (the kernels' tiles depend on how many keys a query row sees).
Calls of other kinds (ragged lengths, GQA, windows, masks, dropout, softcap) still compile their own
variants on first use.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch

from .interface import flash_attn_func
from .route import BACKEND_ENV
from .validation import check_head_dim

HEAD_DIMS = (64, 128, 256)
DTYPES = ("bfloat16", "float16")
# A query row sees 256, 1024 and 4096 keys causal, twice that dense: every span range of kernels/config.py's tables.
SEQLENS = (512, 2048, 8192)
HIDDEN = 2048  # heads x head dim, as in the bench's cases


@dataclass(frozen=True)
class Variant:
    head_dim: int
    causal: bool
    dtype: str
    seqlen: int

    @property
    def name(self) -> str:
        return f"d{self.head_dim}{'-causal' if self.causal else ''}-{self.dtype}-n{self.seqlen}"


def variants(head_dims, causal_options, dtypes, seqlens) -> list[Variant]:
    return [Variant(d, c, t, n) for d in head_dims for c in causal_options for t in dtypes for n in seqlens]


def warm(variant: Variant, device: torch.device) -> tuple[float, float]:
    """Seconds of one forward without grad and of one forward+backward on ``variant``'s shape."""
    heads = max(1, HIDDEN // variant.head_dim)
    shape = (1, variant.seqlen, heads, variant.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=getattr(torch, variant.dtype)) for _ in range(3))

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    def forward():
        with torch.no_grad():
            flash_attn_func(q, k, v, causal=variant.causal)

    def forward_backward():
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        out = flash_attn_func(qg, kg, vg, causal=variant.causal)
        out.backward(torch.randn_like(out))

    return timed(forward), timed(forward_backward)


def _head_dim(text: str) -> int:
    try:
        check_head_dim(int(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return int(text)


def _seqlen(text: str) -> int:
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"a length is at least 1, got {text}")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--head-dims", type=_head_dim, nargs="+", default=list(HEAD_DIMS), help="default: 64 128 256")
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES), help="default: both")
    parser.add_argument(
        "--seqlens",
        type=_seqlen,
        nargs="+",
        default=list(SEQLENS),
        help="default: 512 2048 8192 (multiples of 128 take the whole-tile kernels)",
    )


def run(args: argparse.Namespace) -> int:
    """Warm every variant the options name; 0 when all ran (or there is no GPU to compile for), 1 if any failed."""
    causal_options = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    todo = variants(args.head_dims, causal_options, args.dtypes, args.seqlens)
    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing to compile (on a CPU flashtriton runs PyTorch code, which needs no compile)")
        return 0
    if os.environ.get(BACKEND_ENV) == "torch":
        print(f"{BACKEND_ENV}=torch: the Triton kernels do not run, so there is nothing to compile")
        return 0
    import triton

    device = torch.device("cuda")
    print(f"{len(todo)} variants on {torch.cuda.get_device_name(device)}; Triton's cache: {triton.knobs.cache.dir}")
    print(f"{'variant':<30}{'forward s':>11}{'fwd+bwd s':>11}")
    start, failed = time.perf_counter(), 0
    for variant in todo:
        try:
            forward_s, both_s = warm(variant, device)
        except Exception as exc:  # report it and warm the rest: a variant this GPU cannot run is not the others' loss
            failed += 1
            print(f"{variant.name:<30}failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        print(f"{variant.name:<30}{forward_s:>11.2f}{both_s:>11.2f}", flush=True)
    total = time.perf_counter() - start
    print(f"{len(todo) - failed} of {len(todo)} variants warm in {total:.1f} s")
    if failed:
        print(f"{failed} failed", file=sys.stderr)
    return 1 if failed else 0
