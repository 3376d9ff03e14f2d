"""Checks on user input, run by the public API before anything is launched.

Each raises ValueError or TypeError whose message says what to change.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Hashable
from itertools import pairwise
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .kernels import config

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256  # flash_attn's limit too
HEAD_DIM_STEP = 8  # the kernels take multiples of it; the public API zero-pads other head dims up to one
# The kernels take softmax_scale and softcap as fp32 and scale by log2(e): magnitudes they hold, nonzero ones normal
FP32_RANGE = (torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max / 2)


def check_tensor(name: str, x: object, ndim: int, layout: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims {layout}, got shape {tuple(x.shape)}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, 4, "(batch, seqlen, nheads, headdim)")
    _check_shared(q, k, v, "(batch, seqlen_k, nheads_k, headdim)")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q has batch {q.shape[0]}, k and v have batch {k.shape[0]}: they must match")


def _check_shared(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layout: str, kv=("k", "v")) -> None:
    """dtype, device, k/v shapes, head dim and GQA, for dense and varlen layouts (heads at dim -2); kv: the names
    the messages give k and v (a KV cache's are k_cache and v_cache)."""
    _check_same("dtype", q, k, v, lambda x: x.dtype, kv)
    _check_same("device", q, k, v, lambda x: x.device, kv)
    k_name, v_name = kv
    if q.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"q, {k_name}, {v_name} have dtype {q.dtype}: supported dtypes are {names}; cast the inputs")
    if k.shape != v.shape:
        raise ValueError(
            f"{k_name} {tuple(k.shape)} and {v_name} {tuple(v.shape)} must have the same shape {kv_layout}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q has head dim {q.shape[-1]}, {k_name} and {v_name} have {k.shape[-1]}: they must match")
    check_input_head_dim(q.shape[-1])
    heads, heads_k = q.shape[-2], k.shape[-2]
    if heads_k == 0 or heads % heads_k != 0:
        raise ValueError(
            f"{k_name} and {v_name} have {heads_k} heads, q has {heads}: q heads must be a positive multiple of "
            f"{k_name} heads (MQA/GQA)"
        )


def _check_same(what: str, q, k, v, get, kv=("k", "v")) -> None:
    if not get(q) == get(k) == get(v):
        raise ValueError(f"q, {kv[0]}, {kv[1]} must share one {what}; got {get(q)}, {get(k)}, {get(v)}")


def check_input_head_dim(head_dim: int) -> None:
    """A head dim the public API takes: 1 to 256, as flash_attn (it pads to the kernels' step itself)."""
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"head dim {head_dim} is not supported: q, k, v need a head dim from 1 to {MAX_HEAD_DIM} (as in flash_attn)"
        )


def check_head_dim(head_dim: int) -> None:
    """A head dim the kernels run as is (warmup compiles those): a multiple of HEAD_DIM_STEP up to MAX_HEAD_DIM."""
    if not (HEAD_DIM_STEP <= head_dim <= MAX_HEAD_DIM and head_dim % HEAD_DIM_STEP == 0):
        raise ValueError(
            f"head dim {head_dim} is not a kernel head dim: use a multiple of {HEAD_DIM_STEP} from "
            f"{HEAD_DIM_STEP} to {MAX_HEAD_DIM} (the API runs other head dims zero-padded up to one)"
        )


def _host_scalar(name: str, x):
    """A 0-d tensor or numpy array as its Python value, read on the host (as a custom op's float, int or bool argument
    takes one, flash_attn's among them; a CUDA tensor's read waits for the GPU); anything else as is. A tensor that
    requires grad is refused: no gradient would reach it."""
    if isinstance(x, torch.Tensor) and x.dim() == 0:
        if x.requires_grad:
            raise TypeError(f"{name} is a tensor that requires grad, which the option's value cannot pass on: pass a "
                            f"Python number ({name}.item()) or a tensor without grad")  # fmt: skip
        return x.item()
    if type(x).__module__ == "numpy" and getattr(x, "ndim", None) == 0:
        return x.item()
    return x


