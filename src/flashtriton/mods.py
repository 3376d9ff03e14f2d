"""User-written element masks and score modifiers, as small @triton.jit functions.

A *mask_mod* says which scores exist; a *score_mod* rewrites a score before the softmax:

    @triton.jit
    def mask_mod(b, h, q_idx, kv_idx, *tensors):            # -> bool, True: key kv_idx is visible
        ...
    @triton.jit
    def score_mod(score, b, h, q_idx, kv_idx, *tensors):    # -> the new score
        ...

Calling convention (what the kernels do; ``mod`` is a ``Mod``):
  MASK_MOD: tl.constexpr = mod.fn, MASK_TENSORS = mod.tensors (a tuple kernel argument), called as
  ``MASK_MOD(b, h, q_idx, kv_idx, *MASK_TENSORS)``; the same for SCORE_MOD with ``score`` first.
  b          batch index (int32 scalar)
  h          query head index (int32 scalar; with GQA the query head, not the K/V head)
  q_idx      [BLOCK_M, 1] int32 query indices within the sequence
  kv_idx     [1, BLOCK_N] int32 key indices within the sequence
  tensors    pointers to the start of each of ``mod.tensors``: ``tl.load(doc_ids + q_idx)``
  score      [BLOCK_M, BLOCK_N] fp32: softmax_scale * q . k, in natural units (softmax(score) is P)
Indices are always in range (0 <= q_idx < seqlen_q, 0 <= kv_idx < seqlen_k): kernels clamp the
padding rows and columns of a ragged tile and discard their results, so a mod may load from
tensors of length seqlen without bounds checks.

A score_mod is differentiable only with ``Mod.grad``: ``grad(score, b, h, q_idx, kv_idx, *tensors)``
returns d score_mod / d score at the unmodified ``score``. Without it a score_mod is forward-only,
and the public API raises (``check_differentiable``) before launching when gradients are needed.
No gradient flows to ``mod.tensors``.

Combinators (``and_masks``, ``or_masks``) and the ready masks with parameters generate a small
@triton.jit function from source text (Triton compiles from source; the text is registered in
``linecache``, no file is written) that calls the sub-mods with their slice of the concatenated
tensors, so a kernel only ever sees one function with the signature above.

The same functions run on torch tensors (``evaluate_mask``, ``evaluate_score``,
``evaluate_score_grad``) for the PyTorch path, ``create_block_mask`` and the reference: the Python
function under the @triton.jit decorator is rebuilt with ``tl`` (and ``triton``, ``tl.math``,
libdevice) bound to a torch shim, and integer ``//`` and ``%`` follow Triton's C semantics
(truncating). There, b and h are broadcastable int32 tensors rather than scalars, so a mod must not
branch (Python ``if``) on tensor values: use ``tl.where``. A call the shim lacks raises
NotImplementedError naming the mod. (libdevice compiles for the GPU, but Triton's interpreter
cannot run it: under TRITON_INTERPRET=1 prefer tl functions, e.g. tanh via tl.sigmoid.)
"""

from __future__ import annotations

import hashlib
import inspect
import linecache
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

_MOD_ARGS = ("b", "h", "q_idx", "kv_idx")


def _is_jit(fn: object) -> bool:
    if isinstance(fn, JITFunction):
        return True
    # Triton's interpreter needs numpy, so it is not imported here; an InterpretedFunction exists only once it is loaded
    interpreter = sys.modules.get("triton.runtime.interpreter")
    return interpreter is not None and isinstance(fn, interpreter.InterpretedFunction)


def _name(fn) -> str:
    return fn.fn.__qualname__


_REGISTERED: dict[str, tuple] = {}  # Mod.key -> (fn, grad)


def registered(key: str) -> tuple:
    """The (fn, grad) a Mod's key names."""
    return _REGISTERED[key]


