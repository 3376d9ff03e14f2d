"""flashtriton.integrations.sdpa: SDPA's FlashAttention ops computed by flashtriton.

On the CPU the ops' kernels are registered for the CPU key (where they have none of their own) and called directly;
on a GPU (torch with the flash-impl registry) activate() puts them behind F.scaled_dot_product_attention, and the
profiler shows which calls run flashtriton's kernels and which fall back to torch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtriton.integrations import sdpa
from helpers import Shape, assert_close_to_reference, random_qkv, reference_outputs

HAS_REGISTRY = hasattr(torch.nn.attention, "activate_flash_attention_impl")
FLASH = torch.ops.aten._scaled_dot_product_flash_attention.default

CASES = [
    (Shape(2, 67, 67, 4, 4, 32), dict(is_causal=True)),
    (Shape(1, 40, 100, 6, 2, 64), dict(scale=0.3)),  # GQA, more keys than queries
    (Shape(1, 33, 33, 2, 1, 16), dict(is_causal=True, scale=-0.7)),  # MQA, a negative scale
]


@pytest.fixture
def cpu_kernels():
    """flashtriton's kernels for SDPA's flash ops under the CPU key, unregistered after the test."""
    library = sdpa._library("CPU")
    yield
    del library


def _bhnd(*tensors):
    return tuple(x.detach().transpose(1, 2).requires_grad_() for x in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,options", CASES, ids=lambda x: str(x) if isinstance(x, Shape) else "-".join(x))
def test_flash_ops_match_the_reference(cpu_kernels, shape, options, dtype):
    """Out, LSE and the gradients through aten's own autograd formula (its backward op), against the fp64 reference."""
    torch.manual_seed(0)
    q, k, v = _bhnd(*random_qkv(shape, dtype, "cpu"))
    out, lse, *_ = FLASH(q, k, v, 0.0, options.get("is_causal", False), scale=options.get("scale"))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    args = [x.detach().transpose(1, 2) for x in (q, k, v)]
    causal, scale = options.get("is_causal", False), options.get("scale")
    dout_bnhd, dlse = dout.transpose(1, 2), torch.zeros(lse.shape)
    exact = reference_outputs(*args, dout_bnhd, dlse, causal, scale)
    plain = reference_outputs(*args, dout_bnhd, dlse, causal, scale, compute_dtype=dtype)
    ours = (out.transpose(1, 2), lse, *(g.transpose(1, 2) for g in grads))
    for name, actual, e, p in zip(("out", "lse", "dq", "dk", "dv"), ours, exact, plain, strict=True):
        assert_close_to_reference(name, actual, e, p)


def test_dropout_backward_drops_what_the_forward_dropped(cpu_kernels):
    """The forward's Philox key comes back in rng_state: the backward's gradients are those of the same mask, so two
    runs from one torch seed agree bitwise, and the forward drew exactly one key from torch's generator."""
    shape = Shape(1, 50, 50, 2, 2, 16)
    results = []
    for _ in range(2):
        torch.manual_seed(3)
        q, k, v = _bhnd(*random_qkv(shape, torch.float32, "cpu"))
        out, _, _, _, _, _, seed, _, _ = FLASH(q, k, v, 0.25, True)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        results.append((out, seed.view(torch.int64), *grads, torch.rand(1)))
    assert results[0][1][0] != 0  # the key, in the first of rng_state's two words
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd", "packed"])
def test_flash_op_outputs_are_laid_out_as_its_meta_function_says(cpu_kernels, layout, dropout_p):
    """torch.compile checks a kernel's outputs against the op's meta function: out in the query's layout (whichever
    storage it views), rng_state and the offset in their shapes and dtypes."""
    shape = (2, 3, 40, 16)
    if layout == "bhnd":
        q, k, v = (torch.randn(shape) for _ in range(3))
    elif layout == "bnhd":  # a model's (B, N, H, D) projections viewed as (B, H, N, D)
        q, k, v = (torch.randn(2, 40, 3, 16).transpose(1, 2) for _ in range(3))
    else:  # views into one packed (B, N, 3, H, D) projection: not dense
        q, k, v = torch.randn(2, 40, 3, 3, 16).unbind(2)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    ours = FLASH(q, k, v, dropout_p, True)
    meta = FLASH(*(torch.empty_strided(x.shape, x.stride(), device="meta") for x in (q, k, v)), dropout_p, True)
    for index in (0, 1, 6, 7):  # out, LSE, rng_state, offset
        assert (ours[index].shape, ours[index].dtype) == (meta[index].shape, meta[index].dtype), index
    assert ours[0].stride() == meta[0].stride() == torch.empty_like(q).stride()


def test_bad_calls_say_what_to_do(cpu_kernels):
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="top-left"):
        FLASH(q, torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16), 0.0, True)
    with pytest.raises(NotImplementedError, match="deactivate"):
        FLASH(q, q, q, 0.0, False, True)


@pytest.mark.skipif(not HAS_REGISTRY, reason="this torch has no flash-impl registry for SDPA")
def test_activate_holds_the_flash_backend_until_deactivate():
    assert not sdpa.active()
    sdpa.activate()
    try:
        assert sdpa.active() and torch.nn.attention.current_flash_attention_impl() == sdpa.NAME
    finally:
        sdpa.deactivate()
    assert not sdpa.active() and torch.nn.attention.current_flash_attention_impl() is None


@pytest.mark.skipif(HAS_REGISTRY, reason="this torch has the registry")
def test_activate_without_the_registry_names_the_torch_that_has_it():
    with pytest.raises(RuntimeError, match=r"2\.11"):
        sdpa.activate()


def _kernels(call) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


def _ours(kernels: set[str]) -> bool:
    return any(name.startswith("attention_") for name in kernels)


@pytest.mark.skipif(not (HAS_REGISTRY and torch.cuda.is_available()), reason="needs a GPU and the registry")
def test_sdpa_calls_go_to_flashtriton_where_sdpa_picks_flash():
    """Calls SDPA sends to its FlashAttention backend run flashtriton's kernels (fwd and bwd, matching the fp64
    reference); a masked call and a call pinned to cuDNN run torch's, as before activate()."""
    shape = Shape(2, 300, 300, 8, 8, 64)
    torch.manual_seed(0)
    q, k, v = _bhnd(*random_qkv(shape, torch.bfloat16, "cuda"))
    dout = torch.randn_like(q)
    sdpa.activate()
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            assert _ours(_kernels(lambda: torch.autograd.grad(
                F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), dout)))  # fmt: skip
        mask = torch.ones(300, 300, dtype=torch.bool, device="cuda").tril()
        assert not _ours(_kernels(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            assert not _ours(_kernels(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)))
    finally:
        sdpa.deactivate()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        assert not _ours(_kernels(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)))
    args = [x.detach().transpose(1, 2) for x in (q, k, v)]
    dlse = torch.zeros(2, 8, 300, device="cuda")
    exact = reference_outputs(*args, dout.transpose(1, 2), dlse, True)
    plain = reference_outputs(*args, dout.transpose(1, 2), dlse, True, compute_dtype=torch.bfloat16)
    ours = (out.transpose(1, 2), *(g.transpose(1, 2) for g in grads))
    without_lse = exact[:1] + exact[2:], plain[:1] + plain[2:]
    for name, actual, e, p in zip(("out", "dq", "dk", "dv"), ours, *without_lse, strict=True):
        assert_close_to_reference(name, actual, e, p)
