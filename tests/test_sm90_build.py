"""The Hopper (sm90) kernels compile, on any machine: benchmarks/compile_sm90.py builds a case's forward and backward
through the real launchers with a stand-in sm90 driver and Triton's bundled ptxas, and reports each kernel's
registers and spill (stack) bytes.

It runs in a subprocess without TRITON_INTERPRET: conftest sets that on a machine with no GPU before Triton is
imported, and then every @triton.jit function is an interpreted one, which nothing compiles for a target: neither
the backward's preprocess and dQ conversion kernels nor Triton's own library functions that the Gluon kernels call.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import flashtriton
from flashtriton.kernels import triton_compat

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "compile_sm90.py"
SEQLEN = 2048  # whole tiles of every Gluon config: the Gluon kernels serve these calls

FORWARD = "attention_forward_sm90_kernel"
DKDV = "attention_backward_dkdv_sm90_kernel"
DQ = "attention_backward_dq_sm90_kernel"

# Spill bytes that ptxas (Triton 3.6's) leaves in a Gluon kernel today: a build may spill no more. Every Gluon
# kernel not listed spills nothing.
SPILLS = {
    (64, "causal", DKDV): 16,
    (64, "window", DKDV): 24,  # 16 with the CPU image's ptxas; the H200 image's has spilled 8 B more
    (64, "varlen tiles", DKDV): 16,
    (128, "dense", DKDV): 40,  # fused, at two (Q, dO) slots; 32 with the CPU image's ptxas, 40 the H200 image's
    (80, "dense", DKDV): 40,  # 128-wide tiles: D=128's kernel but for the epilogues' column masks
    (128, "causal", DKDV): 48,  # 40 with the CPU image's ptxas and alone on the H200; 48 there under -n 12
    (128, "window", DKDV): 48,  # 40 with the CPU image's ptxas, 48 the H200 image's
    (128, "varlen tiles", DKDV): 48,  # 40 with the CPU image's ptxas; 48 seen on the H200 under -n 12 (40 alone)
    (256, "dense", DKDV): 88,  # fused, each warpgroup half of D's columns
    (256, "causal", DKDV): 112,
    (256, "window", DKDV): 120,
    (256, "varlen tiles", DKDV): 112,
    (256, "causal", FORWARD): 8,
    (256, "window", FORWARD): 16,
    (256, "varlen tiles", FORWARD): 8,
}
# Sinks change the forward's epilogue alone: with them every kernel spills no more than without
SPILLS.update({(d, "causal sinks", kernel): n for (d, case, kernel), n in list(SPILLS.items()) if case == "causal"})
# fp32 results (compile_sm90.py --fp32-cases), stored from registers
SPILLS.update({
    (64, "causal fp32", DKDV): 8,
    (128, "causal fp32", FORWARD): 24,
    (128, "causal fp32", DKDV): 40,
    (80, "causal fp32", DKDV): 40,
    (256, "causal fp32", FORWARD): 16,
    (256, "causal fp32", DKDV): 96,
})  # fmt: skip

pytestmark = pytest.mark.skipif(
    not triton_compat.PRIVATE_API_OK, reason=f"the Gluon kernels are off: {triton_compat.PRIVATE_API_PROBLEM}"
)


def _build(
    head_dims: list[int], cases: list[str], fp32_cases: tuple[str, ...] = (), merges: bool = False, seqlen: int = SEQLEN
) -> dict:
    """compile_sm90's results for these builds (at ``seqlen``) and ``fp32_cases`` with fp32 results, by (head dim,
    case; " fp32" after it for fp32 results), compiled in a Triton cache of their own: a kernel another process
    compiled (a GPU test beside this one) is not counted."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(flashtriton.__file__).parents[1]), env.get("PYTHONPATH", "")])
    args = ["--head-dims", *map(str, head_dims), "--seqlen", str(seqlen), "--whole", "--json"]
    args += ["--merges"] if merges else ["--cases", *cases]
    args += ["--fp32-cases", *fp32_cases] if fp32_cases else []
    with tempfile.TemporaryDirectory() as cache:
        env["TRITON_CACHE_DIR"] = cache
        run = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env, timeout=600)
    assert run.stdout, run.stderr[-2000:]
    results = json.loads(run.stdout.splitlines()[-1])
    return {(int(name.split()[0][1:]), name.split(maxsplit=2)[2]): result for name, result in results.items()}