def resolve_softmax_scale(softmax_scale: float | None, head_dim: int) -> float:
    """softmax_scale: any finite real, 0 and negative ones included (as flash_attn); None: 1 / sqrt(head_dim), of
    the head dim the caller passed (not a padded one)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    softmax_scale = _host_scalar("softmax_scale", softmax_scale)
    if not _is_real(softmax_scale):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not abs(softmax_scale) < math.inf:  # not math.isfinite, which a traced (symbolic) float cannot pass through
        raise ValueError(f"softmax_scale must be a finite number (None: 1 / sqrt(headdim)), got {softmax_scale}")
    _check_fp32_range("softmax_scale", softmax_scale)
    return float(softmax_scale)


def _check_fp32_range(name: str, value: float, headroom: float = 1.0) -> None:
    """A finite scalar the kernels compute with in fp32 must stay finite and normal there (or be 0): at most
    FP32_RANGE's bound / headroom, for kernels that multiply it by up to 2 * headroom."""
    low, high = FP32_RANGE[0], FP32_RANGE[1] / headroom
    if abs(value) > high or 0.0 < abs(value) < low:
        raise ValueError(f"{name} = {value} is outside fp32's range for the kernels: pass 0 or a magnitude from "
                         f"{low:.3g} to {high:.3g}")  # fmt: skip


def _is_int(x: object) -> bool:
    # the exact type first: an ABC's isinstance costs about a microsecond
    return type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, bool))


def _is_real(x: object) -> bool:
    return type(x) is float or type(x) is int or (isinstance(x, numbers.Real) and not isinstance(x, bool))


def _host_values(window_size):
    """A tensor's or numpy array's entries (or a tuple's 0-d ones) as Python scalars, read on the host once; anything
    else as is."""
    if isinstance(window_size, torch.Tensor) or type(window_size).__module__ == "numpy":
        return window_size.tolist() if window_size.ndim == 1 else window_size
    if isinstance(window_size, (tuple, list)):
        return [_host_scalar("window_size", w) for w in window_size]
    return window_size


def check_window(window_size) -> tuple[int, int]:
    """window_size: (left, right), each an int >= 0, or -1 for no bound on that side; a tuple, a list or a 1-D
    integer tensor or numpy array (as flash_attn's tests pass). Returns it as Python ints."""
    values = _host_values(window_size)
    if not (isinstance(values, (tuple, list)) and len(values) == 2 and all(map(_is_int, values))):
        raise TypeError(
            f"window_size must be a pair of ints (left, right): a tuple, list or integer tensor, e.g. (256, 0); "
            f"got {window_size!r}"
        )
    left, right = (int(w) for w in values)
    if left < -1 or right < -1:
        raise ValueError(f"window_size must be (left, right) with each >= -1 (-1: unbounded), got ({left}, {right})")
    return left, right


def check_flag(name: str, value) -> bool:
    """A bool option: a bool (numpy's too, or a 0-d tensor), or an int 0 or 1; anything else, such as the string
    "False" (true as a condition), is refused."""
    if type(value) is bool:
        return value
    value = _host_scalar(name, value)  # (numpy's bools and ints, and 0-d tensors, as Python's)
    if type(value) is bool or isinstance(value, torch.SymBool) or (_is_int(value) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{name} must be a bool (True or False), got {value!r}")


def causal_window(window: tuple[int, int], causal: bool) -> tuple[int, int]:
    """check_window's (left, right) under flash_attn's rule: causal=True is the right bound at the diagonal (0),
    whatever window_size says."""
    return (window[0], 0) if check_flag("causal", causal) else window


def check_dropout(dropout_p) -> float:
    """dropout_p: a probability in [0, 1). Returns it as a float."""
    dropout_p = _host_scalar("dropout_p", dropout_p)
    if not _is_real(dropout_p):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1) (0.0 disables dropout, e.g. for evaluation), got {dropout_p}")
    return float(dropout_p)


