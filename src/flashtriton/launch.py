"""Launching the Gluon kernels without Triton's per-call argument binding.

``kernel[grid](...)`` binds and specialises every argument in Python on each call (Triton 3.6's
JITFunction.run: the binder, the cache key, the launch metadata), and each Gluon tensor descriptor
validates itself when built: about 0.1 ms of host time per fwd+bwd for these kernels' 30-odd arguments
(benchmarks/NOTES.md 33). At N <= 1k the kernels' GPU time is of that order, so ``Launcher`` keeps each
compiled kernel under a key of what Triton specialises on and calls it directly:

  tensor          dtype, data pointer 16-byte aligned
  integer         == 1 (a constant), multiple of 16, 32-bit, below 2**63
  descriptor      dtype, block shape, shared-memory layout
  constexpr       its value
  launch options  (num_warps, ...) their values

A key seen for the first time goes through Triton's own path, which compiles or finds the kernel and
launches it. With a launch hook set (a profiler's; benchmarks/compile_sm90.py's), every call takes
Triton's path and nothing is kept.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from triton import knobs
from triton.experimental.gluon.language import NVMMASharedLayout
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
from triton.runtime import driver
from triton.runtime.jit import JITFunction


class Descriptor(NamedTuple):
    """A host TMA descriptor: what the compiled launcher reads (base, shape, strides, padding) and what
    the kernel is specialised on (dtype, block_shape, layout). The caller has checked what Triton's
    descriptor asserts (16-byte aligned base and strides, last dim contiguous): it is not checked again."""

    base: torch.Tensor
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    block_shape: tuple[int, ...]
    layout: NVMMASharedLayout
    padding: str = "zero"

    def gluon(self) -> GluonTensorDescriptor:
        shape, strides, block = list(self.shape), list(self.strides), list(self.block_shape)
        return GluonTensorDescriptor(self.base, shape, strides, block, self.layout, self.padding)


def _integer(x: int) -> tuple[bool, ...]:
    return x == 1, x % 16 == 0, -(2**31) <= x < 2**31, x < 2**63


_SPECS = {  # by exact type: a dict lookup is cheaper than a chain of isinstance checks
    torch.Tensor: lambda x: (x.dtype, x.data_ptr() % 16 == 0),
    Descriptor: lambda x: (x.base.dtype, x.block_shape, x.layout),
    bool: lambda x: x,
    type(None): lambda x: x,
    int: _integer,
    float: lambda x: float,
}


def _spec(x: Any) -> Any:
    """The properties of a runtime argument that Triton specialises a kernel on."""
    spec = _SPECS.get(type(x))
    if spec is None:
        kind = next((t for t in _SPECS if isinstance(x, t)), None)  # subclasses (nn.Parameter, IntEnum)
        if kind is None:
            raise TypeError(f"no launch key for a {type(x).__name__} argument")
        spec = _SPECS[kind]
    return spec(x)


class Launcher:
    """``Launcher(kernel)[grid](*args, **kwargs)`` runs like ``kernel[grid](...)``, Descriptor arguments
    standing for Gluon tensor descriptors."""

    def __init__(self, fn: JITFunction):
        self.fn = fn
        self.names = fn.arg_names
        self.constexpr = tuple(p.is_constexpr for p in fn.params)
        self.defaults = {p.name: p.default for p in fn.params if p.has_default}
        self.kernels: dict[tuple, Any] = {}

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
        rest = self.names[len(args) :]
        values = [*args, *(kwargs.pop(name) if name in kwargs else self.defaults[name] for name in rest)]
        device = driver.active.get_current_device()
        key = (
            device,
            tuple(v if const else _spec(v) for v, const in zip(values, self.constexpr, strict=True)),
            tuple(kwargs.items()),
        )
        kernel = self.kernels.get(key)
        hook = knobs.runtime.launch_enter_hook  # Triton's default: an empty HookChain
        hooked = hook is not None and bool(getattr(hook, "calls", True))
        if kernel is None or hooked:
            values = [v.gluon() if isinstance(v, Descriptor) else v for v in values]
            kernel = self.fn.run(*values, grid=grid, warmup=False, **kwargs)
            if kernel is not None and not hooked:  # None: compiling in the background
                self.kernels[key] = kernel
            return
        stream = driver.active.get_current_stream(device)
        grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
        kernel.run(grid_x, grid_y, grid_z, stream, kernel.function, kernel.packed_metadata, None, None, None, *values)