def _check(results: dict, expected: dict) -> None:
    """Every build succeeded, launched the Gluon kernels ``expected`` names, and spills no more than SPILLS allows."""
    assert set(results) == set(expected)
    for (head_dim, case), result in results.items():
        assert result["error"] is None, (head_dim, case, result["error"])
        built = {}  # each kernel's largest spill over its launches (a kernel may launch in several variants)
        for kernel, _, stack in result["kernels"]:
            built[kernel] = max(stack, built.get(kernel, 0))
        assert expected[head_dim, case] <= set(built), (head_dim, case, built)
        for kernel in expected[head_dim, case]:
            assert built[kernel] <= SPILLS.get((head_dim, case, kernel), 0), (head_dim, case, kernel, built[kernel])


# one build per head dim, so that two test workers share them (each is a process that compiles for a minute, after
# about 8 s of imports: the fp32 results build in the same process)
@pytest.mark.parametrize("head_dim", [64, 128, 256, 80])
def test_sm90_kernels_build(head_dim):
    """The forward at D = 64, 128 and 256, dense, causal and causal with sinks (whose forward spills no more than
    without); the fused dK/dV at each D (at 256 split across the warpgroups by columns); the dQ kernel and dK/dV after
    it (D=128 causal: below its fused span); D=80 in 128-wide tiles, fused, dense. And causal calls that ask for fp32
    results (ring attention's steps) at each D: O, dK and dV, and the dQ kernel's dQ stored from registers; fused
    dK/dV at 64 and 256, the dQ kernel and dK/dV after it at 128 and at 80 (128-wide tiles, whose register stores
    drop the columns past 80)."""
    fused = {FORWARD, DKDV}
    cases = ["dense"] if head_dim == 80 else ["dense", "causal", "causal sinks"]
    expected = {(head_dim, case): fused for case in cases}
    if head_dim == 128:
        expected[128, "causal"] = expected[128, "causal sinks"] = {FORWARD, DQ, DKDV}
    expected[head_dim, "causal fp32"] = {FORWARD, DQ, DKDV} if head_dim in (80, 128) else fused
    _check(_build([head_dim], cases, fp32_cases=("causal",)), expected)


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_sm90_banded_and_varlen_kernels_build(head_dim):
    """A causal sliding window and packed (varlen) sequences of whole tiles, at each Gluon head dim."""
    kernels = {FORWARD, DQ, DKDV} if head_dim == 128 else {FORWARD, DKDV}
    _check(
        _build([head_dim], ["window", "varlen tiles"]),
        {(head_dim, case): kernels for case in ("window", "varlen tiles")},
    )


@pytest.mark.slow
@pytest.mark.parametrize("head_dim,seqlen,cases", [(128, 4095, ["dense", "causal"]), (64, 4095, ["dense"])])
def test_sm90_forward_with_the_masked_key_tile_first_builds(head_dim, seqlen, cases):
    """Forwards whose K/V stream starts with the one key tile that needs a mask (primitives.py, last_first), spilling no
    more than those at whole tiles: a length that ends inside a tile without a band (D=64: three warpgroups), and a
    long causal span's diagonal (config.LONG_BAND_SPAN) on it."""
    _check(_build([head_dim], cases, seqlen=seqlen), {(head_dim, case): {FORWARD} for case in cases})


def test_ring_merge_kernels_build():
    """Ring attention's merge and add kernel (distributed/merge.py) compiles in each form a ring step launches it,
    spilling nothing: the interpreter that runs them in CI does not compile them (it took a None tensor that a
    compiled kernel refuses)."""
    merges = ("slice", "packed", "gathered", "gathered twice")
    expected = {(d, f"merge {form}"): {"accumulate_rows_kernel"} for d in (64, 128) for form in merges}
    _check(_build([64, 128], [], merges=True), expected)
