"""Keys of another length than the queries (cross-attention; one causal case, its mask aligned bottom-right): this tree
against a base build and SDPA (cuDNN, else FlashAttention-2 or memory-efficient, whichever takes the mask, on
contiguous (B, H, N, D)), device time after an L2 flush, the calls in turn, medians of 5 rounds; fwd and fwd+bwd
(fresh gradients by torch.autograd.grad).

    python benchmarks/ab_sweep.py prepare BASE_COMMIT              # writes ab-base/flashtriton_base
    PYTHONPATH=src:ab-base python benchmarks/cross_probe.py        # on a GPU; writes $OUT/cross_probe.json
"""

import json
import os
import statistics

import flashtriton_base
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

import flashtriton
from flashtriton.bench import timing

CASES = (  # head dim, batch, query heads, K/V heads, n_q, n_k, causal
    (128, 4, 16, 16, 1000, 4096, False),
    (128, 4, 16, 16, 4096, 1000, False),
    (64, 4, 16, 16, 1024, 4096, False),
    (256, 4, 16, 16, 1024, 4096, False),
    (64, 8, 20, 20, 448, 1500, False),  # a speech decoder's queries against its encoder's frames
    (128, 2, 32, 8, 2048, 8192, False),
    (128, 2, 16, 16, 2048, 8192, True),
)
SDPA_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
ROUNDS = 5


def providers(d, b, h, h_k, n_q, n_k, causal) -> tuple[dict, dict]:
    """Each provider's forward and its fwd+bwd, on the same values."""
    q = torch.randn(b, n_q, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, n_k, h_k, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    doutt = dout.transpose(1, 2).contiguous()
    mask = causal_lower_right(n_q, n_k) if causal else None

    def sdpa():
        with sdpa_kernel(SDPA_BACKENDS):
            return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=h != h_k)

    forwards = {
        "head": lambda: flashtriton.flash_attn_func(q, k, v, causal=causal),
        "base": lambda: flashtriton_base.flash_attn_func(q, k, v, causal=causal),
        "sdpa": sdpa,
    }
    leaves = {"head": ((q, k, v), dout), "base": ((q, k, v), dout), "sdpa": ((qt, kt, vt), doutt)}
    steps = {name: (lambda f=f, inputs=leaves[name]: torch.autograd.grad(f(), *inputs)) for name, f in forwards.items()}
    return forwards, steps


def main() -> None:
    time_all = timing.device_timer(torch.device("cuda"))
    rows = []
    for case in CASES:
        forwards, steps = providers(*case)
        with torch.no_grad():
            exact = forwards["sdpa"]().transpose(1, 2).float()
            diff = {n: round((forwards[n]().float() - exact).abs().max().item(), 4) for n in ("head", "base")}
        row = dict(zip(("d", "b", "h", "h_k", "n_q", "n_k", "causal"), case, strict=True), max_diff_vs_sdpa=diff)
        for mode, calls in (("fwd", forwards), ("fwd_bwd", steps)):
            names = list(calls)
            with torch.no_grad() if mode == "fwd" else torch.enable_grad():
                rounds = [time_all([calls[n] for n in names]) for _ in range(ROUNDS)]
            ms = dict(zip(names, (statistics.median(r) for r in zip(*rounds, strict=True)), strict=True))
            row[mode] = {n: round(t, 4) for n, t in ms.items()}
            row[f"{mode}_sdpa_over_head"] = round(ms["sdpa"] / ms["head"], 3)
            row[f"{mode}_base_over_head"] = round(ms["base"] / ms["head"], 3)
        rows.append(row)
        print(row, flush=True)
        with open(os.environ.get("OUT", ".") + "/cross_probe.json", "w") as f:  # after every case: a cut run keeps it
            json.dump(rows, f, indent=1)
    print("d b h/h_k n_q n_k causal | fwd: sdpa/head base/head | fwd+bwd: sdpa/head base/head")
    for r in rows:
        print(
            f"{r['d']} {r['b']} {r['h']}/{r['h_k']} {r['n_q']} {r['n_k']} {r['causal']} | {r['fwd_sdpa_over_head']} "
            f"{r['fwd_base_over_head']} | {r['fwd_bwd_sdpa_over_head']} {r['fwd_bwd_base_over_head']}"
        )


if __name__ == "__main__":
    main()
