"""Bad input gets a ValueError/TypeError naming the fix, before anything is launched; features
that do not exist yet say so instead of being ignored."""

import pytest
import torch

import flashtriton
from flashtriton import flash_attn_func, ops


def qkv(q_shape=(1, 8, 4, 16), kv_shape=(1, 8, 2, 16), dtype=torch.float32):
    return torch.randn(q_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype)


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Every case here must fail before a backend is chosen, let alone a kernel launched."""

    def launched(*args, **kwargs):
        raise AssertionError("a backend was called for invalid input")

    monkeypatch.setattr(ops, "select_backend", launched)


CASES = {
    "q-rank": (lambda: (torch.randn(8, 4, 16), *qkv()[1:]), {}, ValueError, "must have 4 dims"),
    "not-a-tensor": (lambda: (qkv()[0].tolist(), *qkv()[1:]), {}, TypeError, "must be a torch.Tensor"),
    "batch": (lambda: qkv((2, 8, 4, 16)), {}, ValueError, "batch"),
    "head-dim-mismatch": (lambda: qkv((1, 8, 4, 32)), {}, ValueError, "head dim 32"),
    "k-v-mismatch": (lambda: (qkv()[0], qkv()[1], torch.randn(1, 9, 2, 16)), {}, ValueError, "same shape"),
    "gqa": (lambda: qkv((1, 8, 4, 16), (1, 8, 3, 16)), {}, ValueError, "multiple of k heads"),
    "dtype-mismatch": (lambda: (qkv()[0].half(), *qkv()[1:]), {}, ValueError, "one dtype"),
    "dtype-unsupported": (lambda: qkv(dtype=torch.float64), {}, TypeError, "supported dtypes are"),
    "head-dim-odd": (lambda: qkv((1, 8, 4, 12), (1, 8, 2, 12)), {}, ValueError, "multiple of 8"),
    "head-dim-large": (lambda: qkv((1, 8, 4, 264), (1, 8, 2, 264)), {}, ValueError, "from 8 to 256"),
    "scale-negative": (qkv, {"softmax_scale": -1.0}, ValueError, "positive finite"),
    "scale-type": (qkv, {"softmax_scale": "0.1"}, TypeError, "softmax_scale must be a float"),
    "dropout-range": (qkv, {"dropout_p": 1.0}, ValueError, "[0, 1)"),
    "window-range": (qkv, {"window_size": (-2, 0)}, ValueError, ">= -1"),
    "softcap-negative": (qkv, {"softcap": -1.0}, ValueError, "softcap must be >= 0"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_raises_clear_error(name):
    make, kwargs, error, message = CASES[name]
    with pytest.raises(error, match=message.replace("[", r"\[").replace(")", r"\)").replace("(", r"\(")):
        flash_attn_func(*make(), **kwargs)


def test_device_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="one device"):
        flash_attn_func(q, k.to("meta"), v.to("meta"))


@pytest.mark.parametrize(
    "kwargs,what",
    [
        ({"dropout_p": 0.1}, "dropout_p"),
        ({"window_size": (16, 0)}, "local attention"),
        ({"softcap": 30.0}, "softcap"),
        ({"alibi_slopes": torch.ones(4)}, "alibi_slopes"),
    ],
    ids=["dropout", "window", "softcap", "alibi"],
)
def test_features_not_implemented_yet_say_so(kwargs, what):
    with pytest.raises(NotImplementedError, match=what):
        flash_attn_func(*qkv(), **kwargs)


@pytest.mark.parametrize(
    "fn,args",
    [
        (flashtriton.flash_attn_varlen_func, 7),
        (flashtriton.flash_attn_varlen_qkvpacked_func, 3),
        (flashtriton.flash_attn_varlen_kvpacked_func, 6),
        (flashtriton.flash_attn_with_kvcache, 3),
    ],
    ids=lambda x: getattr(x, "__name__", str(x)),
)
def test_later_apis_exist_and_raise(fn, args):
    with pytest.raises(NotImplementedError, match="not implemented yet"):
        fn(*[None] * args)


def test_packed_layouts_are_checked():
    with pytest.raises(ValueError, match=r"qkv must be \(batch, seqlen, 3"):
        flashtriton.flash_attn_qkvpacked_func(torch.randn(1, 8, 2, 4, 16))
    with pytest.raises(ValueError, match=r"kv must be \(batch, seqlen_k, 2"):
        flashtriton.flash_attn_kvpacked_func(torch.randn(1, 8, 4, 16), torch.randn(1, 8, 3, 4, 16))
