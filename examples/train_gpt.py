"""Train a GPT-3-style model on the bytes of Python's own standard library, its attention from flashtriton or a peer.

    python examples/train_gpt.py --model tiny --steps 50                    # CPU: a small model, a few minutes
    python examples/train_gpt.py --model 1.3b --context 2048 --batch 8      # one GPU
    python examples/train_gpt.py --attention sdpa-cudnn ...                  # the same run through a peer

The model is GPT-3's: learned positions, pre-LayerNorm blocks of causal self-attention and a 4x GELU MLP, the output
layer tied to the byte embedding (a 256-entry vocabulary: every machine has the same text and needs no tokenizer).
Training is bf16 autocast on CUDA (fp32 weights), AdamW, a linear warmup, gradient clipping; optionally activation
checkpointing per block. The attention is the only thing the ``--attention`` choice changes.
"""

from __future__ import annotations

import argparse
import math
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

import flashtriton


@dataclass(frozen=True)
class GPTConfig:
    layers: int
    hidden: int
    heads: int
    context: int = 2048
    vocab: int = 256  # bytes

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


MODELS = {  # GPT-3's sizes (Brown et al., 2020, Table 2.1), and a tiny one for CPUs
    "tiny": GPTConfig(layers=2, hidden=64, heads=4),
    "125m": GPTConfig(layers=12, hidden=768, heads=12),
    "1.3b": GPTConfig(layers=24, hidden=2048, heads=16),
    "2.7b": GPTConfig(layers=32, hidden=2560, heads=32),  # heads of 80
}


# Attention providers: (batch, seqlen, heads, head_dim) tensors in, the same layout out, causal.


def flashtriton_attention(q, k, v):
    return flashtriton.flash_attn_func(q, k, v, causal=True)


def _sdpa(backend: SDPBackend | None):
    def attention(q, k, v):
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # SDPA's (batch, heads, seqlen, head_dim)
        if backend is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2)

    return attention


def standard_attention(q, k, v):
    """softmax(Q K^T / sqrt(d)) V with the whole score matrix in memory: the paper's baseline."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    n = q.shape[2]
    future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")).float(), dim=-1).to(q.dtype)
    return (probs @ v).transpose(1, 2)


ATTENTION = {
    "flashtriton": flashtriton_attention,
    "sdpa-cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
    "sdpa-flash": _sdpa(SDPBackend.FLASH_ATTENTION),
    "sdpa": _sdpa(None),  # SDPA's own choice (also the CPU's)
    "standard": standard_attention,
}


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.ln1, self.ln2 = nn.LayerNorm(cfg.hidden), nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        width = 4 * cfg.hidden
        self.mlp = nn.Sequential(nn.Linear(cfg.hidden, width), nn.GELU(), nn.Linear(width, cfg.hidden))

    def forward(self, x: torch.Tensor, attention) -> torch.Tensor:
        batch, n, hidden = x.shape
        # (batch, seqlen, 3, heads, head_dim): q, k, v are strided views, taken as they are by flashtriton
        q, k, v = self.qkv(self.ln1(x)).view(batch, n, 3, self.heads, hidden // self.heads).unbind(2)
        x = x + self.proj(attention(q, k, v).reshape(batch, n, hidden))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, attention: str = "flashtriton", checkpointing: bool = False):
        super().__init__()
        self.cfg, self.attention, self.checkpointing = cfg, attention, checkpointing
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.positions = nn.Embedding(cfg.context, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.hidden)
        for name, p in self.named_parameters():  # GPT-2/3's initialisation: N(0, 0.02), residual outputs scaled down
            if p.dim() > 1:
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seqlen, vocab) for byte ids (batch, seqlen)."""
        attention = ATTENTION[self.attention]
        x = self.embed(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            if self.checkpointing and self.training:
                x = checkpoint(block, x, attention, use_reentrant=False)
            else:
                x = block(x, attention)
        return self.ln(x) @ self.embed.weight.T  # tied output layer

    def flops_per_sequence(self, seqlen: int) -> float:
        """Model FLOPs of a forward and backward over one sequence, as the FlashAttention-2 paper counts them (after
        Megatron-LM): 6 * seqlen * parameters + 12 * layers * hidden * seqlen^2; the second term is attention's, not
        halved for the causal mask."""
        params = sum(p.numel() for p in self.parameters())
        return 6 * seqlen * params + 12 * self.cfg.layers * self.cfg.hidden * seqlen**2


def stdlib_bytes() -> torch.Tensor:
    """The bytes of the Python standard library's .py sources (sorted paths, site-packages left out), as uint8."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    return torch.frombuffer(bytearray(b"".join(p.read_bytes() for p in files)), dtype=torch.uint8)


def batches(data: torch.Tensor, batch: int, seqlen: int, seed: int):
    """Endless (inputs, targets) pairs of random windows, the same for every run with this seed."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, data.numel() - seqlen - 1, (batch,), generator=generator)
        windows = torch.stack([data[s : s + seqlen + 1] for s in starts.tolist()]).long()
        yield windows[:, :-1], windows[:, 1:]


def train_step(model: GPT, optimizer, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One step; returns the loss (a tensor, not synchronised)."""
    with torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=inputs.is_cuda):
        logits = model(inputs)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def make_optimizer(model: GPT, lr: float, warmup: int):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    return optimizer, schedule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="tiny")
    parser.add_argument("--attention", choices=list(ATTENTION), default="flashtriton")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--checkpointing", action="store_true", help="recompute each block's activations")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = MODELS[args.model]
    cfg = GPTConfig(cfg.layers, cfg.hidden, cfg.heads, context=args.context)
    torch.manual_seed(args.seed)
    model = GPT(cfg, args.attention, args.checkpointing).to(device)
    optimizer, schedule = make_optimizer(model, args.lr, args.warmup)
    data = batches(stdlib_bytes(), args.batch, args.context, args.seed)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        inputs, targets = (x.to(device) for x in next(data))
        loss = train_step(model, optimizer, inputs, targets)
        schedule.step()
        if step % 10 == 0 or step == args.steps:
            tokens = step * args.batch * args.context
            print(f"step {step:5d}  loss {loss.item():.3f}  {tokens / (time.perf_counter() - start):,.0f} tokens/s")


if __name__ == "__main__":
    main()
