"""Opt-in autotuning of the forward's launch configs: ``FLASHTRITON_AUTOTUNE=1``.

By default every launch takes its config from kernels/config.py's tables, which were measured on one GPU
(benchmarks/DECISIONS.md, tuning) and are only a starting point elsewhere. With FLASHTRITON_AUTOTUNE=1, read at each
call, the first forward of each kind -- kernel (the Gluon one on Hopper, else the portable one), head dim, dtype,
features, span bucket, whether the LSE is written -- on a GPU times the table's config and the candidates that
config.py lists beside it on that call's own inputs, and keeps the fastest one whose outputs match the table
config's. A candidate must beat the table's by config.AUTOTUNE_MARGIN to replace it (the timings' noise should not
move a measured choice). The choice
goes to a JSON cache on disk, ``$FLASHTRITON_CACHE_DIR/autotune.json`` (default ``~/.cache/flashtriton``), keyed by
the GPU, the triton and torch versions and the package's source digest (changed kernels are tuned again), so
later processes start from it. The first call of each kind pays for compiling and timing every candidate (the
Gluon forward's took 8-16 s on an H100).

Nothing is tuned while a CUDA graph is being captured (a cached choice, else the table's config, runs): tune with
an eager call of the same shapes first. The backward keeps its table configs (config.py says why).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch

from .kernels import config

AUTOTUNE_ENV = "FLASHTRITON_AUTOTUNE"
CACHE_DIR_ENV = "FLASHTRITON_CACHE_DIR"
CACHE_FILE = "autotune.json"

Config = TypeVar("Config")


def enabled() -> bool:
    """Whether FLASHTRITON_AUTOTUNE asks for tuning ("1"; "0" or unset: the tables)."""
    value = os.environ.get(AUTOTUNE_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(
            f"{AUTOTUNE_ENV}={value!r}: set it to 1 to tune the forward's launch configs, 0 (or unset) for the tables"
        )
    return value == "1"


def cache_path() -> Path:
    root = os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "flashtriton"
    return Path(root) / CACHE_FILE


@functools.cache
def source_digest() -> str:
    """sha256 over the package's .py files: names the source a measurement or a tuned choice belongs to."""
    package = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@functools.cache
def _device_tag(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm{major}{minor}"


def _entry_key(kind: str, key: tuple, device: torch.device) -> str:
    import triton

    return "|".join([_device_tag(device), f"triton {triton.__version__}", f"torch {torch.__version__}",
                     source_digest(), kind, *map(str, key)])  # fmt: skip


def span_bucket(span: int) -> int:
    """Spans share a choice within a power of two (the tables' thresholds are about as coarse)."""
    return 1 << max(span - 1, 0).bit_length()


# The cache as read from disk once per path, then kept in step with what this process writes.
_CACHES: dict[Path, dict] = {}


def _cache(path: Path) -> dict:
    if path not in _CACHES:
        try:
            text = path.read_text()
        except OSError:  # none yet, or not readable: the choices are then this process's (_store warns)
            text = "{}"
        try:
            _CACHES[path] = json.loads(text)
        except ValueError as exc:
            raise ValueError(
                f"{path} is not an autotune cache ({exc}): delete it, or point {CACHE_DIR_ENV} elsewhere"
            ) from exc
    return _CACHES[path]


def _store(path: Path, entry_key: str, entry: dict) -> None:
    """Adds the entry to the cache file, keeping what other processes wrote since it was read; where the file cannot
    be written, warns and keeps the entry for this process."""
    cache = _cache(path)
    cache[entry_key] = entry
    with_others = {}
    with contextlib.suppress(OSError, ValueError):  # no file yet: this process's entries are written anyway
        with_others = json.loads(path.read_text())
    with_others.update(cache)
    cache.update(with_others)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps(with_others, indent=1, sort_keys=True))
        os.replace(temporary, path)
    except OSError as exc:
        warnings.warn(
            f"autotune: {path} could not be written ({exc}); the tuned choice holds for this process only (set "
            f"{CACHE_DIR_ENV} to a writable directory to keep it)",
            stacklevel=3,
        )


