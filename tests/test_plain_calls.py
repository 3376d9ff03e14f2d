"""flash_attn_func's plain calls reuse their checked parameters (interface._PLAIN, keyed by everything the checks
and AttentionParams read): a reused call gets the parameters the checks give, and no call skips a check it needs
(a bad input after a good one of the same shapes, grad mode, autocast)."""

import pytest
import torch

import flashtriton
from flashtriton import interface


def _qkv(dtype=torch.float32, requires_grad=False):
    torch.manual_seed(0)
    q = torch.randn(2, 37, 4, 24, dtype=dtype, requires_grad=requires_grad)
    k, v = (torch.randn(2, 29, 2, 24, dtype=dtype, requires_grad=requires_grad) for _ in range(2))
    return q, k, v


@pytest.fixture
def params_seen(monkeypatch):
    """Each call's AttentionParams, as _attention receives them; the reuse table starts empty."""
    monkeypatch.setattr(interface, "_PLAIN", {})
    seen = []
    attention = interface._attention

    def spy(q, k, v, params, return_attn_probs):
        seen.append(params)
        return attention(q, k, v, params, return_attn_probs)

    monkeypatch.setattr(interface, "_attention", spy)
    return seen


OPTIONS = [
    {},
    {"causal": True},
    {"window_size": (5, 0), "softmax_scale": 0.3},
    {"window_size": [40, 3], "softcap": 2.0},  # a bound past seqlen_k is none
    {"softmax_scale": -0.5, "deterministic": True},
    {"causal": True, "return_attn_probs": True},
]


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_a_reused_call_gets_the_checked_parameters(options, grad, params_seen):
    q, k, v = _qkv(requires_grad=grad)
    first = flashtriton.flash_attn_func(q, k, v, **options)
    assert len(interface._PLAIN) == 1  # the call was plain: its parameters are kept
    second = flashtriton.flash_attn_func(q, k, v, **options)
    assert params_seen[1] is params_seen[0]  # reused
    interface._PLAIN.clear()
    flashtriton.flash_attn_func(q, k, v, **options)
    assert params_seen[2] is not params_seen[0] and params_seen[2] == params_seen[0]  # as the checks give them
    for a, b in zip(*(x if isinstance(x, tuple) else (x,) for x in (first, second)), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    if grad:  # the reused call wrote the LSE its backward needs
        (second[0] if isinstance(second, tuple) else second).sum().backward()
        assert q.grad is not None and torch.isfinite(q.grad).all()


FIELDS = {  # one call of the same tensors and another that differs from it in one field of the key
    "causal": ({}, {"causal": True}),
    "deterministic": ({}, {"deterministic": True}),
    "return_attn_probs": ({}, {"return_attn_probs": True}),
    "window": ({"window_size": (5, 0)}, {"window_size": (6, 0)}),
    "scale": ({"softmax_scale": 0.25}, {"softmax_scale": 0.5}),
    "softcap": ({}, {"softcap": 3.0}),
}


@pytest.mark.parametrize("field", FIELDS)
def test_calls_that_differ_in_one_field_get_their_own_parameters(field, params_seen):
    """Each field of the key tells calls apart: the second call's parameters are its own, as the checks give them."""
    q, k, v = _qkv()
    first, second = FIELDS[field]
    flashtriton.flash_attn_func(q, k, v, **first)
    flashtriton.flash_attn_func(q, k, v, **second)
    assert params_seen[1] != params_seen[0]
    interface._PLAIN.clear()
    flashtriton.flash_attn_func(q, k, v, **second)
    assert params_seen[2] == params_seen[1]


def test_other_key_lengths_get_their_own_parameters(params_seen):
    """seqlen_k is in the key through k's shape: a window bound past it is none (-1), one inside it is kept."""
    q, k, v = _qkv()
    flashtriton.flash_attn_func(q, k, v, window_size=(30, 0))  # 29 keys: no left bound
    flashtriton.flash_attn_func(q, torch.cat([k, k], 1), torch.cat([v, v], 1), window_size=(30, 0))
    assert params_seen[0].window_left == -1 and params_seen[1].window_left == 30


def test_not_plain_calls_are_not_kept(params_seen):
    q, k, v = _qkv()
    flashtriton.flash_attn_func(q, k, v, alibi_slopes=torch.rand(4))
    flashtriton.flash_attn_func(q, k, v, sinks=torch.randn(4))
    flashtriton.flash_attn_func(q, k, v, learnable_sink=torch.randn(4))
    flashtriton.flash_attn_func(q, k, v, window_size=torch.tensor([3, 0]))
    flashtriton.flash_attn_func(q, k, v, dropout_p=0.1)
    flashtriton.flash_attn_func(q, k, v, causal=1)
    assert not interface._PLAIN


@pytest.mark.parametrize(
    "bad, error, message",
    [
        ({"k_dtype": torch.float64}, ValueError, "share one dtype"),
        ({"softmax_scale": float("nan")}, ValueError, "finite"),
        ({"softcap": -1.0}, ValueError, "softcap"),
        ({"window_size": (-2, 0)}, ValueError, "window_size"),
        ({"deterministic": "no"}, TypeError, "deterministic must be a bool"),
    ],
    ids=["dtype", "scale", "softcap", "window", "deterministic"],
)
def test_bad_input_after_a_good_call_of_its_shapes_still_raises(bad, error, message, params_seen):
    q, k, v = _qkv()
    flashtriton.flash_attn_func(q, k, v, causal=True)
    flashtriton.flash_attn_func(q, k, v, causal=True, deterministic=True)  # a key a truthy bad flag would find
    bad = dict(bad)
    if "k_dtype" in bad:
        k = k.to(bad.pop("k_dtype"))
    with pytest.raises(error, match=message):
        flashtriton.flash_attn_func(q, k, v, causal=True, **bad)
    with pytest.raises(error, match=message):  # and again: a failed call is not kept
        flashtriton.flash_attn_func(q, k, v, causal=True, **bad)


def test_grad_mode_and_autocast_are_part_of_the_key(params_seen):
    q, k, v = _qkv(requires_grad=True)
    with torch.no_grad():
        flashtriton.flash_attn_func(q, k, v, causal=True)  # an inference call: no LSE
    assert not params_seen[-1].write_lse
    out = flashtriton.flash_attn_func(q, k, v, causal=True)
    assert params_seen[-1].write_lse
    out.sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert flashtriton.flash_attn_func(q, k, v, causal=True).dtype == torch.bfloat16


def test_meta_tensors_give_shapes_on_either_path(params_seen):
    """Meta tensors (shape inference; no autocast serves their device) give meta outputs and gradients of the right
    shapes, on the checked call and on the reused one."""
    q = torch.randn(2, 37, 4, 24, device="meta", requires_grad=True)
    k = torch.randn(2, 29, 2, 24, device="meta", requires_grad=True)
    for _ in range(2):
        out = flashtriton.flash_attn_func(q, k, k, causal=True)
        assert out.device.type == "meta" and out.shape == q.shape
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    assert len(interface._PLAIN) == 1
