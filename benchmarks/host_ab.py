"""Host microseconds per eager call, a base build against this tree, at a tiny shape (B1 N128 H1 D64, bf16: the GPU
idles, so wall clock over many calls is host time); then a cProfile of this tree's causal fwd+bwd.

    python benchmarks/ab_sweep.py prepare BASE_COMMIT          # on any machine: writes ab-base/flashtriton_base
    PYTHONPATH=src:ab-base python benchmarks/host_ab.py        # on the GPU machine, ab-base carried
    PYTHONPATH=src:ab-base python benchmarks/host_ab.py --cpu  # the CPU path (fp32): its host time beside ATen's kernel
"""

import argparse
import cProfile
import pstats
import time

import flashtriton_base
import torch

import flashtriton

CALLS, ROUNDS = 3000, 5


def make(attention, causal: bool, grad: bool, device: str):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn(1, 128, 1, 64, device=device, dtype=dtype, requires_grad=grad) for _ in range(3))

    def forward():
        return attention(q, k, v, causal=causal)

    def step():
        out = attention(q, k, v, causal=causal)
        out.backward(out)  # dout = out: no extra kernel per call beyond the backward's
        q.grad = k.grad = v.grad = None

    return step if grad else forward


def wall_us(call, device: str) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(50):
        call()
    sync()
    start = time.perf_counter()
    for _ in range(CALLS):
        call()
    sync()
    return (time.perf_counter() - start) / CALLS * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CPU tensors (fp32) instead of a GPU's (bf16)")
    device = "cpu" if parser.parse_args().cpu else "cuda"
    builds = {"base": flashtriton_base.flash_attn_func, "head": flashtriton.flash_attn_func}
    for causal in (False, True):
        for grad in (False, True):
            calls = {name: make(attention, causal, grad, device) for name, attention in builds.items()}
            times = {name: [] for name in calls}
            for r in range(ROUNDS):  # alternate which build goes first
                for name in list(calls) if r % 2 == 0 else list(calls)[::-1]:
                    times[name].append(wall_us(calls[name], device))
            base, head = (sorted(times[name])[ROUNDS // 2] for name in builds)
            mode = "fwd+bwd" if grad else "fwd"
            print(f"causal={causal} {mode}: base {base:.1f} us, head {head:.1f} us, head-base {head - base:+.1f}")
    step = make(flashtriton.flash_attn_func, True, True, device)
    for _ in range(100):
        step()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(2000):
        step()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
