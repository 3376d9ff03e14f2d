"""Timing one case: each provider's first call, error and memory, then rounds in which the providers' calls are
timed in turn (CUDA: each after an L2 flush, events around it; CPU: perf_counter; host time: wall clock over blocks
of calls), the medians over the rounds."""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ..reference import attention_reference
from .cases import MODES, Case, Result
from .providers import GPU_ONLY, PROVIDERS

TIMING = "in turn"  # how a round times its providers (device_timer); runs from before timed each in a block
# device_timer(ahead=True): L2 flushed by a read, and the GPU kept ahead of the host by a spin before each timed call,
# as long as this many times the longest of the calls' host times (plus AHEAD_MIN_MS), so that a slow phase of the host
# stays hidden too
TIMING_AHEAD = "in turn, ahead"
AHEAD_MARGIN = 3.0
AHEAD_MIN_MS = 0.05
HOST_CALLS = 200  # calls per host-time block on a GPU, one synchronize after the block
CPU_HOST_CALLS = 10  # on a CPU each call finishes before it returns: a short block does
HOST_PASSES = 3  # blocks per provider in a round of host time


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


@functools.cache
def _torch_first_backward() -> None:
    """A process's first backward given a gradient imports torch modules (sympy among them), which would count in
    the first call of whichever provider ran first; run once before any first call."""
    x = torch.ones(2, requires_grad=True)
    (x * 2).backward(torch.ones(2))  # a gradient given, as the first calls give theirs


def device_timer(device: torch.device, ahead: bool = False) -> Callable[[list[Callable]], list[float]]:
    """``time_all(calls)``: each call's median milliseconds, the calls timed one of each in turn rather than one
    after another in blocks: a GPU at its power cap drifts in clock under load, and a block's place in a round
    then decided its time by up to 10%. Raises _CallFailed for a call that raises.

    On a GPU a timed call follows an L2 flush; where its host time is longer than the flush, the GPU waits for its
    launches between the events, and the host's time shows as the device's. ``ahead``: a spin kernel before each
    timed call keeps the GPU's queue ahead of the host (TIMING_AHEAD), and the flush reads instead of writing (a
    written one leaves L2 full of dirty lines, whose write-back the timed call would pay), so that the events time
    the device's work for the call alone; a call that synchronizes inside (a host read) still shows the host's time
    after that."""
    if device.type != "cuda":
        return _cpu_in_turn
    return functools.partial(_cuda_in_turn, ahead=ahead)


def _cpu_in_turn(calls: list[Callable]) -> list[float]:
    for i in range(len(calls)):
        _call(calls, i)

    def timed(i):
        start = time.perf_counter()
        _call(calls, i)
        return (time.perf_counter() - start) * 1e3

    return [statistics.median(ms) for ms in _in_turn(len(calls), 3, timed)]


def host_calls(device: torch.device, gpu_calls: int = HOST_CALLS) -> int:
    return gpu_calls if device.type == "cuda" else CPU_HOST_CALLS


def host_timer(device: torch.device, gpu_calls: int = HOST_CALLS) -> Callable[[list[Callable]], list[float]]:
    """``time_all(calls)``: each call's median wall milliseconds per call over blocks of host_calls(device,
    gpu_calls) calls with no synchronize between them, one after the block: where the device keeps up, the host's
    time per call. The calls are taken block by block in turn. Raises _CallFailed for a call that raises."""
    block_calls = host_calls(device, gpu_calls)

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def time_all(calls: list[Callable]) -> list[float]:
        def block(i):
            synchronize()
            start = time.perf_counter()
            for _ in range(block_calls):
                _call(calls, i)
            synchronize()
            return (time.perf_counter() - start) * 1e3 / block_calls

        for i in range(len(calls)):
            _call(calls, i)
        return [statistics.median(ms) for ms in _in_turn(len(calls), HOST_PASSES, block)]

    return time_all


def _cuda_in_turn(
    calls: list[Callable], warmup_ms: float = 25.0, rep_ms: float = 100.0, ahead: bool = False
) -> list[float]:
    """As triton.testing.do_bench (L2 flushed before every call, events around it), but the calls taken in turn:
    about warmup_ms of untimed passes, then about rep_ms * len(calls) of timed ones (at least 5). ``ahead``:
    device_timer's; the spins count in those milliseconds."""
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    spin_cycles, spin_ms = 0, 0.0  # each spin's (ahead), set before the first timed call

    def timed(i):
        if ahead:  # read: a written flush leaves L2 dirty, its write-back charged to the timed call's reads
            flush.sum()
        else:
            flush.zero_()
        if spin_cycles:
            torch.cuda._sleep(spin_cycles)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _call(calls, i)
        end.record()
        return start, end

    def elapsed(events):
        torch.cuda.synchronize()
        return [statistics.median(start.elapsed_time(end) for start, end in pairs) for pairs in events]

    def host_ms(i):
        """The host's milliseconds to make call i (its launches, not its kernels)."""
        torch.cuda.synchronize()
        start = time.perf_counter()
        _call(calls, i)
        return (time.perf_counter() - start) * 1e3

    if ahead:
        spin_ms = AHEAD_MARGIN * max(statistics.median(ms) for ms in _in_turn(len(calls), 5, host_ms)) + AHEAD_MIN_MS
        spin_cycles = int(spin_ms * _spin_cycles_per_ms(torch.cuda.current_device()))
    pass_ms = max(sum(elapsed(_in_turn(len(calls), 5, timed))), 1e-3)
    _in_turn(len(calls), max(1, int(warmup_ms / pass_ms)), lambda i: _call(calls, i))
    passes = rep_ms * len(calls) / (pass_ms + len(calls) * spin_ms)
    return elapsed(_in_turn(len(calls), max(5, int(passes)), timed))


