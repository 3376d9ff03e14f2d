"""``flashtriton bench``: flashtriton against its peers, every provider in the same run.

FLOPs (one formula, the FlashAttention-2 paper's): forward 4 * B * H * N_Q * N_K * D, halved when causal;
backward 2.5x the forward, so forward+backward 3.5x. Each case runs on random inputs in rounds, the
providers' order rotated, and reports the median of the rounds (run_case); within a round the providers'
calls are timed one of each in turn (_timer), so that all of them see the same clock state. Writes
``results.json`` (rewritten after every case, so a run cut short still leaves what it measured) and
``bench.png`` (with matplotlib: the ``[bench]`` extra), a TFLOP/s-against-seqlen panel per (head dim, causal,
mode). ``--resume`` continues a run that was cut short (a device's time limit) from its results.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from . import autotune
from .interface import flash_attn_func
from .reference import attention_reference

MODES = ("fwd", "bwd", "fwd_bwd")
TOKENS, HIDDEN = 16384, 2048  # the FlashAttention-2 paper's sweep: batch * seqlen and heads * headdim
OURS = "flashtriton"
SCHEMA = "flashtriton-bench/3"
CUDA_HEAD_DIMS = (64, 128, 256)
CUDA_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
CPU_SEQLENS = (512, 1024, 2048)  # kept short on a CPU: a case's time grows as N^2
CPU_BATCH, CPU_HEADS = 1, 4
TIMING = "in turn"  # how a round times its providers (_timer); runs from before timed each in a block

# Written into results.json so the file explains itself.
DEFINITIONS = {
    "case": "batch x seqlen = 16k tokens, heads x head_dim = 2048 (CPU: batch 1, 4 heads)",
    "ms": "per mode, the median over the rounds of each round's milliseconds: a round times the providers' calls "
    "one of each in turn, in passes (CUDA: each call after an L2 flush, events around it, about 100 ms of passes per "
    "provider; CPU: 3 passes), and takes each provider's median call",
    "ms_rounds": "per mode, each round's milliseconds; the provider that starts a round's passes rotates from round "
    "to round",
    "tflops": "FLOPs / time; FLOPs = 4*B*H*N*N*D (x0.5 causal) for fwd, x2.5 for bwd, x3.5 for fwd_bwd",
    "ratios": f"{OURS} rows only: ratios[peer][mode] = peer ms / {OURS} ms (> 1: {OURS} is faster)",
    "peak_extra_mib": "allocator peak during one fwd+bwd beyond what was allocated before it (CUDA only)",
    "max_error": "max abs difference of the forward output from an fp32 reference, first (batch, head)",
    "first_call_s": "wall seconds of the provider's first fwd+bwd on the case: JIT compile included when the "
    "kernels were not yet compiled in this process (the first seqlen of each head dim and causal flag)",
    "unavailable": "why the provider has no numbers for the case (unsupported, not installed, out of memory)",
}


def attention_flops(batch, heads, n_q, n_k, head_dim, causal, mode) -> float:
    fwd = 4.0 * batch * heads * n_q * n_k * head_dim * (0.5 if causal else 1.0)
    return fwd * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]


@dataclass(frozen=True)
class Case:
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    causal: bool
    dtype: str = "bfloat16"

    @property
    def name(self) -> str:
        return f"d{self.head_dim}{'-causal' if self.causal else ''}-n{self.seqlen}"


@dataclass
class Result:
    case: Case
    provider: str
    ms: dict[str, float] = field(default_factory=dict)
    ms_rounds: dict[str, list[float]] = field(default_factory=dict)
    tflops: dict[str, float] = field(default_factory=dict)
    ratios: dict[str, dict[str, float]] = field(default_factory=dict)
    peak_extra_mib: float | None = None
    max_error: float | None = None
    first_call_s: float | None = None
    unavailable: str | None = None


# --- providers: (q, k, v) in (B, N, H, D) and causal -> a forward callable returning out -----------


def _sdpa(backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def make(q, k, v, causal):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)

        return run

    return make


def _flex(q, k, v, causal):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # Static shapes: each case compiles for its own shape, as a user with one shape gets it (by default
    # dynamo recompiles with dynamic shapes from the second shape on, which times another kernel).
    torch._dynamo.config.recompile_limit = 1000
    torch._functorch.config.donated_buffer = False  # the "bwd" mode calls backward(retain_graph=True)
    compiled = torch.compile(flex_attention, dynamic=False)
    mask = None
    if causal:
        offset = k.shape[1] - q.shape[1]
        mask = create_block_mask(
            lambda b, h, i, j: j <= i + offset, None, None, q.shape[1], k.shape[1], device=q.device
        )
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    return lambda: compiled(qt, kt, vt, block_mask=mask).transpose(1, 2)


def _flash_attn_package(q, k, v, causal):
    from flash_attn import flash_attn_func as upstream

    return lambda: upstream(q, k, v, causal=causal)


def _sdpa_default(q, k, v, causal):
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)


PROVIDERS: dict[str, Callable] = {
    OURS: lambda q, k, v, causal: lambda: flash_attn_func(q, k, v, causal=causal),
    "sdpa": _sdpa_default,
    "sdpa-cudnn": _sdpa("CUDNN_ATTENTION"),
    "sdpa-flash": _sdpa("FLASH_ATTENTION"),
    "sdpa-efficient": _sdpa("EFFICIENT_ATTENTION"),
    "flex": _flex,
    "standard": lambda q, k, v, causal: lambda: attention_reference(q, k, v, causal=causal, compute_dtype=None)[0],
    "flash_attn": _flash_attn_package,
}
GPU_ONLY = {"sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "flex", "flash_attn"}


class _CallFailed(Exception):
    """The index-th of the calls being timed together raised ``error``."""

    def __init__(self, index: int, error: Exception):
        super().__init__(index, error)
        self.index, self.error = index, error


def _call(calls: list[Callable], i: int):
    try:
        return calls[i]()
    except Exception as exc:
        raise _CallFailed(i, exc) from exc


def _in_turn(n: int, passes: int, take: Callable[[int], Any]) -> list[list]:
    """take(i) for every i < n in each of ``passes`` passes, one i after another, each pass starting one i later;
    returns each i's results in order."""
    taken = [[] for _ in range(n)]
    for p in range(passes):
        for j in range(n):
            i = (p + j) % n
            taken[i].append(take(i))
    return taken