def check_softcap(softcap, softmax_scale: float) -> float:
    """softcap: a finite float >= 0 (0 disables it). softmax_scale / softcap, which the kernels' tanh takes in fp32
    times 2 log2(e), must stay in fp32's range too (an overflow to inf would make a zero score NaN). Returns softcap
    as a float."""
    softcap = _host_scalar("softcap", softcap)
    if not _is_real(softcap):
        raise TypeError(f"softcap must be a float (0.0 disables it), got {type(softcap).__name__}")
    if not (abs(softcap) < math.inf and softcap >= 0.0):  # NaN fails both; abs() traces, math.isfinite does not
        raise ValueError(f"softcap must be >= 0 and finite (0.0 disables it), got {softcap}")
    _check_fp32_range("softcap", softcap)
    if softcap:
        _check_fp32_range("softmax_scale / softcap", softmax_scale / softcap, headroom=2.0)
    return float(softcap)


def check_alibi_slopes(alibi_slopes: torch.Tensor, batch: int, nheads: int, device: torch.device) -> torch.Tensor:
    """alibi_slopes: (nheads,) or (batch, nheads) fp32 on q's device. Returns it as (batch, nheads) fp32 contiguous."""
    if not isinstance(alibi_slopes, torch.Tensor):
        kind = type(alibi_slopes).__name__
        raise TypeError(f"alibi_slopes must be a torch.Tensor of shape (nheads,) or (batch, nheads), got {kind}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}: pass alibi_slopes.float()")
    if alibi_slopes.device != torch.device(device):
        raise ValueError(
            f"alibi_slopes is on {alibi_slopes.device}, q on {device}: move it with alibi_slopes.to(q.device)"
        )
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(
            f"alibi_slopes must have shape ({nheads},) (nheads) or ({batch}, {nheads}) (batch, nheads), "
            f"got {tuple(alibi_slopes.shape)}"
        )
    return alibi_slopes.expand(batch, nheads).contiguous()


def check_sinks(sinks: torch.Tensor, nheads: int, device: torch.device) -> torch.Tensor:
    """sinks: (nheads,), floating, on q's device. Returns it as fp32 contiguous: the kernels read fp32, and a bf16 or
    fp16 parameter (a model's) is cast, its gradient cast back by autograd. Values are not read (that would
    synchronise): finite, or -inf for a head without a sink."""
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor of shape (nheads,) = ({nheads},), got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating tensor (fp32 preferred), got {sinks.dtype}: pass sinks.float()")
    if tuple(sinks.shape) != (nheads,):
        raise ValueError(f"sinks must have shape (nheads,) = ({nheads},), one logit per query head; got "
                         f"{tuple(sinks.shape)}")  # fmt: skip
    if sinks.device != torch.device(device):
        raise ValueError(f"sinks is on {sinks.device}, q on {device}: move it with sinks.to(q.device)")
    return sinks.float().contiguous()


# cu_seqlens already read to the host: tensor -> (its version counter then, its values)
_HOST_READS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def host_read(x: torch.Tensor, key: Hashable, read: Callable[[torch.Tensor], Any]) -> Any:
    """read(x), which brings device values to the host, synchronising only for a (tensor, key) not
    read before or written in place since.

    torch bumps a tensor's version counter on every in-place write through torch (views included),
    so a cached read is stale exactly when the counter moved. Writes that bypass the counter (through
    ``.data``, or a raw pointer handed to another library) are not seen: pass a fresh tensor after such a write.
    Inference tensors have no counter and are read every time. Concurrent callers may both read.
    """
    if x.is_inference():
        return read(x)
    reads = _HOST_READS.setdefault(x, {})
    cached = reads.get(key)
    if cached is not None and cached[0] == x._version:
        return cached[1]
    value = read(x)
    reads[key] = (x._version, value)
    return value


