"""``flashtriton bench --suite ring``: context parallelism's weak scaling, one process per GPU under torchrun:

    PYTHONPATH=src torchrun --nproc-per-node 4 -m flashtriton bench --suite ring --out DIR

Each case keeps the tokens per GPU fixed (32k and 128k) and runs on the first 1, 2 and 4 ranks (those up to the
torchrun world): causal fwd+bwd, D 128, heads 16/16 and GQA 32/8, bf16, one sequence or a packed batch of ragged
documents (PER_GPU_DOCUMENTS, repeated once per GPU). Providers: ``ring`` (ring_flash_attn_func, zigzag; varlen for
documents), ``ulysses`` (ulysses_flash_attn_func, varlen for documents, where the heads split over the ranks) and
``torch-cp`` (torch's experimental context_parallel around SDPA, on the whole torchrun world only; reported
unavailable where it fails).
On one rank every provider is single-GPU attention on the whole sequence.

Per-GPU TFLOP/s = the case's FLOPs (bench/cases.attention_flops: causal forward 2 * B * H * N^2 * D, fwd+bwd 3.5x the
forward; documents summed) / the slowest rank's time / world. Efficiency = a provider's per-GPU TFLOP/s / ring's on
one GPU at the same tokens per GPU, heads and documents. A timed call: every rank of the case synchronised by a
barrier, then fwd+bwd between CUDA events; rounds rotate the providers' order, calls interleaved; the median over
calls of the slowest rank. peak_mib: the allocator's peak during one fwd+bwd on the busiest rank (grows linearly in
the local length when memory scales). Rank 0 writes results.json after each case and prints the table.

Not under torchrun (one process): world 1 only, with a note. Without a GPU: a tiny case on the CPU with gloo.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..distributed import (
    ring_flash_attn_func,
    ring_flash_attn_varlen_func,
    ulysses_flash_attn_func,
    ulysses_flash_attn_varlen_func,
)
from .cases import attention_flops
from .results import environment, write_json
from .timing import peak_extra_mib

PER_GPU_TOKENS = (32768, 131072)
HEADS = ((16, 16), (32, 8))
HEAD_DIM = 128
WORLDS = (1, 2, 4)
PER_GPU_DOCUMENTS = (0.4, 0.25, 0.15, 0.1, 0.06, 0.04)  # fractions of a GPU's tokens: a ragged packed batch
DOCUMENT_STEP = 128  # document lengths are multiples of 2 * world * DOCUMENT_STEP (zigzag chunks of whole tiles)
CALLS = 3  # timed fwd+bwd calls per provider and round
CPU_TOKENS, CPU_HEADS, CPU_HEAD_DIM = 256, ((2, 2), (4, 2)), 64
PROVIDERS = ("ring", "ulysses", "torch-cp")
SCHEMA = "flashtriton-bench-ring/1"


@dataclass(frozen=True)
class RingCase:
    tokens: int  # per GPU
    heads: int
    heads_k: int
    head_dim: int
    world: int
    ragged: bool
    dtype: str = "bfloat16"

    @property
    def name(self) -> str:
        heads = f"h{self.heads}" + (f"/{self.heads_k}" if self.heads_k != self.heads else "")
        tokens = f"{self.tokens // 1024}k" if self.tokens >= 1024 else str(self.tokens)
        return f"{'docs' if self.ragged else 'seq'}-{tokens}/gpu-{heads}-d{self.head_dim}-w{self.world}"

    @property
    def baseline(self) -> RingCase:
        """The same case on one GPU: efficiency's reference."""
        return RingCase(self.tokens, self.heads, self.heads_k, self.head_dim, 1, self.ragged, self.dtype)

    def documents(self) -> list[int]:
        """The packed batch's lengths: PER_GPU_DOCUMENTS once per GPU, rounded down to whole zigzag chunks of
        DOCUMENT_STEP rows (8 on a CPU's tiny case), the last one taking what rounding left (the total is tokens *
        world); one sequence when not ragged."""
        total = self.tokens * self.world
        if not self.ragged:
            return [total]
        unit = DOCUMENT_STEP if self.tokens % (2 * DOCUMENT_STEP) == 0 else 8
        step = 2 * self.world * unit
        lengths = [int(f * self.tokens) // step * step for f in PER_GPU_DOCUMENTS * self.world]
        lengths[-1] += total - sum(lengths)
        return lengths

    def flops(self) -> float:
        return sum(attention_flops(1, self.heads, n, n, self.head_dim, True, "fwd_bwd") for n in self.documents())


@dataclass
class RingResult:
    case: RingCase
    provider: str
    ms: float | None = None
    ms_calls: list[float] = field(default_factory=list)
    tflops_per_gpu: float | None = None
    efficiency: float | None = None
    peak_mib: float | None = None
    unavailable: str | None = None


def cases(cuda: bool, world_max: int) -> list[RingCase]:
    worlds = [w for w in WORLDS if w <= world_max] if cuda else list(range(1, world_max + 1))
    if not cuda:
        return [RingCase(CPU_TOKENS, h, hk, CPU_HEAD_DIM, w, r, "float32") for h, hk in CPU_HEADS for r in (False, True)
                for w in worlds]  # fmt: skip
    return [
        RingCase(n, h, hk, HEAD_DIM, w, ragged)
        for ragged in (False, True)
        for n in PER_GPU_TOKENS
        for h, hk in HEADS
        for w in worlds
    ]


# Each provider: (forward, context): a step runs forward().backward(grad) inside context().


def _packed(case: RingCase, q, k, v) -> tuple:
    """A ragged case's packed (total / world, heads, D) q, k, v, its global cu_seqlens and longest document."""
    lengths = case.documents()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=q.device)
    return *(x.flatten(0, 1) for x in (q, k, v)), cu, max(lengths)


