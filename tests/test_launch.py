"""flashtriton.launch: its launch key separates whatever Triton specialises a kernel on, and on a Hopper GPU
repeated calls launch without Triton's per-call binding and reproduce the first call's results."""

import itertools

import pytest
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.jit import JITFunction

from flashtriton import flash_attn_func, launch, triton_backend


def _descriptors() -> list[launch.Descriptor]:
    x = torch.randn(2, 256, 4, 64, dtype=torch.bfloat16)
    return [
        triton_backend._gluon_view(x, 64),
        triton_backend._gluon_view(x[:, 1:], 64),  # another base and shape, the same specialisation
        triton_backend._gluon_view(x, 128),
        triton_backend._gluon_view(x.half(), 64),
        triton_backend._gluon_view(x.float(), 64, 32),
        triton_backend._gluon_rows(torch.randn(300), 64),
    ]


def _values() -> list:
    ints = [0, 1, 2, 15, 16, 17, 48, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**32, 2**63 - 16, 2**63, 2**64 - 16]
    dtypes, offsets = (torch.bfloat16, torch.float32), (0, 1, 8)
    tensors = [torch.empty(64, dtype=dtype)[offset:] for dtype in dtypes for offset in offsets]
    return [*ints, True, False, None, 0.5, 1.0, *tensors, *_descriptors()]


def _triton(x):
    if isinstance(x, launch.Descriptor):
        x = x.gluon()
    return native_specialize_impl(CUDABackend, x, False, True, True)


def test_launch_key_separates_what_triton_specialises_on():
    values = _values()
    same = 0
    for a, b in itertools.combinations(values, 2):
        if launch._spec(a) == launch._spec(b) and type(a) is type(b):
            same += 1
            assert _triton(a) == _triton(b), (a, b)
    assert same > 10  # the check compared something


def test_launch_key_refuses_unknown_arguments():
    with pytest.raises(TypeError, match="no launch key"):
        launch._spec([1, 2])


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU"
)
def test_hopper_repeat_calls_skip_tritons_binding(monkeypatch):
    runs = []
    run = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **kw: runs.append(self.fn.__name__) or run(self, *a, **kw))

    def step():
        # fresh tensors each call (new addresses), 512 keys: the Gluon forward, dQ and dK/dV kernels
        torch.manual_seed(0)
        shapes = [(2, 512, h, 128) for h in (8, 2, 2)]
        q, k, v = (torch.randn(s, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s in shapes)
        out = flash_attn_func(q, k, v, causal=True)
        out.backward(torch.randn_like(out))
        return out, q.grad, k.grad, v.grad

    first = step()  # compiles, or finds the kernels an earlier test compiled
    runs.clear()
    for _ in range(3):
        again = step()
        assert runs == []
        for x, y in zip(first, again, strict=True):
            assert torch.equal(x, y)