def host_read_cached(x: torch.Tensor, key: Hashable) -> tuple[bool, Any]:
    """(found, value) of host_read's cache for (x, key), without reading the device."""
    cached = None if x.is_inference() else _HOST_READS.get(x, {}).get(key)
    if cached is None or cached[0] != x._version:
        return False, None
    return True, cached[1]


def check_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    block_table: torch.Tensor | None = None,
) -> None:
    """A packed variable-length batch: q (total_q, nheads, headdim), k, v (total_k, nheads_k, headdim),
    cu_seqlens_q, cu_seqlens_k (batch + 1,) int32 on q's device; max_seqlen_q, max_seqlen_k ints. With a
    block_table (batch, max_blocks) int32, k and v are paged caches (num_blocks, page_size, nheads_k, headdim) that
    hold max_seqlen_k rows per sequence.

    Shapes, dtypes and devices only, so that a traced call checks them too; the values are check_cu_seqlens's,
    which the op runs before it launches anything.
    """
    check_tensor("q", q, 3, "(total_q, nheads, headdim)")
    layout = "(total_k, nheads_k, headdim)" if block_table is None else "(num_blocks, page_size, nheads_k, headdim)"
    check_tensor("k", k, 3 if block_table is None else 4, layout)
    check_tensor("v", v, 3 if block_table is None else 4, layout)
    _check_shared(q, k, v, layout)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(name, cu, 1, "(batch + 1,)")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}: pass {name}.to(torch.int32)")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device}, q on {q.device}: pass {name}.to(q.device)")
        if cu.shape[0] == 0:
            raise ValueError(f"{name} must have batch + 1 >= 1 entries, starting with 0; got an empty tensor")
        if cu.stride(0) != 1:  # the kernels read entry b at cu + b
            raise ValueError(f"{name} must be contiguous, got stride {cu.stride(0)}: pass {name}.contiguous()")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries, cu_seqlens_k {cu_seqlens_k.shape[0]}: "
            "both must be (batch + 1,) for the same batch"
        )
    for name, max_seqlen in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not _is_int(max_seqlen):
            raise TypeError(f"{name} must be an int, got {type(max_seqlen).__name__}: pass int({name})")
    if block_table is not None:
        if q.shape[-1] % HEAD_DIM_STEP:
            raise ValueError(
                f"head dim {q.shape[-1]} with a block_table: paged caches take head dims that are multiples of "
                f"{HEAD_DIM_STEP} (another would pad a copy of the whole cache); pad the cache's head dim with zeros"
            )
        _check_index("block_table", block_table, 2, "(batch, max_blocks_per_sequence)", q)
        if block_table.shape[0] != cu_seqlens_q.shape[0] - 1:
            raise ValueError(
                f"block_table has {block_table.shape[0]} rows for a batch of {cu_seqlens_q.shape[0] - 1} sequences "
                "(cu_seqlens_q has batch + 1 entries): one row of page indices per sequence"
            )
        capacity = block_table.shape[1] * k.shape[1]
        if max_seqlen_k > capacity:
            raise ValueError(
                f"max_seqlen_k is {max_seqlen_k} but a block_table row of {block_table.shape[1]} pages of "
                f"{k.shape[1]} rows holds {capacity}: pass more pages per sequence"
            )


