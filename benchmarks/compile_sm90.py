"""Compile every kernel variant for Hopper (sm90) on a machine without a GPU, through the real launchers.

    python benchmarks/compile_sm90.py [--head-dims 64 128 256 96] [--seqlen 2048] [--cases dense causal]
                                      [--whole] [--fp32-results | --fp32-cases causal] [--json]

For each head dim, feature set (dense, causal, causal with sinks, deterministic causal, window, long window, all
features, varlen, block mask) and sequence length (the one given: whole tiles; and, unless --whole, one less: a
ragged last tile), the forward and backward launchers run with CPU tensors while a stand-in driver reports an sm90
GPU and kernels are compiled, not launched (with --fp32-results, for calls that ask for fp32 out, dq, dk, dv as ring
attention's steps do: AttentionParams.fp32_results; builds named "... fp32"; --fp32-cases: those cases with fp32
results as well, in the same process). Prints registers and spill (stack)
bytes per kernel from the cubin (--json: one JSON object, build name to {"kernels": [[kernel, registers, stack
bytes], ...], "error": null or why}), and exits non-zero if any build fails: Triton 3.6's ptxas segfaults on some
TMA kernels, so run this after touching kernels/config.py and before spending GPU time. tests/test_sm90_build.py
runs it on a few builds.
Run it without TRITON_INTERPRET=1: under the interpreter @triton.jit kernels are not compiled.
Depends on Triton 3.6 internals (runtime driver, JITFunction.run): a tool, not part of the package.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from flashtriton import mods, route, triton_backend, validation
from flashtriton.block_mask import create_block_mask
from flashtriton.params import AttentionParams

CUOBJDUMP = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"


class _Hopper:
    """The few driver calls the launchers make, answered for one sm90 device."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def _usage(kernel) -> tuple[int, int]:
    """(registers, stack bytes) of a compiled kernel, read from its cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return int(re.search(r"REG:(\d+)", out).group(1)), int(re.search(r"STACK:(\d+)", out).group(1))


def _no_hook(metadata) -> None:
    pass


@contextlib.contextmanager
def compile_only():
    """Launches compile for sm90 and return; yields the list of (kernel, registers, stack bytes)."""
    built = []
    run = JITFunction.run

    def compile_kernel(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        built.append((self.fn.__name__, *_usage(kernel)))
        return kernel

    arch, interpreting, sm_count = route.arch, route.interpreting, route.sm_count
    hook = knobs.runtime.launch_enter_hook
    driver.set_active(_Hopper())
    JITFunction.run = compile_kernel
    knobs.runtime.launch_enter_hook = _no_hook  # flashtriton.launch then always calls JITFunction.run
    route.arch = lambda device: "sm90"
    route.interpreting = lambda: False
    route.sm_count = lambda device: 132  # the H200's
    try:
        yield built
    finally:
        JITFunction.run, route.arch, route.interpreting = run, arch, interpreting
        knobs.runtime.launch_enter_hook = hook
        route.sm_count = sm_count


def _cases(n: int, head_dim: int) -> dict:
    scale = head_dim**-0.5
    cu = torch.tensor([0, n // 3, n], dtype=torch.int32)
    tiled = torch.tensor([0, n // 256 * 128, n], dtype=torch.int32)  # whole 128-row tiles when n is
    for x in (cu, tiled):
        validation.host_read(x, "values", torch.Tensor.tolist)  # as the API's checks do
    ids = (torch.arange(n) // max(n // 4, 1)).to(torch.int32)
    documents = mods.and_masks(mods.document_mask(ids), mods.causal_mask())
    slopes = torch.rand(2, 8)
    seed = torch.tensor([3])
    features = AttentionParams(scale, n // 4, 16, softcap=30.0, alibi_slopes=slopes, dropout_p=0.1, dropout_seed=seed)
    large_cap = replace(features, softcap=1000.0)  # tanh's series near 0 (config.softcap_mode)
    return {
        "dense": (False, AttentionParams(scale)),
        "causal": (False, AttentionParams(scale, window_right=0)),
        "causal sinks": (False, AttentionParams(scale, window_right=0, sinks=torch.randn(8))),
        "deterministic": (False, AttentionParams(scale, window_right=0, deterministic=True)),  # the dQ kernel's
        "window": (False, AttentionParams(scale, window_left=n // 4, window_right=0)),
        "long window": (False, AttentionParams(scale, window_left=1800, window_right=16)),  # span > SHORT_SPAN
        "features": (False, features),
        "features large cap": (False, large_cap),
        "varlen": (
            True,
            AttentionParams(scale, window_right=0, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n, max_seqlen_k=n),
        ),
        "varlen tiles": (
            True,
            AttentionParams(
                scale, window_right=0, cu_seqlens_q=tiled, cu_seqlens_k=tiled, max_seqlen_q=n, max_seqlen_k=n
            ),
        ),
        "block mask": (False, AttentionParams(scale, block_mask=create_block_mask(documents, None, None, n, n))),
    }


def build(head_dim: int, n: int, case: str, fp32_results: bool = False) -> dict:
    """Compiles the forward and backward kernels that one case's call launches, with fp32 results if asked: {"kernels":
    [(kernel, registers, stack bytes), ...] in launch order, "error": None, or why a build failed (the kernels built
    before it)}."""
    varlen, params = _cases(n, head_dim)[case]
    params = replace(params, fp32_results=fp32_results)
    shape = (n, 8, head_dim) if varlen else (2, n, 8, head_dim)
    q = torch.randn(shape, dtype=torch.bfloat16)
    k, v = (torch.randn(*shape[:-2], 4, head_dim, dtype=torch.bfloat16) for _ in range(2))
    with compile_only() as built:
        try:
            out, lse = triton_backend.forward(q, k, v, params, route.forward(q, k, v, params, gpu="sm90"))
            backward = route.backward(out, lse, q, k, v, out, lse, params, gpu="sm90")
            triton_backend.backward(out, torch.zeros_like(lse), q, k, v, out, lse, params, backward)
            error = None
        except Exception as failure:  # a failed build is the finding: report it and go on
            error = _why(failure)
    return {"kernels": built, "error": error}


def _why(failure: Exception) -> str:
    """A failed build's one line: a CompilationError quotes the source; its cause says why."""
    cause = failure
    while cause.__cause__ is not None:
        cause = cause.__cause__
    return f"{type(failure).__name__}: {(str(cause).strip().splitlines() or [''])[-1][:200]}"


