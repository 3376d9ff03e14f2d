"""Bad input gets a ValueError/TypeError naming the fix, before anything is launched; features
that do not exist yet say so instead of being ignored."""

import functools
from itertools import accumulate

import pytest
import torch

import flashtriton
from flashtriton import flash_attn_func, route, validation


def qkv(q_shape=(1, 8, 4, 16), kv_shape=(1, 8, 2, 16), dtype=torch.float32):
    return torch.randn(q_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype)


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Every case here must fail before a backend is chosen, let alone a kernel launched."""

    def launched(*args, **kwargs):
        raise AssertionError("a backend was called for invalid input")

    monkeypatch.setattr(route, "forward", launched)


CASES = {
    "q-rank": (lambda: (torch.randn(8, 4, 16), *qkv()[1:]), {}, ValueError, "must have 4 dims"),
    "not-a-tensor": (lambda: (qkv()[0].tolist(), *qkv()[1:]), {}, TypeError, "must be a torch.Tensor"),
    "batch": (lambda: qkv((2, 8, 4, 16)), {}, ValueError, "batch"),
    "head-dim-mismatch": (lambda: qkv((1, 8, 4, 32)), {}, ValueError, "head dim 32"),
    "k-v-mismatch": (lambda: (qkv()[0], qkv()[1], torch.randn(1, 9, 2, 16)), {}, ValueError, "same shape"),
    "gqa": (lambda: qkv((1, 8, 4, 16), (1, 8, 3, 16)), {}, ValueError, "multiple of k heads"),
    "dtype-mismatch": (lambda: (qkv()[0].half(), *qkv()[1:]), {}, ValueError, "one dtype"),
    "dtype-unsupported": (lambda: qkv(dtype=torch.float64), {}, TypeError, "supported dtypes are"),
    "head-dim-zero": (lambda: qkv((1, 8, 4, 0), (1, 8, 2, 0)), {}, ValueError, "head dim 0 is not supported"),
    "head-dim-large": (lambda: qkv((1, 8, 4, 257), (1, 8, 2, 257)), {}, ValueError, "from 1 to 256"),
    "scale-nan": (qkv, {"softmax_scale": float("nan")}, ValueError, "softmax_scale must be a finite number"),
    "scale-inf": (qkv, {"softmax_scale": float("-inf")}, ValueError, "softmax_scale must be a finite number"),
    "scale-past-fp32": (qkv, {"softmax_scale": 3e38}, ValueError, "softmax_scale = 3e\\+38 is outside fp32's range"),
    "scale-subnormal": (qkv, {"softmax_scale": -1e-39}, ValueError, "softmax_scale = -1e-39 is outside fp32's range"),
    "scale-type": (qkv, {"softmax_scale": "0.1"}, TypeError, "softmax_scale must be a float"),
    "scale-bool": (qkv, {"softmax_scale": True}, TypeError, "softmax_scale must be a float"),
    "dropout-one": (qkv, {"dropout_p": 1.0}, ValueError, "dropout_p must be in [0, 1)"),
    "dropout-negative": (qkv, {"dropout_p": -0.1}, ValueError, "dropout_p must be in [0, 1)"),
    "dropout-type": (qkv, {"dropout_p": "0.1"}, TypeError, "dropout_p must be a float"),
    # a string reads as true: causal="False" would mask
    "causal-string": (qkv, {"causal": "False"}, TypeError, "causal must be a bool (True or False), got 'False'"),
    "causal-none": (qkv, {"causal": None}, TypeError, "causal must be a bool"),
    "causal-two": (qkv, {"causal": 2}, TypeError, "causal must be a bool"),
    "deterministic-string": (qkv, {"deterministic": "no"}, TypeError, "deterministic must be a bool"),
    "window-range": (qkv, {"window_size": (-2, 0)}, ValueError, "each >= -1"),
    "window-right-range": (qkv, {"window_size": (4, -3)}, ValueError, "each >= -1"),
    "window-not-pair": (qkv, {"window_size": (4,)}, TypeError, "pair of ints (left, right)"),
    "window-float": (qkv, {"window_size": (4.0, 0)}, TypeError, "pair of ints (left, right)"),
    "window-bool": (qkv, {"window_size": (True, 0)}, TypeError, "pair of ints (left, right)"),
    "window-three": (qkv, {"window_size": [4, 0, 1]}, TypeError, "pair of ints (left, right)"),
    "window-int": (qkv, {"window_size": 4}, TypeError, "pair of ints (left, right)"),
    "window-tensor-three": (qkv, {"window_size": torch.tensor([4, 0, 1])}, TypeError, "pair of ints"),
    "window-tensor-2d": (qkv, {"window_size": torch.tensor([[4, 0]])}, TypeError, "pair of ints"),
    "window-tensor-float": (qkv, {"window_size": torch.tensor([4.0, 0.0])}, TypeError, "pair of ints"),
    "window-tensor-bool": (qkv, {"window_size": torch.tensor([True, False])}, TypeError, "pair of ints"),
    "window-tensor-range": (qkv, {"window_size": torch.tensor([-2, 0])}, ValueError, "unbounded), got (-2, 0)"),
    "softcap-negative": (qkv, {"softcap": -1.0}, ValueError, "softcap must be >= 0"),
    "softcap-inf": (qkv, {"softcap": float("inf")}, ValueError, "softcap must be >= 0 and finite"),
    "softcap-subnormal": (qkv, {"softcap": 1e-40}, ValueError, "softcap = 1e-40 is outside fp32's range"),
    # each in range, their ratio (which the kernels take in fp32) not
    "softcap-ratio": (qkv, {"softcap": 1e-30, "softmax_scale": 1e30}, ValueError, "softmax_scale / softcap = 1e"),
    # the kernels' tanh takes it times 2 log2(e): in range alone, out of it then
    "softcap-ratio-times-2-log2e": (qkv, {"softcap": 1.0, "softmax_scale": 1.5e38}, ValueError, "softmax_scale / "),
    "alibi-shape": (qkv, {"alibi_slopes": torch.ones(2)}, ValueError, "alibi_slopes must have shape (4,)"),
    "alibi-batch": (qkv, {"alibi_slopes": torch.ones(3, 4)}, ValueError, "or (1, 4) (batch, nheads)"),
    "alibi-dtype": (qkv, {"alibi_slopes": torch.ones(4, dtype=torch.float64)}, TypeError, "alibi_slopes.float()"),
    "alibi-type": (qkv, {"alibi_slopes": [1.0] * 4}, TypeError, "alibi_slopes must be a torch.Tensor"),
    "alibi-device": (qkv, {"alibi_slopes": torch.ones(4, device="meta")}, ValueError, "alibi_slopes.to(q.device)"),
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


def varlen(lens_q=(3, 0, 5), lens_k=(4, 2, 5), heads=(4, 2), dtype=torch.float32):
    """Arguments of flash_attn_varlen_func: q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k."""
    q = torch.randn(sum(lens_q), heads[0], 16, dtype=dtype)
    k, v = (torch.randn(sum(lens_k), heads[1], 16, dtype=dtype) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *accumulate(n)], dtype=torch.int32) for n in (lens_q, lens_k))
    return [q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)]


def with_arg(index, value, args=None):
    args = varlen() if args is None else args
    args[index] = value(args) if callable(value) else value
    return args


VARLEN_CASES = {
    "q-rank": (lambda: with_arg(0, lambda a: a[0][None]), ValueError, r"q must have 3 dims \(total_q, nheads"),
    "gqa": (lambda: varlen(heads=(4, 3)), ValueError, "multiple of k heads"),
    "dtype-mismatch": (lambda: with_arg(0, lambda a: a[0].half()), ValueError, "one dtype"),
    "cu-int64": (lambda: with_arg(3, lambda a: a[3].long()), TypeError, r"cu_seqlens_q.to\(torch.int32\)"),
    "cu-rank": (lambda: with_arg(4, lambda a: a[4][None]), ValueError, r"cu_seqlens_k must have 1 dims"),
    "cu-not-tensor": (lambda: with_arg(3, [0, 3, 3, 8]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
    "cu-device": (lambda: with_arg(3, lambda a: a[3].to("meta")), ValueError, r"cu_seqlens_q.to\(q.device\)"),
    "cu-strided": (  # the kernels read entry b at cu + b
        lambda: with_arg(4, lambda a: torch.stack([a[4], a[4]], 1)[:, 0]),
        ValueError,
        r"cu_seqlens_k.contiguous\(\)",
    ),
    "cu-batch-mismatch": (lambda: with_arg(4, lambda a: a[4][:-1]), ValueError, "for the same batch"),
    "cu-not-from-0": (lambda: with_arg(3, lambda a: a[3] + 1), ValueError, "must start at 0"),
    "cu-decreasing": (
        lambda: with_arg(4, torch.tensor([0, 4, 3, 11], dtype=torch.int32)),
        ValueError,
        r"must never decrease .* cu_seqlens_k\[1\] = 4 > cu_seqlens_k\[2\] = 3",
    ),
    "cu-q-total": (lambda: with_arg(0, lambda a: a[0][:-1]), ValueError, "cu_seqlens_q ends at 8 but the packed"),
    "cu-k-total": (
        lambda: with_arg(4, torch.tensor([0, 4, 6, 10], dtype=torch.int32)),
        ValueError,
        "cu_seqlens_k ends at 10 but the packed tensor has 11 tokens",
    ),
    "max-seqlen-small": (lambda: with_arg(5, 4), ValueError, "max_seqlen_q is 4 .* pass at least 5"),
    "max-seqlen-type": (lambda: with_arg(6, 5.0), TypeError, r"max_seqlen_k must be an int"),
    "max-seqlen-negative-no-sequences": (  # no length to compare with: the message still says the fix
        lambda: (
            *(torch.randn(0, 2, 16) for _ in range(3)),
            *(torch.zeros(1, dtype=torch.int32) for _ in range(2)),
            -1,
            0,
        ),
        ValueError,
        "max_seqlen_q is -1 .* pass at least 0",
    ),
}


@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_bad_varlen_input_raises_clear_error(name):
    make, error, message = VARLEN_CASES[name]
    with pytest.raises(error, match=message):
        flashtriton.flash_attn_varlen_func(*make())


def test_reused_cu_seqlens_are_rechecked_after_an_in_place_write():
    """cu_seqlens are read to the host once per tensor and version: a write in place must not go unseen."""
    q, k, _, cu_q, cu_k, max_q, max_k = varlen()
    check = functools.partial(validation.check_cu_seqlens, cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)
    check()  # valid: now cached
    cu_k[2] = 3  # cu_seqlens_k [0, 4, 3, 11]
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[1\] = 4 > cu_seqlens_k\[2\] = 3"):
        check()
    cu_k[1:][1] = 6  # through a view of the same storage: valid again
    check()


def test_varlen_options_are_checked():
    """Window, dropout, softcap and ALiBi get the same checks as in the dense API; ALiBi's batch is the sequences'."""
    with pytest.raises(ValueError, match="each >= -1"):
        flashtriton.flash_attn_varlen_func(*varlen(), window_size=(-5, 0))
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        flashtriton.flash_attn_varlen_func(*varlen(), dropout_p=1.5)
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        flashtriton.flash_attn_varlen_func(*varlen(), softcap=-2.0)
    with pytest.raises(ValueError, match=r"\(4,\) \(nheads\) or \(3, 4\) \(batch, nheads\)"):
        flashtriton.flash_attn_varlen_func(*varlen(), alibi_slopes=torch.ones(2, 4))


def test_varlen_packed_layouts_are_checked():
    q, k, v, cu_q, cu_k, max_q, max_k = varlen()
    with pytest.raises(ValueError, match=r"qkv must be \(total, 3, nheads, headdim\)"):
        flashtriton.flash_attn_varlen_qkvpacked_func(torch.stack([q, q], dim=1), cu_q, max_q)
    with pytest.raises(ValueError, match=r"kv must be \(total_k, 2, nheads_k, headdim\)"):
        flashtriton.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v, v], dim=1), cu_q, cu_k, max_q, max_k)


def test_packed_layouts_are_checked():
    with pytest.raises(ValueError, match=r"qkv must be \(batch, seqlen, 3"):
        flashtriton.flash_attn_qkvpacked_func(torch.randn(1, 8, 2, 4, 16))
    with pytest.raises(ValueError, match=r"kv must be \(batch, seqlen_k, 2"):
        flashtriton.flash_attn_kvpacked_func(torch.randn(1, 8, 4, 16), torch.randn(1, 8, 3, 4, 16))