@dataclass(frozen=True, eq=False)
class Mod:
    """A mask_mod or score_mod: the @triton.jit function, the tensors it reads, and (score mods) its derivative.

    fn       @triton.jit ``mask_mod(b, h, q_idx, kv_idx, *tensors)``
             or ``score_mod(score, b, h, q_idx, kv_idx, *tensors)``
    tensors  contiguous tensors, passed to ``fn`` as pointers after the indices, in this order
    grad     score mods only: @triton.jit ``grad(score, b, h, q_idx, kv_idx, *tensors)`` = d fn / d score;
             None makes the score_mod forward-only
    """

    fn: Any
    tensors: tuple[torch.Tensor, ...] = ()
    grad: Any = None
    key: str = field(init=False, repr=False)  # names fn and grad in the custom ops' schema (registered)

    def __post_init__(self):
        if not _is_jit(self.fn):
            raise TypeError(f"Mod.fn must be a @triton.jit function, got {type(self.fn).__name__}: decorate it")
        if self.grad is not None and not _is_jit(self.grad):
            raise TypeError(f"Mod.grad must be a @triton.jit function or None, got {type(self.grad).__name__}")
        object.__setattr__(self, "tensors", tuple(self.tensors))
        for i, t in enumerate(self.tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"Mod.tensors[{i}] of {self.name} is a {type(t).__name__}, not a torch.Tensor")
            if not t.is_contiguous():
                raise ValueError(f"Mod.tensors[{i}] of {self.name} is not contiguous: pass tensor.contiguous()")
        if len({t.device for t in self.tensors}) > 1:
            raise ValueError(f"the tensors of {self.name} are on different devices: move them to one with Mod.to")
        # registered here, in plain Python, so that a compiled graph (which reads only the key) finds the functions
        key = f"{self.name}@{id(self.fn):x}:{id(self.grad):x}"
        _REGISTERED[key] = (self.fn, self.grad)
        object.__setattr__(self, "key", key)

    @property
    def name(self) -> str:
        return _name(self.fn)

    def to(self, device: torch.device | str) -> Mod:
        """The same mod with its tensors on ``device`` (itself when they are there: no new Mod inside a trace)."""
        device = torch.device(device)
        if all(t.device == device for t in self.tensors):
            return self
        return Mod(self.fn, tuple(t.to(device) for t in self.tensors), self.grad)

    def __repr__(self) -> str:
        tensors = ", ".join(f"{str(t.dtype).removeprefix('torch.')}{tuple(t.shape)}@{t.device}" for t in self.tensors)
        grad = f", grad={_name(self.grad)}" if self.grad is not None else ""
        return f"Mod({self.name}, tensors=[{tensors}]{grad})"


def as_mod(mod: Mod | Any, what: str = "mod") -> Mod:
    """A bare @triton.jit function becomes ``Mod(fn)``; a ``Mod`` is returned as is."""
    if isinstance(mod, Mod):
        return mod
    if _is_jit(mod):
        if torch.compiler.is_compiling():  # its Mod would be made, and registered, inside the trace
            raise TypeError(
                f"{what}: inside torch.compile pass flashtriton.Mod(fn), made outside the compiled function, "
                "instead of the bare @triton.jit function"
            )
        return Mod(mod)
    raise TypeError(f"{what} must be a @triton.jit function or a flashtriton.Mod, got {type(mod).__name__}")


def check_differentiable(score_mod: Mod | Any, what: str = "score_mod") -> None:
    """Raise before launching if gradients are needed through a score_mod that has no ``grad``."""
    mod = as_mod(score_mod, what)
    if mod.grad is None:
        raise ValueError(
            f"{what} {mod.name} is forward-only (no grad): pass Mod(fn, tensors, grad=dfn) with "
            "dfn(score, b, h, q_idx, kv_idx, *tensors) = d fn / d score, or run without gradients"
        )


# ---------------------------------------------------------------------------------------------
# Generated @triton.jit functions: combinators and parameterised ready masks
# ---------------------------------------------------------------------------------------------

_GENERATED: dict[str, Any] = {}


def _fingerprint(fn) -> str:
    """What identifies a jit function's code: Triton's cache key (source + callees + constexpr globals)."""
    if isinstance(fn, JITFunction):
        return fn.cache_key
    return f"{fn.fn.__module__}.{fn.fn.__qualname__}:{inspect.getsource(fn.fn)}"


