"""Per-kernel GPU time of an eager fwd+bwd, a base build against this tree, in one process (torch.profiler): which
kernel a whole-call A/B's difference lives in.

    python benchmarks/ab_sweep.py prepare BASE_COMMIT        # on any machine: writes ab-base/flashtriton_base
    PYTHONPATH=src:ab-base python benchmarks/kernel_ab.py     # on the GPU machine, ab-base carried

Each shape's fwd+bwd (bf16, fresh gradients by torch.autograd.grad) runs 20 times under the profiler per build, twice
in turn; a kernel's time is its CUDA time per step, the second pass's.
"""

import collections

import flashtriton_base
import torch
from torch.profiler import ProfilerActivity, profile

import flashtriton

SHAPES = ((4, 4096, 8, 256, True), (4, 4096, 8, 256, False), (4, 4096, 32, 64, True), (1, 16384, 16, 128, True))
STEPS = 20


def kernel_us(build, batch: int, n: int, heads: int, head_dim: int, causal: bool) -> dict[str, float]:
    q, k, v = (
        torch.randn(batch, n, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    dout = torch.randn(batch, n, heads, head_dim, device="cuda", dtype=torch.bfloat16)

    def step():
        return torch.autograd.grad(build.flash_attn_func(q, k, v, causal=causal), (q, k, v), dout)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    times = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name[:40]] += event.device_time / STEPS
    return times


def main() -> None:
    for shape in SHAPES:
        for _ in range(2):
            base, head = kernel_us(flashtriton_base, *shape), kernel_us(flashtriton, *shape)
        batch, n, heads, head_dim, causal = shape
        print(f"B{batch} N{n} H{heads} D{head_dim} {'causal' if causal else 'dense'}")
        for name in sorted(set(base) | set(head), key=lambda x: -max(base.get(x, 0), head.get(x, 0))):
            b, h = base.get(name, 0.0), head.get(name, 0.0)
            ratio = h / b if b else float("nan")
            print(f"   {name:42s} base {b:8.1f} us  head {h:8.1f} us  {ratio:6.3f}")


if __name__ == "__main__":
    main()