def _time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """fn's median time: on a GPU, of calls replayed from a CUDA graph (a launch's host time, not measured with the
    call's own plan here, would hide short kernels' differences) or, where fn cannot be captured, of eager calls
    with L2 flushed between them; wall time elsewhere."""
    if device.type == "cuda":
        import triton

        try:
            return triton.testing.do_bench_cudagraph(fn, rep=config.AUTOTUNE_REP_MS, return_mode="median")
        except RuntimeError:
            return triton.testing.do_bench(
                fn, warmup=config.AUTOTUNE_WARMUP_MS, rep=config.AUTOTUNE_REP_MS, return_mode="median"
            )
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _mismatch(outputs: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> str | None:
    """Why a candidate's outputs are not the table config's (None if they are): any non-finite element where the
    reference is finite (outputs are poisoned with NaN first, so an unwritten element is one), or an element off by
    more than config.AUTOTUNE_TOLERANCE of the reference's largest magnitude (other tiles sum in another order; a
    wrong tile is off by about its own size)."""
    for i, (out, ref) in enumerate(zip(outputs, reference, strict=True)):
        finite = torch.isfinite(ref)
        if not torch.equal(torch.isfinite(out), finite):
            return f"output {i} is not finite where the table config's is, or the other way round"
        scale = ref[finite].abs().max().item() if finite.any() else 0.0
        error = (out[finite].double() - ref[finite].double()).abs().max().item() if finite.any() else 0.0
        if error > config.AUTOTUNE_TOLERANCE * max(scale, 1.0):
            return f"output {i} differs from the table config's by {error:.3g} (largest magnitude {scale:.3g})"
    return None


def _poison(outputs: Sequence[torch.Tensor]) -> None:
    for out in outputs:
        out.fill_(math.nan if out.is_floating_point() else -1)


def choose(
    kind: str,
    key: tuple,
    table: Config,
    candidates: Sequence[Config],
    run: Callable[[Config], Sequence[torch.Tensor]],
    device: torch.device,
) -> Config:
    """The config to launch ``kind`` with when enabled() (callers ask first, before building candidates): the cached
    or newly tuned choice among ``table`` and ``candidates`` for this kind and ``key`` on this device (module
    docstring). ``run(cfg)`` launches with cfg and returns its outputs; each call may write the same tensors (they
    are compared before the next)."""
    path = cache_path()
    entry_key = _entry_key(kind, key, device)
    entry = _cache(path).get(entry_key)
    if entry is not None:
        return type(table)(**entry["config"])
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return table
    entry = _tune(table, candidates, run, device)
    _store(path, entry_key, entry)
    return type(table)(**entry["config"])


def _tune(table: Config, candidates: Sequence[Config], run, device: torch.device) -> dict:
    """Times the table's config and each candidate that runs and matches its outputs: the cache entry."""
    outputs = run(table)
    reference = [out.clone() for out in outputs]
    timings = {repr(table): _time_ms(lambda: run(table), device)}
    rejected = {}
    best, best_ms = table, timings[repr(table)] * (1.0 - config.AUTOTUNE_MARGIN)
    for cfg in dict.fromkeys(candidates):
        if cfg == table:
            continue
        try:
            _poison(outputs)
            why = _mismatch(run(cfg), reference)
            if why is None:
                timings[repr(cfg)] = ms = _time_ms(lambda cfg=cfg: run(cfg), device)
                if ms < best_ms:
                    best, best_ms = cfg, ms
        except Exception as exc:  # a candidate that does not compile or fit this GPU's shared memory
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        if why is not None:
            rejected[repr(cfg)] = why
    return {"config": dataclasses.asdict(best), "ms": timings, "rejected": rejected}