MERGES = ("slice", "packed", "gathered", "gathered twice")


def build_merges(head_dim: int, n: int, variant: str) -> dict:
    """Compiles ring attention's merge and add kernels (distributed/merge.py) as a ring step launches them: on a
    (batch, seqlen, heads, dim) slice, a packed batch, or gathered rows with one or two copies; build()'s result."""
    from flashtriton.distributed import merge

    packed = variant != "slice"
    out = torch.zeros((n, 8, head_dim) if packed else (2, n, 8, head_dim))
    lse = torch.zeros((8, n) if packed else (2, 8, n))
    copies = variant.count("gathered") and (2 if variant.endswith("twice") else 1)
    targets = torch.arange(n) if copies else None
    sources = tuple(torch.arange(n) for _ in range(copies))
    merge_backend = route.merge_backend
    with compile_only() as built:
        route.merge_backend = lambda device, dtype: "triton"
        try:
            view = (lambda x: x) if packed else (lambda x: x[:, 1:] if x.dim() == 4 else x[..., 1:])
            merge.merge(
                view(out),
                view(lse),
                view(out).contiguous(),
                view(lse).contiguous(),
                targets,
                sources,
                dtype=torch.bfloat16,
            )
            merge.add(view(out), view(out).contiguous(), targets, sources, dtype=torch.bfloat16)
            error = None
        except Exception as failure:
            error = _why(failure)
        finally:
            route.merge_backend = merge_backend
    return {"kernels": built, "error": error}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256, 96])
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--cases", nargs="+", choices=list(_cases(256, 64)), help="default: all")
    parser.add_argument("--whole", action="store_true", help="only the given seqlen, not also a ragged one less")
    fp32 = parser.add_mutually_exclusive_group()
    fp32.add_argument("--fp32-results", action="store_true", help="calls that ask for fp32 out, dq, dk, dv")
    fp32.add_argument("--fp32-cases", nargs="+", default=[], choices=list(_cases(256, 64)),
                      help="these cases with fp32 results too")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a line per build")
    parser.add_argument("--merges", action="store_true", help="ring attention's merge kernels instead")
    args = parser.parse_args()
    results = {}
    for head_dim in args.head_dims if args.merges else ():
        for variant in MERGES:
            results[f"d{head_dim} N={args.seqlen} merge {variant}"] = build_merges(head_dim, args.seqlen, variant)
    for head_dim in () if args.merges else args.head_dims:
        for n in (args.seqlen,) if args.whole else (args.seqlen, args.seqlen - 1):
            builds = [(case, args.fp32_results) for case in args.cases or _cases(n, head_dim)]
            for case, fp32_results in builds + [(case, True) for case in args.fp32_cases]:
                label = f"{case} fp32" if fp32_results else case
                name = f"d{head_dim} N={n} {label}"
                results[name] = result = build(head_dim, n, case, fp32_results)
                if not args.json:
                    if result["error"] is None:
                        line = "  ".join(f"{kernel[10:]} {regs}r/{stack}B" for kernel, regs, stack in result["kernels"])
                    else:
                        line = f"FAILED after {[kernel for kernel, _, _ in result['kernels']]}: {result['error']}"
                    print(f"d{head_dim} N={n} {label:12s} {line}", flush=True)
    failures = sum(result["error"] is not None for result in results.values())
    print(json.dumps(results) if args.json else f"{failures} failed builds")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
