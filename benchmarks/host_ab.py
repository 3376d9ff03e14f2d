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


def make(fn, causal, grad):
    q, k, v = (torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.bfloat16, requires_grad=grad) for _ in range(3))
    if not grad:
        return lambda: fn(q, k, v, causal=causal)

    def step():
        out = fn(q, k, v, causal=causal)
        out.backward(out)  # dout = out: no extra kernel per call beyond the backward's
        q.grad = k.grad = v.grad = None

    return step


def wall(f, n=3000):
    for _ in range(50):
        f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


for causal in (False, True):
    for grad in (False, True):
        fs = {
            "base": make(flashtriton_base.flash_attn_func, causal, grad),
            "head": make(flashtriton.flash_attn_func, causal, grad),
        }
        res = {name: [] for name in fs}
        for r in range(5):
            for name in list(fs) if r % 2 == 0 else list(fs)[::-1]:
                res[name].append(wall(fs[name]))
        med = {k: sorted(v)[2] for k, v in res.items()}
        print(
            f"causal={causal} {'fwd+bwd' if grad else 'fwd'}: base {med['base']:.1f} us, head {med['head']:.1f} us, head-base {med['head'] - med['base']:+.1f}",
            flush=True,
        )
step = make(flashtriton.flash_attn_func, True, True)
for _ in range(100):
    step()
prof = cProfile.Profile()
prof.enable()
for _ in range(2000):
    step()
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(25)