def _timer(device: torch.device) -> Callable[[list[Callable]], list[float]]:
    """``time_all(calls)``: each call's median milliseconds, the calls timed one of each in turn rather than one
    after another in blocks: a GPU at its power cap drifts in clock under load, and a block's place in a round
    then decided its time by up to 10%. Raises _CallFailed for a call that raises."""
    return _cuda_in_turn if device.type == "cuda" else _cpu_in_turn


def _cpu_in_turn(calls: list[Callable]) -> list[float]:
    for i in range(len(calls)):
        _call(calls, i)

    def timed(i):
        start = time.perf_counter()
        _call(calls, i)
        return (time.perf_counter() - start) * 1e3

    return [statistics.median(ms) for ms in _in_turn(len(calls), 3, timed)]


def _cuda_in_turn(calls: list[Callable], warmup_ms: float = 25.0, rep_ms: float = 100.0) -> list[float]:
    """As triton.testing.do_bench (L2 flushed before every call, events around it), but the calls taken in turn:
    about warmup_ms of untimed passes, then about rep_ms * len(calls) of timed ones (at least 5)."""
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")

    def timed(i):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _call(calls, i)
        end.record()
        return start, end

    def elapsed(events):
        torch.cuda.synchronize()
        return [statistics.median(start.elapsed_time(end) for start, end in pairs) for pairs in events]

    pass_ms = max(sum(elapsed(_in_turn(len(calls), 5, timed))), 1e-3)
    _in_turn(len(calls), max(1, int(warmup_ms / pass_ms)), lambda i: _call(calls, i))
    return elapsed(_in_turn(len(calls), max(5, int(rep_ms * len(calls) / pass_ms)), timed))


def _standard_fits(case: Case, device: torch.device) -> bool:
    """Standard attention materialises B*H*N^2 scores (several copies for backward): skip when huge."""
    limit = 2**31 if device.type == "cuda" else 2**26
    return case.batch * case.heads * case.seqlen**2 <= limit


def _failure(exc: Exception) -> str:
    first_line = str(exc).splitlines()[0][:120] if str(exc) else ""
    return f"{type(exc).__name__}: {first_line}"


def run_case(case: Case, providers, device: torch.device, modes=MODES, rounds: int = 1) -> list[Result]:
    """Every provider on one case: each one's first call, error and memory, then ``rounds`` timing rounds of
    each mode, the providers timed together (_timer), the first of them rotated from round to round. A mode's ms
    is the median over the rounds."""
    trials = [_Trial(Result(case, p), device) for p in providers]
    live = [t for t in trials if t.prepare(modes)]
    time_all = _timer(device)
    for r in range(rounds):
        shift = r * len(live) // rounds
        for mode in modes:
            _time_round(time_all, live[shift:] + live[:shift], mode)
    for trial in trials:
        trial.finish()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return [t.result for t in trials]


