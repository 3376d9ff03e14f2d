"""A Llama-shaped model's training step through transformers, its attention by flashtriton against SDPA (cuDNN and
SDPA's own choice), in one process: the users' layout end to end (transformers hands (B, H, N, D) tensors, which
flashtriton takes as (B, N, H, D) views without copies).

    PYTHONPATH=src python benchmarks/llama_train.py [--layers 16] [--cases 4x2048 1x8192] [--out llama.json]

Random weights (bf16), random token ids, no padding: every provider computes the same causal attention. A step is
forward, loss and backward (gradients freed after each step, no optimizer); the providers' steps are taken in turn
over --rounds rounds, each the median of --steps CUDA-event timings of one step. Needs a GPU and transformers.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaConfig, LlamaForCausalLM

from flashtriton.integrations.transformers import register

IMPLEMENTATION = register()  # flashtriton.integrations.transformers: the one line a user writes

PROVIDERS = {  # name: (transformers attention implementation, SDPA backends allowed)
    "flashtriton": (IMPLEMENTATION, None),
    "sdpa-cudnn": ("sdpa", [SDPBackend.CUDNN_ATTENTION]),
    "sdpa": ("sdpa", None),
}


def model(layers: int, device: str) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers, num_attention_heads=16,
        num_key_value_heads=4, max_position_embeddings=16384,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)


def step_ms(net: LlamaForCausalLM, implementation: str, backends, ids: torch.Tensor, steps: int) -> float:
    net.set_attn_implementation(implementation)
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with sdpa_kernel(backends) if backends else torch.enable_grad():
            start.record()
            loss = net(input_ids=ids, labels=ids).loss
            loss.backward()
            end.record()
        net.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--cases", nargs="+", default=["4x2048", "1x8192"], help="BATCHxTOKENS")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    args = parser.parse_args()
    net = model(args.layers, "cuda")
    results = []
    for case in args.cases:
        batch, tokens = map(int, case.split("x"))
        ids = torch.randint(0, net.config.vocab_size, (batch, tokens), device="cuda")
        for implementation, backends in PROVIDERS.values():  # warm up: compiles, autotuning, cuDNN plans
            step_ms(net, implementation, backends, ids, 2)
        rounds = {name: [] for name in PROVIDERS}
        for _ in range(args.rounds):
            for name, (implementation, backends) in PROVIDERS.items():
                rounds[name].append(step_ms(net, implementation, backends, ids, args.steps))
        ms = {name: statistics.median(values) for name, values in rounds.items()}
        results.append({"batch": batch, "tokens": tokens, "layers": args.layers, "ms": ms, "rounds": rounds})
        peers = "  ".join(f"{name} {ms[name]:.2f} ms ({ms[name] / ms['flashtriton']:.3f}x)" for name in PROVIDERS)
        print(f"B{batch} T{tokens} layers {args.layers}: {peers}", flush=True)
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
