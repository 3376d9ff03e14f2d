"""torch.compile(fullgraph=True) traces through the custom op: no graph break, same numbers."""

import pytest
import torch

from flashtriton import flash_attn_func
from helpers import TARGETS


class Block(torch.nn.Module):
    def __init__(self, dim=64, heads=4, heads_k=2):
        super().__init__()
        self.heads, self.heads_k, self.head_dim = heads, heads_k, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * heads_k * self.head_dim)
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.head_dim)
        k, v = self.kv(x).view(b, n, 2, self.heads_k, self.head_dim).unbind(2)
        return self.o(flash_attn_func(q, k, v, causal=True).reshape(b, n, -1))


@pytest.mark.parametrize("backend", TARGETS, ids=str, indirect=True)
def test_fullgraph_compile_matches_eager(backend):
    torch._dynamo.reset()
    model = Block().to(backend.device)
    x = torch.randn(2, 37, 64, device=backend.device, requires_grad=True)
    eager = model(x)
    (grad_eager,) = torch.autograd.grad(eager.sum(), x)
    # Inductor on CPU needs a C++ toolchain and minutes; aot_eager traces the same graph.
    compiler = "inductor" if backend.device == "cuda" else "aot_eager"
    compiled = torch.compile(model, fullgraph=True, backend=compiler)
    out = compiled(x)
    (grad,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(grad, grad_eager)


def test_opcheck():
    """torch.library's own consistency checks of the fake, autograd and schema registrations."""
    q, k, v = (torch.randn(1, 9, 2, 16, requires_grad=True) for _ in range(3))
    slopes = torch.rand(1, 2)
    seed = torch.tensor([1234])
    no_masks = ([], [], "", [], "", [])  # block-mask lists and shape, mask_mod, score_mod
    # cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window (left, right), softcap, alibi, dropout
    args = (None, None, 0, 0, 0.25, 3, 0, 5.0, slopes, 0.1, seed, *no_masks, False)
    torch.library.opcheck(torch.ops.flashtriton.attention_forward.default, (q, k, v, *args))
    cu_seqlens = torch.tensor([0, 4, 9], dtype=torch.int32)
    packed = [x[0].detach().requires_grad_() for x in (q, k, v)]
    varlen = (cu_seqlens, cu_seqlens, 5, 5, 0.25, -1, 0, 0.0, None, 0.0, None, *no_masks, False)
    torch.library.opcheck(torch.ops.flashtriton.attention_forward.default, (*packed, *varlen))