def _generated_mask_mod(kind: str, expression: str, n_tensors: int = 0, callees: dict[str, Any] | None = None):
    """A @triton.jit ``kind_<hash>(b, h, q_idx, kv_idx, t0, ..) -> expression``; ``callees`` are its globals.

    The name carries a hash of the code so that two different generated functions never share a
    name (Triton names compiled functions by module and name) and equal ones are made once.
    """
    callees = callees or {}
    params = ", ".join([*_MOD_ARGS, *(f"t{i}" for i in range(n_tensors))])
    key = "\n".join([params, expression, *(f"{k}={_fingerprint(v)}" for k, v in sorted(callees.items()))])
    name = f"{kind}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if name not in _GENERATED:
        source = f"@triton.jit\ndef {name}({params}):\n    return {expression}\n"
        filename = f"<flashtriton.mods:{name}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        namespace = {"__name__": __name__, "triton": triton, "tl": tl, **callees}
        exec(compile(source, filename, "exec"), namespace)
        _GENERATED[name] = namespace[name]
    return _GENERATED[name]


def _combine(kind: str, operator: str, mask_mods: tuple) -> Mod:
    if not mask_mods:
        raise ValueError(f"{kind} needs at least one mask_mod")
    mods = [as_mod(m, f"{kind} argument") for m in mask_mods]
    calls, callees, tensors = [], {}, []
    for i, mod in enumerate(mods):
        args = [*_MOD_ARGS, *(f"t{len(tensors) + j}" for j in range(len(mod.tensors)))]
        calls.append(f"mod{i}({', '.join(args)})")
        callees[f"mod{i}"] = mod.fn
        tensors.extend(mod.tensors)
    fn = _generated_mask_mod(kind, f" {operator} ".join(calls), len(tensors), callees)
    return Mod(fn, tuple(tensors))


def and_masks(*mask_mods: Mod | Any) -> Mod:
    """Visible iff visible under every mask_mod; their tensors are concatenated in argument order."""
    return _combine("and_masks", "&", mask_mods)


def or_masks(*mask_mods: Mod | Any) -> Mod:
    """Visible iff visible under some mask_mod; their tensors are concatenated in argument order."""
    return _combine("or_masks", "|", mask_mods)


# ---------------------------------------------------------------------------------------------
# Ready masks
# ---------------------------------------------------------------------------------------------


