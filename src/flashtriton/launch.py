"""Launching the Gluon kernels without Triton's per-call argument binding.

``kernel[grid](...)`` binds and specialises every argument in Python on each call (Triton 3.6's
JITFunction.run: the binder, the cache key, the launch metadata), and each Gluon tensor descriptor
validates itself when built: about 0.1 ms of host time per fwd+bwd for these kernels' 30-odd arguments.
At N <= 1k the kernels' GPU time is of that order, so ``Launcher`` keeps each compiled kernel under a key of
what Triton specialises on and calls it directly:

  tensor          dtype, data pointer 16-byte aligned
  integer         == 1 (a constant), multiple of 16, 32-bit, below 2**63
  descriptor      dtype, block shape, shared-memory layout
  constexpr       its value
  launch options  (num_warps, ...) their values

A key seen for the first time goes through Triton's own path, which compiles or finds the kernel and
launches it. With a launch hook set (a profiler's; benchmarks/compile_sm90.py's), every call takes
Triton's path and nothing is kept; so does every call where Triton's private API is off
(kernels/triton_compat.py: another Triton release than the one this was written against).

Even so a small call spends more time on the host than its kernels take on the GPU: the key
itself, Triton's launcher expanding each descriptor and filling its TMA map, and the backend's choices
around the launch. So a call can also be kept whole: ``Launcher.bind`` launches and returns a ``Bound``,
the C launcher's argument list with a slot per tensor, and a ``Recorder`` notes a call's allocations and
bound launches as a ``Plan`` that later calls of the same layout replay with their own tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from triton import knobs
from triton.experimental.gluon.language import NVMMASharedLayout
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from . import tables
from .kernels.triton_compat import PRIVATE_API_OK, c_launcher, registers, tensordesc_arg


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


LOG2E = 1.0 / math.log(2.0)  # the kernels' scores are base 2: qk_scale = softmax_scale * LOG2E


def window_bound(window: int, n: int) -> int:
    """A window bound as the kernels take it: 0 for none (-1), and at most n (query plus key rows), which changes no
    result and keeps row + bound inside the kernels' 32-bit arithmetic."""
    return min(max(window, 0), n)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for a launcher's grid: triton.cdiv is a constexpr function, several times the host time."""
    return -(-a // b)


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


class RegisterCap(NamedTuple):
    """A launch's ``maxnreg`` that holds only where the kernel compiled without a cap takes more registers per
    thread: ptxas held to a cap allocates up to it, and spills, where it would take fewer without one (DECISIONS,
    "Decoding"). Launcher resolves it once per launch key, by compiling the kernel without it first."""

    registers: int


def hooked() -> bool:
    """A launch hook is set (Triton's default is an empty HookChain): every launch must go through Triton."""
    hooks = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return any(hook is not None and bool(getattr(hook, "calls", True)) for hook in hooks)


class Launcher:
    """``Launcher(kernel)[grid](*args, **kwargs)`` runs like ``kernel[grid](...)``, Descriptor arguments
    standing for Gluon tensor descriptors; ``Launcher(kernel).bind(grid)(...)`` also returns the launch's
    Bound and the tensors in its slots, or (None, []) where Triton launched it. A kernel that Triton's
    interpreter runs goes through it every time, as every kernel does where Triton's private API is off."""

    def __init__(self, fn: JITFunction):
        self.fn = fn
        self.names = fn.arg_names
        params = getattr(fn, "params", None)  # an interpreted function has none: nothing to specialise
        self.constexpr = None if params is None else tuple(p.is_constexpr for p in params)
        self.defaults = {} if params is None else {p.name: p.default for p in params if p.has_default}
        self.kernels: dict[tuple, Any] = {}

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def bind(self, grid: tuple[int, ...]):
        return lambda *args, **kwargs: Bound.of(*self.launch(grid, args, kwargs), grid)

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict) -> tuple[Any, list, int]:
        """Launches; returns the compiled kernel (None where none is kept: a launch hook, a background
        compile, the interpreter), the argument values and the device."""
        if self.constexpr is None:
            self.fn[grid](*args, **kwargs)
            return None, [], 0
        rest = self.names[len(args) :]
        values = [*args, *(kwargs.pop(name) if name in kwargs else self.defaults[name] for name in rest)]
        device = driver.active.get_current_device()
        key = (
            device,
            tuple(v if const else _spec(v) for v, const in zip(values, self.constexpr, strict=True)),
            tuple(kwargs.items()),
        )
        kernel = self.kernels.get(key)
        if kernel is None or hooked():
            gluon = [v.gluon() if isinstance(v, Descriptor) else v for v in values]
            kernel = self.fn.run(*gluon, grid=grid, warmup=False, **self._options(grid, gluon, kwargs))
            if kernel is None or hooked():  # None: compiling in the background
                return None, values, device
            if PRIVATE_API_OK:  # kernel.run below is the C launcher's own calling convention
                self.kernels[key] = kernel
            return kernel, values, device
        stream = driver.active.get_current_stream(device)
        grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
        kernel.run(grid_x, grid_y, grid_z, stream, kernel.function, kernel.packed_metadata, None, None, None, *values)
        return kernel, values, device

    def _options(self, grid: tuple[int, ...], values: list, kwargs: dict) -> dict:
        """The launch options with a RegisterCap resolved: its registers where the kernel compiled without a cap
        takes more, or where that cannot be known (a background compile; another Triton, whose calls are not kept, so
        that each would compile twice), else no cap."""
        cap = kwargs.get("maxnreg")
        if not isinstance(cap, RegisterCap):
            return kwargs
        needed = not PRIVATE_API_OK
        if not needed:
            free = self.fn.run(*values, grid=grid, warmup=True, **{**kwargs, "maxnreg": None})
            taken = None if free is None else registers(free)
            needed = taken is None or taken > cap.registers
        return {**kwargs, "maxnreg": cap.registers if needed else None}


