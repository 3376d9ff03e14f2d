"""Host microseconds per eager call, a base build against this tree and cuDNN SDPA, in turn: flash_attn_func at a tiny
shape (B1 N128 H1 D64, bf16: the GPU idles, so wall clock over many calls is host time) and flash_attn_with_kvcache
decode steps (32 query heads on 8 K/V heads, D=128, bf16, cache_seqlens a tensor), with, for the decode steps, the
device time of an eager call (CUDA events around a call after an L2 flush, no spin ahead of it: the host's time where
it exceeds the kernels', which the decode suite's timer, timing.TIMING_AHEAD, leaves out); then a cProfile of this
tree's causal fwd+bwd.

    python benchmarks/ab_sweep.py prepare BASE_COMMIT          # on any machine: writes ab-base/flashtriton_base
    PYTHONPATH=src:ab-base python benchmarks/host_ab.py [--suite attention decode] [--out host_ab.json]
    PYTHONPATH=src:ab-base python benchmarks/host_ab.py --cpu  # the CPU path (fp32) against SDPA on the CPU
"""

import argparse
import cProfile
import json
import pstats
import statistics
import time

import flashtriton_base
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtriton

CALLS, DECODE_CALLS, ROUNDS = 3000, 500, 5
HEADS, HEADS_K, HEAD_DIM = 32, 8, 128
DECODE = {  # name: (batch, cache rows, page size (0: contiguous), appended rows with rotary and causal)
    "B1 4k": (1, 4096, 0, 0),
    "B8 32k pages 16": (8, 32768, 16, 0),
    "B8 4k pages 16 append rotary causal": (8, 4096, 16, 1),
}


def _cudnn(q, k, v, causal=False):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def attention_calls(causal: bool, grad: bool, device: str) -> dict:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn(1, 128, 1, 64, device=device, dtype=dtype, requires_grad=grad) for _ in range(3))
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(grad) for x in (q, k, v))

    def call(attention, inputs):
        def forward():
            return attention(*inputs, causal=causal)

        def step():
            out = attention(*inputs, causal=causal)
            out.backward(out)  # dout = out: no extra kernel per call beyond the backward's
            for x in inputs:
                x.grad = None

        return step if grad else forward

    calls = {
        "base": call(flashtriton_base.flash_attn_func, (q, k, v)),
        "head": call(flashtriton.flash_attn_func, (q, k, v)),
    }
    if device == "cuda":
        calls["cudnn"] = call(_cudnn, (qt, kt, vt))
    else:  # the same ATen kernel, called by SDPA itself
        calls["sdpa"] = call(lambda *x, causal: F.scaled_dot_product_attention(*x, is_causal=causal), (qt, kt, vt))
    return calls


def decode_calls(batch: int, length: int, page: int, new: int) -> dict:
    d = dict(dtype=torch.bfloat16, device="cuda")
    q = torch.randn(batch, 1, HEADS, HEAD_DIM, **d)
    kwargs = dict(cache_seqlens=torch.full((batch,), length - new, dtype=torch.int32, device="cuda"))
    if page:
        shape = (batch * length // page, page, HEADS_K, HEAD_DIM)
        kwargs["block_table"] = torch.randperm(shape[0], device="cuda").view(batch, -1).to(torch.int32)
    else:
        shape = (batch, length, HEADS_K, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, **d), torch.randn(shape, **d)
    if new:
        angles = torch.rand(length, HEAD_DIM // 2, device="cuda") * 6.3
        k_new, v_new = (torch.randn(batch, new, HEADS_K, HEAD_DIM, **d) for _ in range(2))
        rotary = dict(rotary_cos=angles.cos().to(torch.bfloat16), rotary_sin=angles.sin().to(torch.bfloat16))
        kwargs.update(k=k_new, v=v_new, causal=True, **rotary)
    qt = q.transpose(1, 2).contiguous()
    kt, vt = (torch.randn(batch, HEADS_K, length, HEAD_DIM, **d) for _ in range(2))
    return {
        "base": lambda: flashtriton_base.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs),
        "head": lambda: flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs),
        "cudnn": lambda: _cudnn(qt, kt, vt),
    }


def wall_us(call, device: str, calls: int) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(50):
        call()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def flushed_us(call, repeats: int = 200) -> float:
    """Median device microseconds of a call between CUDA events after an L2 flush, the host's time included where
    it exceeds the kernels' (the decode suite's timer before TIMING_AHEAD)."""
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    pairs = []
    for _ in range(repeats):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs) * 1e3


def in_turn(calls: dict, measure) -> dict:
    """Each provider's median over ROUNDS rounds, the order rotated each round."""
    times = {name: [] for name in calls}
    names = list(calls)
    for r in range(ROUNDS):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(measure(calls[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CPU tensors (fp32) instead of a GPU's (bf16)")
    parser.add_argument("--suite", nargs="+", choices=["attention", "decode"], default=["attention", "decode"])
    parser.add_argument("--out", help="write the results to this JSON file")
    args = parser.parse_args()
    device = "cpu" if args.cpu else "cuda"
    results = {}
    if "attention" in args.suite:
        for causal in (False, True):
            for grad in (False, True):
                name = f"B1 N128 H1 D64{' causal' if causal else ''} {'fwd+bwd' if grad else 'fwd'}"
                results[name] = {
                    "host": in_turn(attention_calls(causal, grad, device), lambda c: wall_us(c, device, CALLS))
                }
    if "decode" in args.suite and device == "cuda":
        for name, shape in DECODE.items():
            calls = decode_calls(*shape)
            results[f"decode {name}"] = {
                "host": in_turn(calls, lambda c: wall_us(c, device, DECODE_CALLS)),
                "flushed": in_turn(calls, flushed_us),
            }
    for name, modes in results.items():
        for mode, us in modes.items():
            peers = "  ".join(f"{provider} {t:7.1f}" for provider, t in us.items())
            print(f"{name:48s} {mode:8s} us: {peers}  head-base {us['head'] - us['base']:+6.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"us": results, "rounds": ROUNDS}, f, indent=1)
    step = attention_calls(True, True, device)["head"]
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
