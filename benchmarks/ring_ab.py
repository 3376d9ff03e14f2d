"""Ring attention, this tree against a base build, call for call on the GPUs of one host; then a profile of one call.

    python benchmarks/ab_sweep.py prepare BASE_COMMIT          # on any machine: writes ab-base/flashtriton_base
    PYTHONPATH=src:ab-base torchrun --nproc-per-node 4 benchmarks/ring_ab.py --out DIR

Cases (bf16, causal, D=128): ragged packed documents at 128k tokens per GPU (H16 and GQA 32/8) and 32k (H16), and
one dense sequence at 128k (H16), each at world 1 and world 4, through the ring bench's ``run_case`` (the providers'
calls interleaved, rounds rotating their order, each call's time the slowest rank's); the dense one again under a
causal window of WINDOW rows ("-win" providers). Efficiency is per-GPU TFLOP/s against this tree's ring on one GPU
(with the window, whose work per GPU is the same at every world size: time on one GPU over time at world 4). Then
rank 0 profiles one ragged world-4 fwd+bwd at 128k per GPU and writes its kernels' device time
(DIR/profile_rank0.txt). Without a GPU it runs tiny fp32 cases on gloo (a dry run).

``--profile-only`` (no base build needed) profiles the ragged H16 cases at 128k and 32k per GPU instead
(DIR/profile_rank0_<case>.txt), each with rank 0's host time of a call (until it returns; a wait on the GPU
inside it counts) beside its wall time: where the two meet, the call waits on the host or on a sync.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from flashtriton.bench import ring as R

WINDOW = 4096


def _window_call(ring_flash_attn_func):
    def call(case: R.RingCase, group, q, k, v):
        window = dict(group=group, causal=True, window_size=(WINDOW, 0))
        return lambda: ring_flash_attn_func(q, k, v, **window), contextlib.nullcontext

    return call


def _base_call(case: R.RingCase, group, q, k, v):
    import flashtriton_base.distributed as base

    if not case.ragged:
        return lambda: base.ring_flash_attn_func(q, k, v, group=group, causal=True), contextlib.nullcontext
    packed = R._packed(case, q, k, v)
    return lambda: base.ring_flash_attn_varlen_func(*packed, group=group, causal=True), contextlib.nullcontext


def _cases(cuda: bool, world: int) -> list[R.RingCase]:
    shapes = [(True, 131072, 16, 16), (True, 131072, 32, 8), (True, 32768, 16, 16), (False, 131072, 16, 16)]
    if not cuda:
        return [R.RingCase(256, 2, 2, 64, w, ragged, "float32") for ragged in (True, False) for w in (1, world)]
    return [R.RingCase(n, h, hk, 128, w, ragged) for ragged, n, h, hk in shapes for w in (1, world)]


def _profile(case: R.RingCase, group, device: torch.device, out: Path, rank: int, name: str) -> None:
    """Rank 0's kernels in one fwd+bwd of this tree's ring on ``case``, by device time; and its host and wall ms per
    call (median of 5)."""
    q, k, v = R._inputs(case, device, rank)
    forward, _ = R._ring_call(case, group, q, k, v)
    grad = torch.randn_like(forward())
    for _ in range(2):
        forward().backward(grad)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    host, wall = [], []
    for _ in range(5):
        dist.barrier()
        sync()
        start = time.perf_counter()
        forward().backward(grad)
        host.append(time.perf_counter() - start)
        sync()
        wall.append(time.perf_counter() - start)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        forward().backward(grad)
        sync()
    if rank != 0:
        return
    kernels = [e for e in prof.key_averages() if str(getattr(e, "device_type", "")).endswith("CUDA")]
    rows = sorted(((e.device_time_total / 1e3, e.count, e.key) for e in kernels), reverse=True)
    lines = [
        f"{statistics.median(wall) * 1e3:9.2f} ms        a call's wall time, rank 0 (median of 5)",
        f"{statistics.median(host) * 1e3:9.2f} ms        its host time (until the call returns)",
        f"{sum(ms for ms, _, _ in rows):9.2f} ms        all kernels of {case.name}, rank 0",
    ]
    lines += [f"{ms:9.2f} ms {count:5d}  {name[:110]}" for ms, count, name in rows[:40]]
    (out / name).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:22]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="ring-ab")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile-only", action="store_true", help="only profile the ragged H16 cases at world 4")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    groups = {1: dist.new_group([0]), world: dist.new_group(list(range(world)))}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.profile_only:
        for case in (c for c in _cases(cuda, world) if c.ragged and c.heads == c.heads_k and c.world == world):
            _profile(case, groups[world], device, out, rank, f"profile_rank0_{case.name.split('/')[0]}.txt")
        dist.barrier()
        dist.destroy_process_group()
        return 0
    import flashtriton_base.distributed as base

    R.CALLS_OF["ring-base"] = _base_call
    R.CALLS_OF["ring-win"] = _window_call(R.ring_flash_attn_func)
    R.CALLS_OF["ring-win-base"] = _window_call(base.ring_flash_attn_func)
    results = []
    for case in _cases(cuda, world):
        providers = ["ring", "ring-base"] + ([] if case.ragged else ["ring-win", "ring-win-base"])
        if rank < case.world:
            results += R.run_case(case, providers, groups[case.world], device, args.rounds)
        dist.barrier()
        if rank == 0:
            print(f"{case.name}: done", file=sys.stderr, flush=True)
    if rank == 0:
        single = {(r.case, r.provider): r for r in results if r.case.world == 1}
        rows = []
        print(f"{'case':<34}{'provider':<14}{'ms':>10}{'efficiency':>12}{'peak MiB':>10}")
        for r in results:
            window = r.provider.startswith("ring-win")
            one = single[r.case.baseline, "ring-win" if window else "ring"]
            eff = None if r.ms is None else one.ms / r.ms if window else r.tflops_per_gpu / one.tflops_per_gpu
            rows.append(dict(case=r.case.name, provider=r.provider, ms=r.ms, ms_calls=r.ms_calls, efficiency=eff,
                             peak_mib=r.peak_mib, unavailable=r.unavailable))  # fmt: skip
            print(f"{r.case.name:<34}{r.provider:<14}{r.ms or 0:>10.2f}{eff or 0:>12.1%}{r.peak_mib or 0:>10.0f}")
        (out / "ring_ab.json").write_text(json.dumps(rows, indent=1))
    ragged = _cases(cuda, world)[1]
    _profile(ragged, groups[world], device, out, rank, "profile_rank0.txt")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