def _ring_call(case: RingCase, group, q, k, v):
    if not case.ragged:
        return lambda: ring_flash_attn_func(q, k, v, group=group, causal=True), contextlib.nullcontext
    packed = _packed(case, q, k, v)
    return lambda: ring_flash_attn_varlen_func(*packed, group=group, causal=True), contextlib.nullcontext


def _ulysses_call(case: RingCase, group, q, k, v):
    if case.heads % case.world or case.heads_k % case.world:
        raise ValueError(f"heads {case.heads}/{case.heads_k} do not split over {case.world} ranks")
    if not case.ragged:
        return lambda: ulysses_flash_attn_func(q, k, v, group=group, causal=True), contextlib.nullcontext
    packed = _packed(case, q, k, v)
    return lambda: ulysses_flash_attn_varlen_func(*packed, group=group, causal=True), contextlib.nullcontext


def _torch_cp_call(case: RingCase, group, q, k, v):
    """torch's context_parallel around SDPA on the whole world's mesh; SDPA alone on one rank."""
    if case.ragged:
        raise NotImplementedError("no document mask in torch's context_parallel with SDPA")
    gqa = case.heads != case.heads_k
    if case.world == 1:
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=gqa), (
            contextlib.nullcontext
        )
    if case.world != dist.get_world_size():
        raise ValueError("runs on the whole torchrun world only (its device mesh)")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh(q.device.type, (case.world,))
    # context_parallel shards whole-sequence buffers in place (forward and backward inside it): world x the shard,
    # without grad (it resizes them); the leaves are views of the shards it leaves in them
    full = [x.detach().transpose(1, 2).repeat(1, 1, case.world, 1) for x in (q, k, v)]

    def forward():
        leaves = [x.detach().requires_grad_() for x in full]
        return F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=gqa)

    return forward, lambda: context_parallel(mesh, buffers=full, buffer_seq_dims=[2, 2, 2])


CALLS_OF = {"ring": _ring_call, "ulysses": _ulysses_call, "torch-cp": _torch_cp_call}


def _inputs(case: RingCase, device: torch.device, rank: int) -> list[torch.Tensor]:
    generator = torch.Generator(device).manual_seed(rank)
    dtype = getattr(torch, case.dtype)
    shapes = [(1, case.tokens, h, case.head_dim) for h in (case.heads, case.heads_k, case.heads_k)]
    return [torch.randn(s, generator=generator, device=device, dtype=dtype).requires_grad_() for s in shapes]