class _Maps:
    """A descriptor slot's TMA maps by base address: a map is a function of the address, the layout and the block
    alone, and the layout and block are the slot's."""

    def __init__(self, descriptor: Descriptor, meta: dict):
        self.descriptor, self.meta = descriptor._replace(base=None), meta  # a plan must not keep its call's tensors
        self.maps: dict[int, Any] = {}

    def __call__(self, base: torch.Tensor) -> Any:
        address = base.data_ptr()
        tensor_map = self.maps.get(address)
        if tensor_map is None:
            if len(self.maps) >= 16:  # the caching allocator hands a loop a few addresses; others come and go
                self.maps.clear()
            tensor_map = tensordesc_arg(self.descriptor._replace(base=base), self.meta)[0]
            self.maps[address] = tensor_map
        return tensor_map


class Bound:
    """One compiled kernel's launch with everything but its tensors fixed: Triton's C launcher's argument list
    (what its Python wrapper builds per launch: the base arguments, each descriptor expanded into its TMA map,
    shape and strides), with a slot per tensor argument and per descriptor's map.

    Built from the C entry point that triton_compat.c_launcher finds in the compiled kernel's launcher; where it
    finds none (another Triton, a kernel that needs scratch memory), there is no Bound and calls take Launcher's
    path."""

    def __init__(self, c_launch: Callable, template: list, slots: list[tuple[int, _Maps | None]], device: int):
        self.c_launch, self.template, self.slots, self.device = c_launch, template, slots, device
        self.stream = driver.active.get_current_stream  # the device's current stream, looked up at each launch

    @classmethod
    def of(cls, kernel: Any, values: list, device: int, grid: tuple[int, ...]) -> tuple[Bound | None, list]:
        """The Bound of a launch of ``kernel`` with these values, and the tensors that filled its slots."""
        if kernel is None:
            return None, []
        run = kernel.run
        entry = c_launcher(run)
        if entry is None:
            return None, []
        c_launch, descriptors, metas = entry
        grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
        template = [grid_x, grid_y, grid_z, None, kernel.function, run.launch_cooperative_grid, run.launch_pdl]
        template += [None, None, kernel.packed_metadata, None, None, None]  # scratch, metadata, hooks
        slots, tensors, metas = [], [], iter(metas)
        for i, value in enumerate(values):
            if i in descriptors:
                meta = next(metas)
                slots.append((len(template), _Maps(value, meta)))
                tensors.append(value.base)
                template += [None, *tensordesc_arg(value, meta)[1:]]
            elif isinstance(value, torch.Tensor):
                slots.append((len(template), None))
                tensors.append(value)
                template.append(None)
            elif isinstance(value, (tuple, list)):
                return None, []  # tuples are flattened by the launcher: not slotted here
            else:
                template.append(value)
        return cls(c_launch, template, slots, device), tensors

    def __call__(self, tensors: list[torch.Tensor]) -> None:
        """Launches with these tensors in the slots, in the order ``Bound.of`` returned the first call's. A tensor
        goes in as its address: given the tensor, the launcher would also ask the driver whether the GPU can read
        it (cuPointerGetAttribute), which the plan's key (the devices, through the layout the checks passed) already
        answers."""
        args = self.template.copy()
        args[3] = self.stream(self.device)
        for (position, maps), x in zip(self.slots, tensors, strict=True):
            args[position] = x.data_ptr() if maps is None else maps(x)
        self.c_launch(*args)