def check_cu_seqlens(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    total_q: int,
    total_k: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
) -> None:
    """cu_seqlens' values: from 0, non-decreasing, ending at the packed lengths, no sequence longer than its max.

    Reads them on the host: one device sync the first time a tensor is seen, none while the same tensor comes back
    unmodified with the same totals (a model's layers share one batch's cu_seqlens); see host_read.
    """
    for name, cu, total, max_seqlen in (
        ("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q),
        ("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k),
    ):
        check = functools.partial(_check_starts, name, total=total, max_seqlen=max_seqlen)
        host_read(cu, ("checked", name, total, max_seqlen), check)


def _check_starts(name: str, cu: torch.Tensor, *, total: int, max_seqlen: int) -> bool:
    starts = host_read(cu, "values", torch.Tensor.tolist)
    lengths = [b - a for a, b in pairwise(starts)]
    if starts[0] != 0:
        raise ValueError(f"{name} must start at 0 (cumulative sequence lengths), got {name}[0] = {starts[0]}")
    for b, n in enumerate(lengths):
        if n < 0:
            raise ValueError(
                f"{name} must never decrease (cumulative sequence lengths), got {name}[{b}] = {starts[b]} "
                f"> {name}[{b + 1}] = {starts[b + 1]}"
            )
    if starts[-1] != total:
        raise ValueError(
            f"{name} ends at {starts[-1]} but the packed tensor has {total} tokens: "
            "the last entry must be the total length"
        )
    max_name, longest = name.replace("cu_seqlens", "max_seqlen"), max(lengths, default=0)
    if max_seqlen < longest:
        raise ValueError(
            f"{max_name} is {max_seqlen} but the longest sequence in {name} has {longest} tokens: pass at least "
            f"{longest}"
        )
    return True


def check_kvcache(
    q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table, num_splits
) -> int:
    """flash_attn_with_kvcache's tensors and their shapes, dtypes and devices; returns the cache's capacity (the rows
    one sequence may use). Index tensors' values are not read (that would synchronise): see check_cache_index."""
    check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    layout = "(batch_cache, seqlen_cache, nheads_k, headdim)"
    if block_table is not None:
        layout = "(num_blocks, page_size, nheads_k, headdim) with a block_table"
    check_tensor("k_cache", k_cache, 4, layout)
    check_tensor("v_cache", v_cache, 4, layout)
    _check_shared(q, k_cache, v_cache, layout, kv=("k_cache", "v_cache"))
    if q.shape[1] == 0:
        raise ValueError("q has seqlen_q = 0: pass at least one query, (batch, seqlen_q >= 1, nheads, headdim)")
    if q.shape[2] == 0:
        raise ValueError("q has 0 heads: pass at least one, (batch, seqlen_q, nheads >= 1, headdim)")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (it is written in place): pass a cache whose "
                             f"stride(-1) is 1")  # fmt: skip
    if (k is None) != (v is None):
        raise ValueError("pass both k and v (the new rows to append) or neither")
    if k is not None:
        _check_new_kv(q, k_cache, k, v)
    if block_table is not None:
        _check_index("block_table", block_table, 2, "(batch, max_blocks_per_sequence)", q)
        if block_table.shape[0] != q.shape[0]:
            raise ValueError(f"block_table has {block_table.shape[0]} rows, q has batch {q.shape[0]}: one per sequence")
        if k_cache.shape[1] == 0:
            raise ValueError("k_cache has pages of 0 rows: pass (num_blocks, page_size >= 1, nheads_k, headdim)")
        if block_table.shape[1] == 0:
            raise ValueError("block_table lists no pages: pass (batch, max_blocks_per_sequence >= 1)")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx does not combine with block_table: list each sequence's pages in its row")
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        if cache_batch_idx is not None:
            check_cache_index("cache_batch_idx", cache_batch_idx, q)
        elif k_cache.shape[0] < q.shape[0]:  # a larger cache's first rows serve the batch, as in flash_attn
            raise ValueError(
                f"k_cache has batch {k_cache.shape[0]}, q {q.shape[0]}: pass cache_batch_idx to pick each sequence's "
                "cache row, or a cache of at least q's batch"
            )
        capacity = k_cache.shape[1]
    if cache_leftpad is not None:
        check_cache_index("cache_leftpad", cache_leftpad, q)
    if rotary_cos is not None or rotary_sin is not None:
        _check_rotary(q, k, rotary_cos, rotary_sin, capacity)
    if not (_is_int(num_splits) and 0 <= num_splits <= config.DECODE_MAX_SPLITS):
        raise ValueError(
            f"num_splits must be an int from 0 (choose) to {config.DECODE_MAX_SPLITS}; 1 splits nothing; "
            f"got {num_splits!r}"
        )
    return capacity


def _check_new_kv(q, k_cache, k, v) -> None:
    for name, x in (("k", k), ("v", v)):
        _check_like_q(name, x, 4, "(batch, seqlen_new, nheads_k, headdim)", q)
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    expected = (q.shape[0], k.shape[1], *k_cache.shape[2:])
    if tuple(k.shape) != expected:
        raise ValueError(
            f"k and v must be (batch, seqlen_new, nheads_k, headdim) = {expected} for q's batch and the cache's heads, "
            f"got {tuple(k.shape)}"
        )


def _check_like_q(name: str, x, ndim: int, layout: str, q) -> None:
    check_tensor(name, x, ndim, layout)
    if x.dtype != q.dtype or x.device != q.device:
        raise ValueError(f"{name} is {x.dtype} on {x.device}, q {q.dtype} on {q.device}: pass {name}.to(q)")


def _check_index(name: str, x, ndim: int, layout: str, q) -> None:
    check_tensor(name, x, ndim, layout)
    if x.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {x.dtype}: pass {name}.to(torch.int32)")
    if x.device != q.device:
        raise ValueError(f"{name} is on {x.device}, q on {q.device}: pass {name}.to(q.device)")


def check_cache_index(name: str, x, q) -> None:
    """cache_seqlens, cache_batch_idx, cache_leftpad: (batch,) int32 on q's device. Their values are device data,
    not checked (reading them would synchronise the host and break CUDA-graph capture)."""
    _check_index(name, x, 1, "(batch,)", q)
    if x.shape[0] != q.shape[0]:
        raise ValueError(f"{name} has {x.shape[0]} entries, q has batch {q.shape[0]}: one per sequence")


def check_cache_seqlens(cache_seqlens, q, seqlen_new: int, capacity: int) -> None:
    """An int: the rows already in every sequence's cache, with room for seqlen_new more; or check_cache_index's. An
    append longer than the cache is refused either way (shapes alone say so)."""
    if seqlen_new > capacity:
        raise ValueError(
            f"k and v append {seqlen_new} rows to a cache of {capacity} rows per sequence: pass at most {capacity} "
            "new rows, or a larger cache"
        )
    if isinstance(cache_seqlens, torch.Tensor):
        check_cache_index("cache_seqlens", cache_seqlens, q)
        return
    if not _is_int(cache_seqlens):
        raise TypeError(f"cache_seqlens must be an int or a (batch,) int32 tensor, got {type(cache_seqlens).__name__}")
    if not 0 <= cache_seqlens <= capacity - seqlen_new:
        raise ValueError(
            f"cache_seqlens = {cache_seqlens} with {seqlen_new} new rows does not fit a cache of {capacity} rows per "
            f"sequence: pass 0 <= cache_seqlens <= {capacity - seqlen_new}, or a larger cache"
        )


def _check_rotary(q, k, rotary_cos, rotary_sin, capacity: int) -> None:
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("pass both rotary_cos and rotary_sin, (seqlen_ro, rotary_dim / 2) each, or neither")
    if k is None:
        raise ValueError("rotary_cos / rotary_sin rotate the new k: they need k and v to append (as in flash_attn)")
    for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        _check_like_q(name, x, 2, "(seqlen_ro, rotary_dim / 2)", q)
    if rotary_cos.shape != rotary_sin.shape:
        raise ValueError(f"rotary_cos {tuple(rotary_cos.shape)} and rotary_sin {tuple(rotary_sin.shape)} must match")
    if not 0 < 2 * rotary_cos.shape[1] <= q.shape[-1]:
        raise ValueError(
            f"rotary_cos has {rotary_cos.shape[1]} columns: rotary_dim = 2 x that must be from 2 to the head dim "
            f"{q.shape[-1]}"
        )
    if rotary_cos.shape[0] < capacity:
        raise ValueError(
            f"rotary_cos has {rotary_cos.shape[0]} positions, the cache {capacity} rows per sequence: pass at least "
            f"{capacity} (as flash_attn)"
        )
