"""Host microseconds per eager call, a base build against this tree, at a tiny shape (B1 N128 H1 D64, bf16: the GPU
idles, so wall clock over many calls is host time); then a cProfile of this tree's causal fwd+bwd.

    python benchmarks/ab_sweep.py prepare BASE_COMMIT          # on any machine: writes ab-base/flashtriton_base
    PYTHONPATH=src:ab-base python benchmarks/host_ab.py        # on the GPU machine, ab-base carried
"""

import cProfile
import pstats
import time

import flashtriton_base
import torch

import flashtriton

CALLS, ROUNDS = 3000, 5


def make(attention, causal: bool, grad: bool):
    q, k, v = (torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.bfloat16, requires_grad=grad) for _ in range(3))

    def forward():
        return attention(q, k, v, causal=causal)

    def step():
        out = attention(q, k, v, causal=causal)
        out.backward(out)  # dout = out: no extra kernel per call beyond the backward's
        q.grad = k.grad = v.grad = None

    return step if grad else forward


def wall_us(call) -> float:
    for _ in range(50):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / CALLS * 1e6


def main() -> None:
    builds = {"base": flashtriton_base.flash_attn_func, "head": flashtriton.flash_attn_func}
    for causal in (False, True):
        for grad in (False, True):
            calls = {name: make(attention, causal, grad) for name, attention in builds.items()}
            times = {name: [] for name in calls}
            for r in range(ROUNDS):  # alternate which build goes first
                for name in list(calls) if r % 2 == 0 else list(calls)[::-1]:
                    times[name].append(wall_us(calls[name]))
            base, head = (sorted(times[name])[ROUNDS // 2] for name in builds)
            mode = "fwd+bwd" if grad else "fwd"
            print(f"causal={causal} {mode}: base {base:.1f} us, head {head:.1f} us, head-base {head - base:+.1f}")
    step = make(flashtriton.flash_attn_func, True, True)
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