def _time_round(time_all, trials: list[_Trial], mode: str) -> None:
    """One round of ``mode`` for the trials still available, timed together; a provider that fails is reported
    unavailable and the others are timed again without it. An error the timer cannot pin on one call (the GPU's,
    found at a synchronize) is reported for all of them."""
    while True:
        made = [(t, t.call(mode)) for t in trials if t.result.unavailable is None]
        made = [(t, call) for t, call in made if call is not None]  # None: the trial failed and says why
        if not made:
            return
        try:
            times = time_all([call for _, call in made])
        except _CallFailed as failed:
            made[failed.index][0].fail(failed.error)
            del made  # bwd: each call holds a graph; drop them before the retry makes new ones
            continue
        except Exception as exc:
            for trial, _ in made:
                trial.fail(exc)
            return
        for (trial, _), ms in zip(made, times, strict=True):
            trial.rounds.setdefault(mode, []).append(ms)
        return


class _Trial:
    """One provider on one case: its inputs and forward callable, and its timings round by round."""

    def __init__(self, result: Result, device: torch.device):
        self.result, self.device = result, device
        self.rounds: dict[str, list[float]] = {}

    def prepare(self, modes) -> bool:
        """First call (compile included), error and peak memory; False if the provider is unavailable."""
        result, device = self.result, self.device
        if result.provider in GPU_ONLY and device.type != "cuda":
            result.unavailable = "needs a CUDA GPU"
        elif result.provider == "standard" and not _standard_fits(result.case, device):
            result.unavailable = "N x N scores too large"
        else:
            with self._guard():
                self._first_call()
        return result.unavailable is None

    def _first_call(self) -> None:
        case = self.result.case
        dtype = getattr(torch, case.dtype)
        shape = (case.batch, case.seqlen, case.heads, case.head_dim)
        q, k, v = (torch.randn(shape, device=self.device, dtype=dtype, requires_grad=True) for _ in range(3))
        self.fwd = PROVIDERS[self.result.provider](q, k, v, case.causal)
        start = time.perf_counter()
        out = self.fwd()
        self.grad = torch.randn_like(out)
        out.backward(self.grad)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.result.first_call_s = time.perf_counter() - start
        self.result.max_error = _forward_error(out, q, k, v, case.causal)
        self.result.peak_extra_mib = _peak_extra_mib(self.fwd, self.grad, self.device)

    def call(self, mode: str) -> Callable | None:
        """What one timed call of ``mode`` runs (bwd: a backward through a graph kept from one forward now, so a
        round of bwd holds every provider's graph at once); None if making it failed."""
        fwd, grad = self.fwd, self.grad
        with self._guard():
            if mode == "fwd":
                return torch.no_grad()(fwd)
            if mode == "fwd_bwd":
                return lambda: fwd().backward(grad)
            graph_out = fwd()
            return lambda: graph_out.backward(grad, retain_graph=True)
        return None

    def fail(self, exc: Exception) -> None:
        self.result.unavailable = _failure(exc)
        self.fwd = self.grad = None

    def finish(self) -> None:
        """The medians over the rounds; drops the inputs."""
        result = self.result
        self.fwd = self.grad = None
        if result.unavailable is not None:
            return
        case = result.case
        for mode, times in self.rounds.items():
            result.ms[mode] = statistics.median(times)
            result.ms_rounds[mode] = times
            flops = attention_flops(case.batch, case.heads, case.seqlen, case.seqlen, case.head_dim, case.causal, mode)
            result.tflops[mode] = flops / (result.ms[mode] * 1e-3) / 1e12

    @contextlib.contextmanager
    def _guard(self):
        try:
            yield
        except Exception as exc:  # a peer that does not support this case, is not installed, or runs out of memory
            self.fail(exc)


def _forward_error(out, q, k, v, causal) -> float:
    one = [x[:1, :, :1].detach() for x in (q, k, v)]
    ref, _ = attention_reference(*one, causal=causal, compute_dtype=torch.float32)
    return (out[:1, :, :1].float() - ref).abs().max().item()