@functools.cache
def _spin_cycles_per_ms(device: int) -> float:
    """Cycles of torch.cuda._sleep per millisecond on GPU ``device`` (the current one), read once after a spin that
    raises its clock (a clock higher later makes the spins shorter: AHEAD_MARGIN leaves room)."""
    cycles = 2**22
    torch.cuda._sleep(cycles)  # the clock ramps up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def _standard_fits(case: Case, device: torch.device) -> bool:
    """Standard attention materialises B*H*N^2 scores (several copies for backward): skip when huge."""
    limit = 2**31 if device.type == "cuda" else 2**26
    return case.batch * case.heads * case.seqlen**2 <= limit


def _failure(exc: Exception) -> str:
    first_line = str(exc).splitlines()[0][:120] if str(exc) else ""
    return f"{type(exc).__name__}: {first_line}"


def run_case(case: Case, providers, device: torch.device, modes=MODES, rounds: int = 1) -> list[Result]:
    """Every provider on one case: each one's first call, error and memory, then ``rounds`` timing rounds of
    each mode, the providers timed together (device_timer), the first of them rotated from round to round. A mode's
    ms is the median over the rounds."""
    trials = [Trial(Result(case, p), device) for p in providers]
    return run_trials(trials, device, dict.fromkeys(modes, device_timer(device)), rounds)


def run_trials(trials: list[Trial], device: torch.device, timers: dict[str, Callable], rounds: int) -> list[Result]:
    """run_case's rounds on trials made elsewhere: each mode of ``timers`` timed by its timer (a device_timer's or a
    host_timer's time_all); no modes: first calls only."""
    modes = list(timers)
    live = [t for t in trials if t.prepare(modes)]
    for r in range(rounds):
        shift = r * len(live) // rounds
        for mode in modes:
            _time_round(timers[mode], live[shift:] + live[:shift], mode)
    for trial in trials:
        trial.finish()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return [t.result for t in trials]


def _time_round(time_all, trials: list[Trial], mode: str) -> None:
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


class Trial:
    """One provider on one case: its inputs and forward callable, and its timings round by round."""

    gpu_only = GPU_ONLY  # providers reported unavailable without a CUDA GPU

    def __init__(self, result: Result, device: torch.device):
        self.result, self.device = result, device
        self.rounds: dict[str, list[float]] = {}

    def prepare(self, modes) -> bool:
        """First call (compile included), error and peak memory; False if the provider is unavailable."""
        result, device = self.result, self.device
        if result.provider in self.gpu_only and device.type != "cuda":
            result.unavailable = "needs a CUDA GPU"
        elif result.provider == "standard" and not _standard_fits(result.case, device):
            result.unavailable = "N x N scores too large"
        else:
            _torch_first_backward()
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
        self.result.max_error = forward_error(out, q, k, v, case.causal)
        self.result.peak_extra_mib = peak_extra_mib(lambda: self.fwd().backward(self.grad), self.device)

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
        self._drop()

    def _drop(self) -> None:
        """Lets go of the inputs (the callables hold them)."""
        self.fwd = self.grad = None

    def finish(self) -> None:
        """The medians over the rounds; drops the inputs."""
        result = self.result
        self._drop()
        if result.unavailable is not None:
            return
        for mode, times in self.rounds.items():
            result.ms[mode] = statistics.median(times)
            result.ms_rounds[mode] = times
        self.rates()

    def rates(self) -> None:
        """The work per second of each mode timed: FLOPs / time."""
        result = self.result
        for mode, ms in result.ms.items():
            result.tflops[mode] = result.case.flops(mode) / (ms * 1e-3) / 1e12

    @contextlib.contextmanager
    def _guard(self):
        try:
            yield
        except Exception as exc:  # a peer that does not support this case, is not installed, or runs out of memory
            self.fail(exc)


def forward_error(out, q, k, v, causal, rows: int | None = None) -> float:
    """Max abs difference from an fp32 reference on the first (batch, head): on its last ``rows`` queries (None:
    all), which see every key they would see in the whole (masks align bottom-right), so N x N scores are not
    needed."""
    rows = rows or q.shape[1]
    k1, v1 = (x[:1, :, :1].detach() for x in (k, v))
    ref, _ = attention_reference(q[:1, -rows:, :1].detach(), k1, v1, causal=causal, compute_dtype=torch.float32)
    return (out[:1, -rows:, :1].float() - ref).abs().max().item()


def peak_extra_mib(step: Callable[[], object], device) -> float | None:
    """The allocator's peak during ``step()`` beyond what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20