def _check_int(what: str, value: int, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return value


def _alignment_offset(seqlen_q: int | None, seqlen_k: int | None, what: str) -> int:
    """seqlen_k - seqlen_q (bottom-right alignment); 0 when neither is given (equal lengths)."""
    if seqlen_q is None and seqlen_k is None:
        return 0
    if seqlen_q is None or seqlen_k is None:
        raise ValueError(f"{what}: pass both seqlen_q and seqlen_k (or neither, for equal lengths)")
    return _check_int(f"{what} seqlen_k", seqlen_k, 1) - _check_int(f"{what} seqlen_q", seqlen_q, 1)


def causal_mask(seqlen_q: int | None = None, seqlen_k: int | None = None) -> Mod:
    """Query q_idx sees key kv_idx iff kv_idx <= q_idx + seqlen_k - seqlen_q.

    Aligned bottom-right as flash_attn's ``causal=True`` (the last query sees every key). Mods do
    not see the lengths, so pass them when they differ; without them the lengths are taken equal
    (the plain lower triangle, also FlexAttention's top-left convention).
    """
    offset = _alignment_offset(seqlen_q, seqlen_k, "causal_mask")
    return Mod(_generated_mask_mod("causal_mask", f"kv_idx <= q_idx + {offset}"))


def sliding_window_mask(window: int, seqlen_q: int | None = None, seqlen_k: int | None = None) -> Mod:
    """Causal, and at most ``window`` keys before the query's own position (window=0: only itself).

    Query q_idx sees key kv_idx iff q_idx + offset - window <= kv_idx <= q_idx + offset, with
    offset = seqlen_k - seqlen_q (0 when the lengths are not given): flash_attn's
    ``window_size=(window, 0)``.
    """
    window = _check_int("sliding_window_mask window", window, 0)
    offset = _alignment_offset(seqlen_q, seqlen_k, "sliding_window_mask")
    expression = f"(kv_idx <= q_idx + {offset}) & (kv_idx >= q_idx + {offset - window})"
    return Mod(_generated_mask_mod("sliding_window_mask", expression))


def prefix_lm_mask(prefix_len: int, seqlen_q: int | None = None, seqlen_k: int | None = None) -> Mod:
    """Every query sees the first ``prefix_len`` keys (bidirectional prefix), and causally after them.

    Query q_idx sees key kv_idx iff kv_idx < prefix_len or kv_idx <= q_idx + offset, with offset as
    in ``causal_mask``.
    """
    prefix_len = _check_int("prefix_lm_mask prefix_len", prefix_len, 0)
    offset = _alignment_offset(seqlen_q, seqlen_k, "prefix_lm_mask")
    expression = f"(kv_idx < {prefix_len}) | (kv_idx <= q_idx + {offset})"
    return Mod(_generated_mask_mod("prefix_lm_mask", expression))


@triton.jit
def _same_document(b, h, q_idx, kv_idx, doc_ids):
    return tl.load(doc_ids + q_idx) == tl.load(doc_ids + kv_idx)


def document_mask(doc_ids: torch.Tensor) -> Mod:
    """Query q_idx sees key kv_idx iff doc_ids[q_idx] == doc_ids[kv_idx] (packed sequences).

    doc_ids: (seqlen,) integer tensor, one id per token; queries and keys index the same tensor,
    so seqlen_q == seqlen_k == seqlen. Combine with ``causal_mask()`` through ``and_masks``.
    """
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.dim() != 1:
        raise TypeError("document_mask: doc_ids must be a 1-D (seqlen,) tensor of document ids")
    if doc_ids.is_floating_point() or doc_ids.is_complex() or doc_ids.dtype == torch.bool:
        raise TypeError(f"document_mask: doc_ids must be an integer tensor, got {doc_ids.dtype}: pass doc_ids.int()")
    return Mod(_same_document, (doc_ids.contiguous(),))


# ---------------------------------------------------------------------------------------------
# Evaluation on torch tensors
# ---------------------------------------------------------------------------------------------


def _trunc_div(a, b):
    return torch.div(a, b, rounding_mode="trunc")


def _rtrunc_div(a, b):
    return torch.div(torch.as_tensor(b, device=a.device), a, rounding_mode="trunc")


def _rfmod(a, b):
    return torch.fmod(torch.as_tensor(b, device=a.device), a)


_T = torch.Tensor
# Triton's // truncates and % takes the dividend's sign (C semantics); torch floors. The keys are
# what torch hands __torch_function__ for each Python operator.
_TRITON_OPS = {
    _T.__floordiv__: _trunc_div,
    _T.__rfloordiv__: _rtrunc_div,
    _T.remainder: torch.fmod,
    _T.__rmod__: _rfmod,
    # In a jit function `x += 1` rebinds x; on torch tensors it would write into the caller's tensor.
    _T.add_: torch.add,
    _T.sub_: torch.sub,
    _T.mul_: torch.mul,
    _T.div_: torch.div,
    _T.floor_divide_: _trunc_div,
    _T.remainder_: torch.fmod,
    _T.__ipow__: torch.pow,
    _T.__iand__: _T.__and__,
    _T.__ior__: _T.__or__,
    _T.__ixor__: _T.__xor__,
    _T.__ilshift__: _T.__lshift__,
    _T.__irshift__: _T.__rshift__,
}


class _TritonTensor(torch.Tensor):
    """A torch tensor whose Python operators behave as on Triton tensors (see _TRITON_OPS)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(_TRITON_OPS.get(func, func), types, args, kwargs or {})


class _Pointer:
    """A mod's view of one of its tensors: ``pointer + offsets`` then ``tl.load`` reads the flattened tensor."""

    def __init__(self, data: torch.Tensor, offset=0):
        self.data = data
        self.offset = offset

    def __add__(self, offset) -> _Pointer:
        return _Pointer(self.data, self.offset + offset)

    __radd__ = __add__

    def __sub__(self, offset) -> _Pointer:
        return _Pointer(self.data, self.offset - offset)


_DTYPES = {
    "int1": torch.bool, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "uint8": torch.uint8, "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64, "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
    "fp64": torch.float64,
}  # fmt: skip
_ELEMENTWISE = {
    "abs": torch.abs, "ceil": torch.ceil, "cos": torch.cos, "erf": torch.erf, "exp": torch.exp, "exp2": torch.exp2,
    "floor": torch.floor, "log": torch.log, "log2": torch.log2, "rsqrt": torch.rsqrt, "sigmoid": torch.sigmoid,
    "sin": torch.sin, "sqrt": torch.sqrt, "sqrt_rn": torch.sqrt,
}  # fmt: skip
_LIBDEVICE = {
    **_ELEMENTWISE, "acos": torch.acos, "asin": torch.asin, "atan": torch.atan, "atan2": torch.atan2,
    "cosh": torch.cosh, "expm1": torch.expm1, "fabs": torch.abs, "fmax": torch.maximum, "fmin": torch.minimum,
    "log1p": torch.log1p, "pow": torch.pow, "sinh": torch.sinh, "tanh": torch.tanh,
}  # fmt: skip


class _Language:
    """The part of ``triton.language`` (and ``tl.math``) that mods use, on torch tensors."""

    def __init__(self, function: str, device: torch.device):
        self._function = function
        self._device = device

    @property
    def math(self) -> _Language:
        return self

    def _tensor(self, x) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            return x
        return torch.as_tensor(x, device=self._device).as_subclass(_TritonTensor)

    def _unsupported(self, qualified: str) -> NotImplementedError:
        supported = sorted(n for n in dir(self) if not n.startswith("_")) + sorted(_ELEMENTWISE) + sorted(_DTYPES)
        return NotImplementedError(
            f"{self._function} calls {qualified}, which flashtriton.mods cannot evaluate on torch tensors "
            f"(for the PyTorch path and create_block_mask); supported: tl.{', tl.'.join(supported)}, "
            f"libdevice.{', libdevice.'.join(sorted(_LIBDEVICE))}"
        )

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in _DTYPES:
            return _DTYPES[name]
        if name in _ELEMENTWISE:
            return lambda x: _ELEMENTWISE[name](self._tensor(x))
        raise self._unsupported(f"tl.{name}")

    @staticmethod
    def constexpr(value):
        return value

    def load(self, pointer: _Pointer, mask=None, other=None, cache_modifier="", eviction_policy="", volatile=False):
        offset = self._tensor(pointer.offset).long()
        if mask is not None:
            mask = self._tensor(mask).bool()
            offset = torch.where(mask, offset, 0)
        n = pointer.data.numel()
        if bool(((offset < 0) | (offset >= n)).any()):
            raise IndexError(
                f"{self._function} loads out of bounds (offsets {int(offset.min())}..{int(offset.max())} of a "
                f"tensor of {n} elements): index mod tensors with q_idx, kv_idx, b, h within their lengths"
            )
        value = pointer.data[offset]
        if mask is not None:
            value = torch.where(mask, value, 0 if other is None else other)
        return value.as_subclass(_TritonTensor)

    def where(self, condition, x, y):
        return torch.where(self._tensor(condition).bool(), x, y)

    def minimum(self, x, y):
        return torch.minimum(self._tensor(x), self._tensor(y))

    def maximum(self, x, y):
        return torch.maximum(self._tensor(x), self._tensor(y))

    def clamp(self, x, min, max):
        return self.minimum(self.maximum(x, min), max)

    @staticmethod
    def fma(x, y, z):
        return x * y + z

    @staticmethod
    def fdiv(x, y, ieee_rounding=False):
        return x / y

    @staticmethod
    def div_rn(x, y):
        return x / y

    @staticmethod
    def cdiv(x, div):
        return (x + div - 1) // div

    def full(self, shape, value, dtype):
        return torch.full(tuple(shape), value, dtype=dtype, device=self._device).as_subclass(_TritonTensor)

    def zeros(self, shape, dtype):
        return self.full(shape, 0, dtype)

    @staticmethod
    def zeros_like(x):
        return torch.zeros_like(x)

    def arange(self, start, end):
        return torch.arange(start, end, dtype=torch.int32, device=self._device).as_subclass(_TritonTensor)

    @staticmethod
    def cast(x, dtype):
        return x.to(dtype)


class _Libdevice:
    def __init__(self, language: _Language):
        self._language = language

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in _LIBDEVICE:
            raise self._language._unsupported(f"libdevice.{name}")
        return lambda *args: _LIBDEVICE[name](*(self._language._tensor(a) for a in args))


class _Triton:
    def __init__(self, language: _Language):
        self.language = language
        self.cdiv = language.cdiv

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise self.language._unsupported(f"triton.{name}")


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


class _TorchEvaluator:
    """Rebuilds @triton.jit functions with their Triton names bound to torch shims; nested calls lazily."""

    def __init__(self, device: torch.device):
        self.device = device
        self._rebuilt: dict[int, tuple[Any, Callable]] = {}  # id(jit fn) -> (jit fn kept alive, rebuilt)

    def function(self, jit_fn) -> Callable:
        entry = self._rebuilt.get(id(jit_fn))
        if entry is None:
            entry = self._rebuilt[id(jit_fn)] = (jit_fn, self._rebuild(jit_fn))
        return entry[1]

    def _rebuild(self, jit_fn) -> Callable:
        py = jit_fn.fn
        language = _Language(f"@triton.jit function {py.__module__}.{py.__qualname__}", self.device)
        namespace = dict(py.__globals__)
        for name in _global_names(py.__code__) & namespace.keys():
            namespace[name] = self._shim(namespace[name], language)
        return types.FunctionType(py.__code__, namespace, py.__name__, py.__defaults__, py.__closure__)

    def _shim(self, value, language: _Language):
        if value is tl or value is tl.math:
            return language
        if value is triton:
            return _Triton(language)
        if isinstance(value, types.ModuleType) and value.__name__.endswith("libdevice"):
            return _Libdevice(language)
        if _is_jit(value):
            return lambda *args: self.function(value)(*args)
        if isinstance(value, tl.constexpr):
            return value.value
        if isinstance(value, tl.dtype):
            return _DTYPES[value.name]
        module = getattr(value, "__module__", None) or ""
        if module.startswith("triton.language") and callable(value):
            # imported by name: `from triton.language import where`
            return getattr(_Libdevice(language) if "libdevice" in module else language, value.__name__)
        return value


def _device(mod: Mod, *args) -> torch.device:
    for x in (*mod.tensors, *args):
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def _index(x, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(x, device=device).to(torch.int32).as_subclass(_TritonTensor)


def _plain(result, shape: torch.Size, device: torch.device) -> torch.Tensor:
    if isinstance(result, torch.Tensor):
        result = result.as_subclass(torch.Tensor)
    else:
        result = torch.as_tensor(result, device=device)
    return torch.broadcast_to(result, torch.broadcast_shapes(result.shape, shape))


def _call(fn, mod: Mod, score, b, h, q_idx, kv_idx) -> torch.Tensor:
    device = _device(mod, score, b, h, q_idx, kv_idx)
    indices = [_index(x, device) for x in (b, h, q_idx, kv_idx)]
    pointers = [_Pointer(t.reshape(-1)) for t in mod.tensors]
    function = _TorchEvaluator(device).function(fn)
    if score is None:
        result = function(*indices, *pointers)
        shape = torch.broadcast_shapes(*(x.shape for x in indices))
    else:
        score = score.as_subclass(_TritonTensor)
        result = function(score, *indices, *pointers)
        shape = torch.broadcast_shapes(score.shape, *(x.shape for x in indices))
    return _plain(result, shape, device)


def evaluate_mask(mask_mod: Mod | Any, b, h, q_idx, kv_idx) -> torch.Tensor:
    """The mask_mod on torch tensors: a bool tensor of the broadcast shape of the indices (a broadcast view).

    b, h, q_idx, kv_idx: ints or integer tensors, broadcastable (e.g. b (B, 1, 1, 1),
    h (1, H, 1, 1), q_idx (Nq, 1), kv_idx (1, Nk) -> (B, H, Nq, Nk)), within their ranges.
    """
    mod = as_mod(mask_mod, "mask_mod")
    return _call(mod.fn, mod, None, b, h, q_idx, kv_idx).bool()


def evaluate_score(score_mod: Mod | Any, score: torch.Tensor, b, h, q_idx, kv_idx) -> torch.Tensor:
    """The score_mod on torch tensors: score (any float dtype) broadcast with the indices as in ``evaluate_mask``.

    Differentiable through torch autograd (the reference's oracle for ``Mod.grad``).
    """
    mod = as_mod(score_mod, "score_mod")
    return _call(mod.fn, mod, score, b, h, q_idx, kv_idx)


def evaluate_score_grad(score_mod: Mod | Any, score: torch.Tensor, b, h, q_idx, kv_idx) -> torch.Tensor:
    """``score_mod.grad`` on torch tensors: d score_mod / d score, shaped as ``evaluate_score``'s result."""
    mod = as_mod(score_mod, "score_mod")
    check_differentiable(mod)
    return _call(mod.grad, mod, score, b, h, q_idx, kv_idx)
