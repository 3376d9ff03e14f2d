"""results.json: its header (the schema, the fields' definitions, the environment), written after every case,
read back, and the cases a cut-short run finished kept for ``--resume``."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from .. import autotune
from .cases import CASE_TYPES, OURS, Result

SCHEMA = "flashtriton-bench/3"
PACKAGE = Path(__file__).parents[1]  # flashtriton: the git commands' folder

# Written into results.json so the file explains itself.
DEFINITIONS = {
    "case": "batch x seqlen = 16k tokens, heads x head_dim = 2048 (CPU: batch 1, 4 heads)",
    "ms": "per mode, the median over the rounds of each round's milliseconds: a round times the providers' calls "
    "one of each in turn, in passes (CUDA: each call after an L2 flush, events around it, about 100 ms of passes per "
    "provider; CPU: 3 passes), and takes each provider's median call",
    "ms_rounds": "per mode, each round's milliseconds; the provider that starts a round's passes rotates from round "
    "to round",
    "tflops": "FLOPs / time; FLOPs = 4*B*H*N*N*D (x0.5 causal) for fwd, x2.5 for bwd, x3.5 for fwd_bwd",
    "tb_per_s": "the decode suite's bandwidth (empty elsewhere)",
    "ratios": f"{OURS} rows only: ratios[peer][mode] = peer ms / {OURS} ms (> 1: {OURS} is faster)",
    "peak_extra_mib": "allocator peak during one fwd+bwd beyond what was allocated before it (CUDA only)",
    "max_error": "max abs difference of the forward output from an fp32 reference, first (batch, head)",
    "first_call_s": "wall seconds of the provider's first fwd+bwd on the case: JIT compile included when the "
    "kernels were not yet compiled in this process (the first seqlen of each head dim and causal flag)",
    "unavailable": "why the provider has no numbers for the case (unsupported, not installed, out of memory)",
}


def _git(*args: str) -> str | None:
    with contextlib.suppress(subprocess.CalledProcessError, FileNotFoundError):
        return subprocess.check_output(["git", *args], text=True, stderr=subprocess.DEVNULL, cwd=PACKAGE).rstrip("\n")
    return None


def environment() -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "platform": platform.platform(),
        "command": sys.argv,
        "source_digest": autotune.source_digest(),
        "autotune": autotune.enabled(),  # FLASHTRITON_AUTOTUNE: the forward's configs tuned, not the tables'
    }
    if _git("ls-files", "--", "."):  # the package is tracked here, so the checkout's commit describes it
        info["commit"] = _git("rev-parse", "HEAD")
        info["commit_subject"] = _git("log", "-1", "--format=%s")
        status = _git("status", "--porcelain", "--untracked-files=all", "--", ".")
        info["uncommitted"] = [line[3:] for line in status.splitlines()]  # "XY path" lines: the paths
    with contextlib.suppress(ImportError):
        import triton

        info["triton"] = triton.__version__
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["sm_count"] = props.multi_processor_count
        with contextlib.suppress(subprocess.CalledProcessError, FileNotFoundError):
            info["driver"] = subprocess.check_output(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], text=True
            ).strip()
    return info


def write_json(path: str, header: dict, results: list[Result], complete: bool) -> None:
    payload = {**header, "complete": complete, "results": [asdict(r) for r in results]}
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(path + ".tmp", path)


def load_results(path: str) -> tuple[dict, list[Result]]:
    """A results.json back as (its header, its results)."""
    with open(path) as f:
        payload = json.load(f)
    case_type = CASE_TYPES[payload.get("sweep", {}).get("suite", "paper")]  # runs from before suites: the paper's
    results = [Result(**{**r, "case": case_type(**r["case"])}) for r in payload.pop("results")]
    return payload, results


def resumable(path: str, env: dict, sweep: dict, cases, providers_of=None) -> tuple[dict, list[Result]]:
    """The cases of an earlier, cut-short run that every provider finished (``providers_of(case)``, default the
    sweep's providers), if it measured the same suite of the same source on the same GPU and software in the same
    way (runs write whole cases; a case that files from before rounds left half done is measured again, so peers
    share a run)."""
    header, earlier = load_results(path)
    providers_of = providers_of or (lambda case: sweep["providers"])
    mine = {**env, "suite": sweep.get("suite", "paper"), **{key: sweep[key] for key in ("modes", "rounds", "timing")}}
    theirs = {"autotune": False, **header["environment"]}  # runs from before the field did not tune
    old = header["sweep"]  # runs from before the fields: the paper suite, one round, providers timed in blocks
    theirs.update(
        suite=old.get("suite", "paper"),
        modes=old["modes"],
        rounds=old.get("rounds", 1),
        timing=old.get("timing", "blocks"),
    )
    keys = ("suite", "source_digest", "gpu", "driver", "torch", "triton", "autotune", "modes", "rounds", "timing")
    for key in keys:
        if theirs.get(key) != mine.get(key):
            raise SystemExit(f"--resume {path}: its {key} is {theirs.get(key)!r}, this run's {mine.get(key)!r}")
    kept = []
    for case in cases:
        rows = {r.provider: r for r in earlier if r.case == case}
        if all(p in rows for p in providers_of(case)):
            kept += [rows[p] for p in providers_of(case)]
    return header["environment"], kept