def _empty(shape: tuple[int, ...], strides: tuple[int, ...] | None, dtype: torch.dtype, device) -> torch.Tensor:
    if strides is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.empty_strided(shape, strides, dtype=dtype, device=device)


class Plan(NamedTuple):
    """One call's allocations and launches, for later calls of the same layout: ``plan(**inputs)`` allocates as
    the call did, launches each Bound with the tensors named in its slots, and returns every tensor by name.
    ``constants`` are tensors that every call of the layout reads (a cached schedule), held by name."""

    allocations: tuple[tuple[str, tuple[int, ...], tuple[int, ...] | None, torch.dtype, torch.device], ...]
    launches: tuple[tuple[Bound, tuple[str, ...]], ...]
    constants: tuple[tuple[str, torch.Tensor], ...] = ()

    def __call__(self, **tensors: torch.Tensor) -> dict[str, torch.Tensor]:
        tensors.update(self.constants)
        for name, shape, strides, dtype, device in self.allocations:
            tensors[name] = _empty(shape, strides, dtype, device)
        for bound, names in self.launches:
            bound([tensors[name] for name in names])
        return tensors


class Recorder:
    """Notes a call's allocations (``empty``) and bound launches (``add``), naming each slot's tensor among the
    call's inputs and allocations by identity (a tensor passed twice by its first name: the plan's key must then
    hold which inputs are one tensor); ``plan()`` is the Plan, or None if something launched had no Bound or a
    slot held another tensor (a conversion's copy, say)."""

    def __init__(self, **inputs: torch.Tensor):
        self.tensors = dict(inputs)
        self.constants: dict[str, torch.Tensor] = {}
        self.allocations: list[tuple] = []
        self.launches: list[tuple[Bound, tuple[str, ...]]] = []
        self.replayable = True

    def empty(self, name: str, shape, dtype: torch.dtype, device: torch.device, strides=None) -> torch.Tensor:
        """A new tensor, contiguous or with the given strides."""
        shape = tuple(shape)
        strides = None if strides is None else tuple(strides)
        x = _empty(shape, strides, dtype, device)
        self.allocations.append((name, shape, strides, dtype, device))
        self.tensors[name] = x
        return x

    def empty_like(self, name: str, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new tensor in x's layout where x is dense, else contiguous (torch.empty_like's rule), in x's dtype or
        ``dtype``; a replay allocates it with the same strides."""
        y = torch.empty_like(x, dtype=dtype)
        self.allocations.append((name, tuple(y.shape), None if y.is_contiguous() else tuple(y.stride()), y.dtype,
                                 y.device))  # fmt: skip
        self.tensors[name] = y
        return y

    def constant(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """x, a tensor that the plan may hold and pass to every call: one that depends on the layout alone and
        that a cache keeps for the process anyway (a schedule), never one of the call's inputs or outputs."""
        self.tensors[name] = self.constants[name] = x
        return x

    def add(self, launch: tuple[Bound | None, list[torch.Tensor]]) -> None:
        bound, tensors = launch
        names: dict[int, str] = {}
        for name, x in self.tensors.items():
            names.setdefault(id(x), name)
        slots = tuple(names.get(id(x)) for x in tensors)
        if bound is None or None in slots:
            self.replayable = False
        else:
            self.launches.append((bound, slots))

    def plan(self) -> Plan | None:
        if not self.replayable:
            return None
        return Plan(tuple(self.allocations), tuple(self.launches), tuple(self.constants.items()))


def keep(plans: dict[tuple, Plan], key: tuple | None, recorder: Recorder, limit: int = 256) -> None:
    """The recorder's Plan under ``key`` in ``plans`` (the oldest evicted past ``limit``), if the call is
    replayable and has a key."""
    plan = recorder.plan()
    if key is not None and plan is not None:
        tables.put(plans, key, plan, limit)