def _peak_extra_mib(fwd, grad, device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fwd().backward(grad)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def attach_ratios(results: list[Result]) -> None:
    """ratios[peer][mode] = peer ms / our ms on each of our results, for every peer measured on its case."""
    by_case: dict[Case, list[Result]] = {}
    for r in results:
        by_case.setdefault(r.case, []).append(r)
    for r in results:
        if r.provider != OURS:
            continue
        r.ratios = {
            peer.provider: {m: peer.ms[m] / r.ms[m] for m in r.ms if m in peer.ms}
            for peer in by_case[r.case]
            if peer.provider != OURS and peer.ms
        }


def _git(*args: str) -> str | None:
    with contextlib.suppress(subprocess.CalledProcessError, FileNotFoundError):
        return subprocess.check_output(
            ["git", *args], text=True, stderr=subprocess.DEVNULL, cwd=Path(__file__).parent
        ).rstrip("\n")
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


def _weights(cases: list[Case], device: torch.device) -> list[float]:
    """Each case's expected share of the run's time, for the progress estimate: on a GPU the timing passes are
    time-boxed, so cases cost about alike; on a CPU a case's time follows its FLOPs."""
    if device.type == "cuda":
        return [1.0] * len(cases)
    return [attention_flops(c.batch, c.heads, c.seqlen, c.seqlen, c.head_dim, c.causal, "fwd") for c in cases]


def _clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


PROGRESS_BAR = 24  # characters between the brackets


def _progress(cases: list[Case], weights: list[float], stream=None):
    """Yields the cases, showing on ``stream`` (stderr) the cases done, the time so far and the time left, estimated
    as the time per weight so far times the weight left: a bar redrawn in place on a terminal, a line per case in a
    log (a stream that is not a terminal)."""
    stream = stream or sys.stderr
    tty = stream.isatty()
    columns = shutil.get_terminal_size().columns - 1
    total, total_weight, done_weight = len(cases), sum(weights), 0.0
    start, drawn = time.perf_counter(), 0

    def show(text: str, last: bool = False) -> None:
        nonlocal drawn
        if tty:
            text = text[:columns]
            stream.write("\r" + text.ljust(drawn) + ("\n" if last else ""))
            drawn = len(text)
        else:
            stream.write(text + "\n")
        stream.flush()

    def bar(done: int) -> str:
        filled = PROGRESS_BAR * done // max(total, 1)
        return f"[{'#' * filled}{'.' * (PROGRESS_BAR - filled)}] " if tty else ""

    for i, (case, weight) in enumerate(zip(cases, weights, strict=True)):
        elapsed = time.perf_counter() - start
        left = _clock(elapsed * (total_weight - done_weight) / done_weight) if done_weight else "?"
        show(f"{bar(i)}{i}/{total} cases, {_clock(elapsed)} elapsed, ~{left} left: running {case.name}")
        yield case
        done_weight += weight
    show(f"{bar(total)}{total}/{total} cases in {_clock(time.perf_counter() - start)}", last=True)


def _tflops(x: float) -> str:
    return f"{x:.1f}" if x >= 1 else f"{x:.2g}"  # a CPU's are thousandths


def format_table(results: list[Result], modes) -> str:
    """Our rows, a column of ratios per peer that ran beside us (a peer unavailable on every case has none)."""
    ours = [r for r in results if r.provider == OURS and not r.unavailable]
    peers = [p for p in dict.fromkeys(r.provider for r in results) if any(p in r.ratios for r in ours)]
    lines = []
    header = f"{'case':<22}{'mode':<9}{'ms':>9}{'TFLOP/s':>9}{'max err':>10}{'peak MiB':>10}{'1st s':>8}"
    lines.append(header + "".join(f"{'x ' + p:>17}" for p in peers))
    for r in ours:
        for mode in (m for m in modes if m in r.ms):
            ratios = [r.ratios.get(p, {}).get(mode) for p in peers]
            memory = f"{r.peak_extra_mib:>10.1f}" if r.peak_extra_mib is not None else f"{'-':>10}"
            row = f"{r.case.name:<22}{mode:<9}{r.ms[mode]:>9.3f}{_tflops(r.tflops[mode]):>9}"
            row += f"{r.max_error:>10.1e}{memory}{r.first_call_s:>8.2f}"
            lines.append(row + "".join(f"{x:>17.2f}" if x else f"{'-':>17}" for x in ratios))
    return "\n".join(lines)


TABLE_LEGEND = (
    f"ms, TFLOP/s: {OURS}'s medians; max err: against an fp32 reference; peak MiB: the allocator's peak in one\n"
    "fwd+bwd beyond what was allocated before it; 1st s: the first fwd+bwd call's seconds, JIT compile included;\n"
    f"x peer: peer ms / {OURS} ms (above 1: {OURS} is faster)"
)


def first_calls(results: list[Result]) -> str:
    """Each provider's slowest first call (compile included) over the cases, on one line."""
    timed = [r for r in results if r.first_call_s is not None]
    slowest = {
        p: max((r for r in timed if r.provider == p), key=lambda r: r.first_call_s)
        for p in dict.fromkeys(r.provider for r in timed)
    }
    parts = [f"{p} {r.first_call_s:.2f} s ({r.case.name})" for p, r in slowest.items()]
    return "first fwd+bwd call, JIT compile included, slowest case: " + (", ".join(parts) or "none ran")


def unavailable_lines(results: list[Result]) -> list[str]:
    """One line per provider and reason: the cases it could not run."""
    cases = {r.case for r in results}
    missed: dict[tuple[str, str], list[str]] = {}
    for r in results:
        if r.unavailable:
            missed.setdefault((r.provider, r.unavailable), []).append(r.case.name)
    return [
        f"unavailable: {provider} on {f'all {len(names)} cases' if len(names) == len(cases) > 1 else ', '.join(names)}"
        f": {why}"
        for (provider, why), names in missed.items()
    ]


def plot(records: list[dict], modes, path: str, title: str) -> None:
    """One PNG: a grid of TFLOP/s-against-seqlen panels, a row per (head dim, causal), a column per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["case"]["head_dim"], r["case"]["causal"]) for r in records})
    providers = list(dict.fromkeys(r["provider"] for r in records))
    size = (4.2 * len(modes), 3.0 * len(groups))
    fig, axes = plt.subplots(len(groups), len(modes), figsize=size, squeeze=False, sharex=True, layout="constrained")
    for (head_dim, causal), row in zip(groups, axes, strict=True):
        for mode, ax in zip(modes, row, strict=True):
            for provider in providers:
                pts = sorted(
                    (r["case"]["seqlen"], r["tflops"][mode])
                    for r in records
                    if r["provider"] == provider
                    and (r["case"]["head_dim"], r["case"]["causal"]) == (head_dim, causal)
                    and mode in r["tflops"]
                )
                if pts:
                    width = 2.5 if provider == OURS else 1
                    ax.plot(*zip(*pts, strict=True), marker="o", markersize=3, label=provider, linewidth=width)
            ax.set_xscale("log", base=2)
            ax.set_title(f"d{head_dim}{' causal' if causal else ''} {mode}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=7)
        row[0].set_ylabel("TFLOP/s")
    for ax in axes[-1]:
        ax.set_xlabel("sequence length")
    handles: dict[str, object] = {}  # one legend for the figure: every provider drawn in any panel
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncol=len(handles), fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def _write_json(path: str, header: dict, results: list[Result], complete: bool) -> None:
    payload = {**header, "complete": complete, "results": [asdict(r) for r in results]}
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(path + ".tmp", path)


def load_results(path: str) -> tuple[dict, list[Result]]:
    """A results.json back as (its header, its results)."""
    with open(path) as f:
        payload = json.load(f)
    results = [Result(**{**r, "case": Case(**r["case"])}) for r in payload.pop("results")]
    return payload, results


def _resumable(path: str, env: dict, sweep: dict, cases) -> tuple[dict, list[Result]]:
    """The cases of an earlier, cut-short run that every provider finished, if it measured the same source
    on the same GPU and software in the same way (runs write whole cases; a case that files from before
    rounds left half done is measured again, so peers share a run)."""
    header, earlier = load_results(path)
    providers = sweep["providers"]
    mine = {**env, "modes": sweep["modes"], "rounds": sweep["rounds"], "timing": sweep["timing"]}
    theirs = {"autotune": False, **header["environment"]}  # runs from before the field did not tune
    old = header["sweep"]  # runs from before the fields: one round, providers timed in blocks
    theirs.update(modes=old["modes"], rounds=old.get("rounds", 1), timing=old.get("timing", "blocks"))
    for key in ("source_digest", "gpu", "driver", "torch", "triton", "autotune", "modes", "rounds", "timing"):
        if theirs.get(key) != mine.get(key):
            raise SystemExit(f"--resume {path}: its {key} is {theirs.get(key)!r}, this run's {mine.get(key)!r}")
    kept = []
    for case in cases:
        rows = {r.provider: r for r in earlier if r.case == case}
        if all(p in rows for p in providers):
            kept += [rows[p] for p in providers]
    return header["environment"], kept


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
        header["resumed_environment"], results = _resumable(args.resume, env, header["sweep"], cases)
    todo = [c for c in cases if c not in {r.case for r in results}]
    for case in _progress(todo, _weights(todo, device)):
        results += run_case(case, providers, device, args.modes, args.rounds)
        attach_ratios(results)
        _write_json(json_path, header, results, complete=False)
    results.sort(key=lambda r: (cases.index(r.case), providers.index(r.provider)))
    _write_json(json_path, header, results, complete=True)
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
