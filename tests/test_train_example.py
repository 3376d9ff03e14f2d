"""examples/train_gpt.py on the CPU: a tiny GPT's training steps with flashtriton's attention match SDPA's, and the
benchmark's FLOP count (the FlashAttention-2 paper's formula) for the paper's 1.3B model."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train_gpt


def _losses(attention: str, steps: int = 3) -> list[float]:
    torch.manual_seed(0)
    cfg = train_gpt.GPTConfig(layers=2, hidden=32, heads=2, context=24)
    model = train_gpt.GPT(cfg, attention)
    optimizer, _ = train_gpt.make_optimizer(model, lr=1e-3, warmup=1)
    text = torch.arange(4096, dtype=torch.int64).mul(7919).remainder(256).to(torch.uint8)  # stand-in bytes
    data = train_gpt.batches(text, batch=3, seqlen=cfg.context, seed=0)
    return [train_gpt.train_step(model, optimizer, *next(data)).item() for _ in range(steps)]


@pytest.mark.parametrize("peer", ["sdpa", "standard"])
def test_training_steps_match_peers(peer):
    ours, theirs = _losses("flashtriton"), _losses(peer)
    assert all(torch.isfinite(torch.tensor(ours)))
    assert ours == pytest.approx(theirs, rel=1e-4)
    assert ours[0] == pytest.approx(torch.log(torch.tensor(256.0)).item(), rel=0.05)  # a fresh model: near uniform


def test_flops_of_the_papers_13b_model():
    with torch.device("meta"):
        model = train_gpt.GPT(train_gpt.MODELS["1.3b"])
    params = sum(p.numel() for p in model.parameters())
    assert 1.2e9 < params < 1.3e9  # byte vocabulary: GPT-3 XL's blocks without its 50k-token embedding
    assert model.flops_per_sequence(2048) == 6 * 2048 * params + 12 * 24 * 2048 * 2048**2


def test_stdlib_text_loads():
    text = train_gpt.stdlib_bytes()
    assert text.dtype == torch.uint8 and text.numel() > 1_000_000
