"""AttentionParams as the custom ops' schema arguments and back: the one place that knows both.

A field of a plain type (float, int, bool, an optional tensor) is one schema argument of that type and name, so a
new such field in params.py needs no edit here. A field holding Python objects has a codec below that turns it into
a few schema arguments (tensor lists, ints, a registry key for user @triton.jit functions) and back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .block_mask import LIST_FIELDS, BlockMask
from .mods import Mod, registered
from .params import AttentionParams

# ints as SymInt: a traced varlen call's max_seqlen then stays symbolic (as "int" a compiled function recompiled
# for every new value, and fullgraph failed past the recompile limit)
_PLAIN_TYPES = {"float": "float", "int": "SymInt", "bool": "bool", "torch.Tensor | None": "Tensor?"}


@dataclass(frozen=True)
class _Codec:
    arguments: tuple[str, ...]  # typed schema arguments, e.g. "Tensor[] score_mod_tensors"
    encode: Callable[[Any], tuple]
    decode: Callable[..., Any]  # from the arguments' values, in order


def _encode_mod(mod: Mod | None) -> tuple[str, list[torch.Tensor]]:
    """User mod functions cannot be schema arguments: they travel as their Mod's registry key, tensors as a list."""
    return ("", []) if mod is None else (mod.key, list(mod.tensors))


def _decode_mod(key: str, tensors: list[torch.Tensor]) -> Mod | None:
    if not key:
        return None
    fn, grad = registered(key)
    return Mod(fn, tuple(tensors), grad)


def _encode_block_mask(mask: BlockMask | None) -> tuple:
    if mask is None:
        return [], [], "", []
    lists = [getattr(mask, name) for name in LIST_FIELDS]
    lists = [t if t is not None else mask.kv_num_blocks.new_empty(0) for t in lists]
    return (lists, [mask.seqlen_q, mask.seqlen_k, *mask.block_size], *_encode_mod(mask.mask_mod))


def _decode_block_mask(lists, shape, mask_mod, mask_tensors) -> BlockMask | None:
    if not lists:
        return None
    seqlen_q, seqlen_k, block_m, block_n = shape
    named = {name: t if t.numel() else None for name, t in zip(LIST_FIELDS, lists, strict=True)}
    return BlockMask(seqlen_q, seqlen_k, (block_m, block_n), **named, mask_mod=_decode_mod(mask_mod, mask_tensors))


_CODECS = {
    "block_mask": _Codec(
        ("Tensor[] block_mask_lists", "int[] block_mask_shape", "str mask_mod", "Tensor[] mask_mod_tensors"),
        _encode_block_mask, _decode_block_mask,
    ),
    "score_mod": _Codec(("str score_mod", "Tensor[] score_mod_tensors"), _encode_mod, _decode_mod),
}  # fmt: skip


def _plain_codec(field: dataclasses.Field) -> _Codec:
    if field.type not in _PLAIN_TYPES:
        raise TypeError(f"AttentionParams.{field.name}: {field.type} needs a codec in schema.py")
    return _Codec((f"{_PLAIN_TYPES[field.type]} {field.name}",), lambda value: (value,), lambda value: value)


_FIELDS = tuple((f.name, _CODECS.get(f.name) or _plain_codec(f)) for f in dataclasses.fields(AttentionParams))

SIGNATURE = ", ".join(argument for _, codec in _FIELDS for argument in codec.arguments)
"""The schema arguments that carry an AttentionParams, after the op's tensors."""


def to_schema(p: AttentionParams) -> list:
    """p as the values of SIGNATURE's arguments, in order."""
    return [value for name, codec in _FIELDS for value in codec.encode(getattr(p, name))]


def from_schema(values: Sequence) -> AttentionParams:
    """The AttentionParams that to_schema turned into ``values``."""
    fields, i = {}, 0
    for name, codec in _FIELDS:
        fields[name] = codec.decode(*values[i : i + len(codec.arguments)])
        i += len(codec.arguments)
    return AttentionParams(**fields)


def no_grads(values: Sequence) -> list:
    """An autograd backward's None for each schema argument, in the structure torch flattened them to: Tensor[]
    (and an empty list) is a list of leaves, a non-empty int[] one leaf."""
    return [
        [None] * len(x) if isinstance(x, list) and (not x or isinstance(x[0], torch.Tensor)) else None for x in values
    ]


_POSITIONS = {name: i for i, name in enumerate(arg.split()[-1] for _, codec in _FIELDS for arg in codec.arguments)}


def gradients(values: Sequence, **grads: torch.Tensor | None) -> list:
    """no_grads, but the named plain tensor fields' arguments take the given gradients where the call passed a
    tensor for them (None where it passed none)."""
    result = no_grads(values)
    for name, grad in grads.items():
        at = _POSITIONS[name]
        result[at] = grad if values[at] is not None else None
    return result
