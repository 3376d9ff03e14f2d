"""Every use of Triton's private API, behind one version check.

The Gluon kernels (kernels/hopper/) reach below Gluon's public API for a TMA reduction and a shared-memory
reinterpretation, and launch.py calls the CUDA launcher that Triton compiles for a kernel directly, past its Python
wrapper. Those internals move between Triton releases, so they are imported here and nowhere else:

  tma_add            desc's tile at coord += a shared-memory tile (a Gluon builtin: TMA reduction)
  reinterpret        a shared-memory descriptor viewed as another dtype, shape and layout (a Gluon builtin)
  c_launcher         a compiled kernel's C launch entry point, with which arguments are tensor descriptors
  tensordesc_arg     a host tensor descriptor expanded as that entry point takes it (TMA map, shape, strides)
  registers          a compiled kernel's registers per thread (ptxas's choice), loading its binary to learn it

``PRIVATE_API_OK`` says whether the installed Triton is one these were written against (``TESTED``) and every name
imported; where it is False, ``PRIVATE_API_PROBLEM`` says why, the Gluon kernels must not be routed to (the portable
kernels serve every call) and launch.py launches through Triton's own path. Importing this module never fails.
"""

from __future__ import annotations

from collections.abc import Callable
from types import BuiltinFunctionType
from typing import Any

import triton

# Triton releases (major, minor) whose internals these were checked against: the CPU dev environment's and the
# H200 image's 3.6.0.
TESTED = ((3, 6),)


def _release(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as "3.6.0" or "3.6.0+git1a2b3c4"."""
    parts = version.split("+")[0].split(".")[:2]
    return tuple(int(p) if p.isdigit() else -1 for p in parts)


def _problem() -> str | None:
    """Why the private API cannot be used here, or None."""
    if _release(triton.__version__) not in TESTED:
        tested = ", ".join(f"{major}.{minor}.x" for major, minor in TESTED)
        return f"triton {triton.__version__} is not a tested release ({tested}): the Gluon kernels are off"
    try:
        from triton._C.libtriton import ir
        from triton._C.libtriton.gluon_ir import GluonOpBuilder
        from triton.backends.nvidia import driver as nvidia_driver
        from triton.experimental.gluon.language._core import shared_memory_descriptor
        from triton.experimental.gluon.language._semantic import GluonSemantic
    except ImportError as error:
        return f"triton {triton.__version__}: {error}"
    missing = [
        name
        for owner, name in (
            (ir, "DESCRIPTOR_REDUCE_KIND"),
            (GluonOpBuilder, "create_async_tma_reduce"),
            (GluonSemantic, "_convert_to_ir_values"),
            (shared_memory_descriptor, "_reinterpret"),
            (nvidia_driver, "_BASE_ARGS_FORMAT"),
            (nvidia_driver, "make_tensordesc_arg"),
        )
        if not hasattr(owner, name)
    ]
    return f"triton {triton.__version__} lacks {', '.join(missing)}" if missing else None


PRIVATE_API_PROBLEM: str | None = _problem()
PRIVATE_API_OK: bool = PRIVATE_API_PROBLEM is None


def _unavailable(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(f"Triton's private API is unavailable: {PRIVATE_API_PROBLEM}")


if PRIVATE_API_OK:
    from triton._C.libtriton import ir
    from triton.backends.nvidia import driver as _nvidia_driver
    from triton.experimental.gluon.language._core import builtin

    tensordesc_arg: Callable[[Any, dict], list] = _nvidia_driver.make_tensordesc_arg

    @builtin
    def tma_add(desc, coord, src, _semantic=None):
        """desc's tile at coord += src (shared memory), by a TMA reduction (cp.reduce.async.bulk.tensor). Triton 3.6's
        Gluon has the op (ttng.async_tma_reduce) but no wrapper for it; completes as a TMA store (tma.store_wait)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)

    @builtin
    def reinterpret(smem, dtype, shape, layout, _semantic=None):
        """smem's bytes as a shared-memory descriptor of another dtype, shape and layout."""
        return smem._reinterpret(dtype, shape, layout, _semantic=_semantic)

else:
    tensordesc_arg = tma_add = reinterpret = _unavailable


# The C launcher's arguments before the kernel's: grid x, y, z, stream, function, cooperative, PDL, two scratch
# buffers, metadata, launch metadata, two hooks.
_BASE_ARGS = "iiiKKppOOOOOO"


def c_launcher(run: Any) -> tuple[BuiltinFunctionType, set[int], list[dict]] | None:
    """(the C entry point, the positions of tensor-descriptor arguments among the kernel's, their TMA metadata) of a
    compiled kernel's launcher (``CompiledKernel.run``: Triton 3.6's ``CudaLauncher``, whose ``launch`` wraps the
    entry point in a closure that expands descriptors after the 13 base arguments), or None where it is not of that
    shape or needs scratch memory."""
    if not PRIVATE_API_OK or _nvidia_driver._BASE_ARGS_FORMAT != _BASE_ARGS or type(run).__name__ != "CudaLauncher":
        return None
    if run.global_scratch_size or run.profile_scratch_size:
        return None
    launch = run.launch
    if isinstance(launch, BuiltinFunctionType):  # not wrapped: the kernel takes no descriptors
        return launch, set(), []
    if getattr(launch, "__code__", None) is None:
        return None
    free = launch.__code__.co_freevars
    cells = {name: cell.cell_contents for name, cell in zip(free, launch.__closure__ or (), strict=True)}
    entry, descriptors, metas = (cells.get(n) for n in ("launcher", "tensordesc_indices", "tensordesc_meta"))
    if not isinstance(entry, BuiltinFunctionType) or not metas or None in metas:
        return None
    return entry, descriptors, metas


def registers(kernel: Any) -> int | None:
    """A compiled kernel's registers per thread; None for what is not one yet (a background compile's future).
    Triton 3.6 learns them when it loads the binary onto the current device (``CompiledKernel._init_handles``, which
    its first launch would run anyway)."""
    if not PRIVATE_API_OK:
        _unavailable()
    if not hasattr(kernel, "_init_handles"):
        return None
    kernel._init_handles()
    return kernel.n_regs
