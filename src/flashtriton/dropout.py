"""The dropout mask, defined once and computed the same way on every path.

Element (b, h, i, j) of the attention probabilities (batch, head, query, key; indices within the
sequence) is kept iff the first word of Philox4x32-10 with key ``seed`` and counter (j, i, h, b),
shifted right by one, is >= ``threshold(dropout_p)``. The kernels draw it with ``tl.philox``
(kernels/common.py); this module draws the same bits with torch integer ops, so the PyTorch path
and the tests reproduce the kernels' mask exactly. Nothing is stored between forward and backward:
the backward regenerates the mask from the seed.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
PHILOX_ROUNDS = 10


def threshold(dropout_p: float) -> int:
    """Keep iff (philox >> 1) >= threshold: a 31-bit comparison, P(keep) = 1 - dropout_p to 2^-31."""
    return min(int(dropout_p * 2**31), 2**31 - 1)


def draw_seed() -> torch.Tensor:
    """A fresh Philox key from torch's default CPU generator, so torch.manual_seed replays it."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64)


def _umulhi(a: int, b: torch.Tensor) -> torch.Tensor:
    # the high 32 bits of a 32 x 32 bit product, without overflowing int64
    lo, hi = b & 0xFFFF, b >> 16
    mid = a * hi + ((a * lo) >> 16)
    return (mid >> 16) & _MASK32


def philox(seed: int, c0, c1, c2, c3) -> torch.Tensor:
    """First output word of Philox4x32-10 (as Triton's ``tl.philox``), elementwise; int64 tensors in [0, 2^32)."""
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    device = next((c.device for c in (c0, c1, c2, c3) if isinstance(c, torch.Tensor)), None)
    counters = (torch.as_tensor(c, dtype=torch.int64, device=device) for c in (c0, c1, c2, c3))
    c0, c1, c2, c3 = torch.broadcast_tensors(*counters)
    for _ in range(PHILOX_ROUNDS):
        c0, c1, c2, c3 = (
            _umulhi(_ROUND_B, c2) ^ c1 ^ k0,
            (_ROUND_B * c2) & _MASK32,
            _umulhi(_ROUND_A, c0) ^ c3 ^ k1,
            (_ROUND_A * c0) & _MASK32,
        )
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    return c0


def keep(seed: int, b, h, i, j, dropout_p: float) -> torch.Tensor:
    """Boolean keep-mask for broadcastable index tensors b, h, i, j."""
    return (philox(seed, j, i, h, b) >> 1) >= threshold(dropout_p)


def dropout_mask(
    seed: int, dropout_p: float, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, device=None
) -> torch.Tensor:
    """The keep-mask (batch, nheads, seqlen_q, seqlen_k) of a dense call, materialised (for tests and small inputs)."""
    idx = [torch.arange(n, device=device) for n in (batch, nheads, seqlen_q, seqlen_k)]
    b, h, i, j = (x.view([-1 if d == axis else 1 for d in range(4)]) for axis, x in enumerate(idx))
    return keep(seed, b, h, i, j, dropout_p)