class _Clock:
    """fwd+bwd wall time of one call on this rank: CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def time(self, step) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        start = time.perf_counter()
        step()
        return (time.perf_counter() - start) * 1e3


def _slowest(values: list[float], group) -> list[float]:
    """Each value's maximum over the group's ranks."""
    t = torch.tensor(values, dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def run_case(case: RingCase, providers: list[str], group, device: torch.device, rounds: int) -> list[RingResult]:
    """Every provider on the case, on the ranks of ``group`` (None: one process): first call, peak memory, then
    ``rounds`` rounds of CALLS interleaved calls each, the first provider rotated."""
    rank = dist.get_rank(group) if group is not None else 0
    q, k, v = _inputs(case, device, rank)
    results, steps = [], {}
    for provider in providers:
        result = RingResult(case, provider)
        results.append(result)
        try:
            forward, context = CALLS_OF[provider](case, group, q, k, v)
            with context():
                grad = torch.randn_like(forward())

            def step(forward=forward, context=context, grad=grad):
                with context():
                    forward().backward(grad)

            step()
            result.peak_mib = peak_extra_mib(step, device)
            steps[provider] = step
        except Exception as exc:  # a peer that does not run this case: say why, time the others
            result.unavailable = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
    clock, live = _Clock(device), [r for r in results if r.unavailable is None]
    for r in range(rounds):
        order = live[r % len(live) :] + live[: r % len(live)] if live else []
        for _ in range(CALLS):
            for result in order:
                if group is not None:
                    dist.barrier(group=group)
                result.ms_calls.append(clock.time(steps[result.provider]))
    for result in live:
        result.ms_calls = _slowest(result.ms_calls, group)
        result.ms = statistics.median(result.ms_calls)
        result.tflops_per_gpu = case.flops() / (result.ms * 1e-3) / 1e12 / case.world
        if result.peak_mib is not None:
            result.peak_mib = _slowest([result.peak_mib], group)[0]
    return results


def attach_efficiency(results: list[RingResult]) -> None:
    """efficiency = per-GPU TFLOP/s / ring's on one GPU at the same tokens per GPU, heads and documents."""
    single = {r.case: r.tflops_per_gpu for r in results if r.provider == "ring" and r.case.world == 1}
    for r in results:
        base = single.get(r.case.baseline)
        r.efficiency = r.tflops_per_gpu / base if r.tflops_per_gpu and base else None


def format_table(results: list[RingResult]) -> str:
    lines = [f"{'case':<34}{'provider':<10}{'ms':>10}{'TFLOP/s/GPU':>13}{'efficiency':>12}{'peak MiB':>10}"]
    for r in results:
        if r.unavailable:
            lines.append(f"{r.case.name:<34}{r.provider:<10}  unavailable: {r.unavailable}")
            continue
        eff = f"{r.efficiency:.1%}" if r.efficiency is not None else "-"
        peak = f"{r.peak_mib:.0f}" if r.peak_mib is not None else "-"
        lines.append(f"{r.case.name:<34}{r.provider:<10}{r.ms:>10.2f}{r.tflops_per_gpu:>13.3g}{eff:>12}{peak:>10}")
    return "\n".join(lines)


def _start() -> tuple[torch.device, list[str]]:
    """The device, a started process group when torchrun started several processes, and notes."""
    notes = []
    cuda = torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world == 1:
        notes.append(
            "one process: world size 1 only. Weak scaling needs one process per GPU: "
            "PYTHONPATH=src torchrun --nproc-per-node 4 -m flashtriton bench --suite ring --out DIR"
        )
    elif not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    if not cuda:
        notes.append(f"no CUDA GPU: a tiny fp32 case ({CPU_TOKENS} tokens per rank) on the CPU with gloo")
    return device, notes


def run(args: argparse.Namespace) -> int:
    device, notes = _start()
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    providers = [p for p in args.providers or PROVIDERS if p in PROVIDERS]
    todo = cases(device.type == "cuda", world)
    groups = {w: (dist.new_group(list(range(w))) if world > 1 else None) for w in sorted({c.world for c in todo})}
    out = Path(args.out).resolve()
    json_path = str(out / "results.json")
    header = {"schema": SCHEMA, "environment": environment(), "device": str(device), "world": world}
    header["sweep"] = {"suite": "ring", "providers": providers, "rounds": args.rounds, "calls": CALLS}
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
    results = []
    for case in todo:
        if rank < case.world:
            results += run_case(case, providers, groups[case.world], device, args.rounds)
        if world > 1:
            dist.barrier()  # ranks outside the case wait for it
        if rank == 0:
            attach_efficiency(results)
            write_json(json_path, header, results, complete=False)
            print(f"{case.name}: done", file=sys.stderr)
    if rank == 0:
        write_json(json_path, header, results, complete=True)
        print(format_table(results))
        print(f"results: {json_path}")
    with contextlib.suppress(Exception):
        if world > 1:
            dist.destroy_process_group()
    return 0
