"""flashtriton as a transformers attention implementation (transformers >= 5).

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=register())

register() adds `attention` to transformers' AttentionInterface and `padding_mask` to its AttentionMaskInterface under
one name. transformers hands the attention function (batch, nheads, seqlen, headdim) tensors; flashtriton reads them
as (batch, seqlen, nheads, headdim) views, without copies, and computes one of three ways:
  - no padding: flash_attn_func over the whole batch;
  - a padded batch (`padding_mask` gives a (batch, keys) bool mask, True on real tokens, left or right padding): the
    real tokens are gathered into flash_attn_varlen_func's packed layout and the output scattered back, zeros on
    padding, so no work is done on padding;
  - a padding-free packed batch (no mask; position_ids restart inside the one row of the batch, as
    DataCollatorWithFlattening makes them, or its cu_seq_lens_q/k kwargs): one varlen sequence per run of consecutive
    positions.
Masks are aligned bottom-right (flash_attn's convention), so a query block against a longer KV cache (decoding) is
causal at the cache's end.

The name must not contain "flash": transformers 5 takes any attn_implementation containing "flash" for one of its own
flash_attn kernels (it loads that package or a hub kernel for it, and changes how generate() treats the mask).
"""

from __future__ import annotations

import torch

from ..interface import flash_attn_func, flash_attn_varlen_func

DEFAULT_NAME = "triton_attention"


def register(name: str | None = None) -> str:
    """Register flashtriton with transformers under `name` (default "triton_attention") and return that name, to pass
    as `attn_implementation` (from_pretrained, from_config or model.set_attn_implementation).

    Covers causal and bidirectional attention, GQA/MQA, scaling, dropout, `sliding_window`, `softcap`, attention sinks
    (gpt-oss's `s_aux`), padded batches, padding-free packed batches and KV-cache decoding (dynamic and static caches).
    Attention weights (output_attentions) are not computed: None is returned for them.
    """
    name = DEFAULT_NAME if name is None else name
    if "flash" in name:
        raise ValueError(
            f"attn_implementation name {name!r} contains 'flash', which transformers reserves for its flash_attn "
            f"kernels: choose a name without it (the default is {DEFAULT_NAME!r})"
        )
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as error:
        raise ImportError(
            "flashtriton.integrations.transformers needs transformers >= 5 (its AttentionInterface and "
            "AttentionMaskInterface): pip install 'transformers>=5'"
        ) from error
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, padding_mask)
    return name


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """transformers' mask function: None when every key of every row is real (the layer then runs flash_attn_func),
    otherwise a (batch, n) bool mask, True on real tokens, for the first n <= kv_length keys.

    attention_mask: the user's (batch, past + q_length) 0/1 mask, or None. A sliding-window cache layer holds only the
    last kv_length keys, so the mask's last kv_length columns are theirs. A static cache holds kv_length rows of which
    only the first q_offset + q_length - kv_offset are written; the mask then covers those and the layer drops the rest.
    """
    _check_mask_function(kwargs.get("mask_function"), q_offset + q_length, kv_offset + kv_length)
    written = q_offset + q_length - kv_offset
    if attention_mask is None:
        if bool(written >= kv_length):
            return None
        return torch.ones(batch_size, int(written), dtype=torch.bool, device=kwargs.get("device"))
    _check_padding_mask(attention_mask, batch_size)
    mask = attention_mask[:, -kv_length:].bool()
    if mask.shape[1] == kv_length and bool(mask.all()):
        return None
    return mask


# Overlays of transformers' masking_utils that the attention below does not compute (it takes causal or not, a sliding
# window, padding and packing from its own arguments): chunked attention (Llama4) and blocks of bidirectional tokens.
_UNSUPPORTED_OVERLAYS = ("chunked_overlay", "blockwise_overlay")


def _check_mask_function(mask_function, queries_end, keys_end) -> None:
    """Refuses a layer mask that this attention would silently replace by plain causal or bidirectional attention:
    unions of masks (or_masks, which user overlays and images make) and the overlays above; a chunked mask passes
    while every position lies in the first chunk (where it is causal). Masks are read through and_masks' closures;
    functions it does not know (a user's and_mask_function) pass unseen."""
    if mask_function is None:
        return
    name = getattr(mask_function, "__qualname__", "")
    if name.startswith("or_masks"):
        raise NotImplementedError(
            "this layer's mask is a union of masks (or_mask_function, image tokens attending to each other), which "
            "flashtriton's transformers attention does not compute: use attn_implementation='sdpa' for this model"
        )
    cells = dict(zip(mask_function.__code__.co_freevars, mask_function.__closure__ or (), strict=True))
    if "mask_functions" in cells:  # and_masks: every one of them applies
        for inner in cells["mask_functions"].cell_contents:
            _check_mask_function(inner, queries_end, keys_end)
        return
    overlay = next((o for o in _UNSUPPORTED_OVERLAYS if name.startswith(o)), None)
    if overlay is None:
        return
    chunk = cells["chunk_size"].cell_contents if "chunk_size" in cells else None
    if chunk is not None and max(int(queries_end), int(keys_end)) <= chunk:
        return  # one chunk: causal
    raise NotImplementedError(
        f"this layer's mask has a {overlay.removesuffix('_overlay')} overlay (chunked attention, as Llama4's, past its "
        "first chunk; or blocks of bidirectional tokens), which flashtriton's transformers attention does not "
        "compute: use attn_implementation='sdpa' for this model"
    )


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function.

    query: (batch, nheads, seqlen_q, headdim); key, value: (batch, nheads_k, seqlen_k, headdim), nheads a multiple of
    nheads_k. attention_mask: None or padding_mask's (batch, n) bool mask. causal: the is_causal kwarg, else
    module.is_causal. dropout: as given (models pass 0 outside training). sliding_window: a query sees itself and the
    sliding_window - 1 keys before it (transformers' convention; bidirectional layers also see as many after it).
    softcap: None or 0 for none. kwargs: position_ids (packed sequences), cu_seq_lens_q/k with max_length_q/k (packed
    sequences, precomputed), s_aux or sinks (gpt-oss's learnable sinks, (nheads,): flash_attn_func's sinks); others
    are ignored.

    Returns (out (batch, seqlen_q, nheads, headdim), None).
    """
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, sliding_window - 1)
    sinks = kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")
    options = dict(
        dropout_p=dropout, softmax_scale=scaling, causal=causal, window_size=window, softcap=float(softcap or 0.0),
        sinks=sinks,
    )  # fmt: skip
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    if attention_mask is not None:
        return _padded(q, k, v, attention_mask, options), None
    packed = _packed_lengths(q, k, kwargs)
    if packed is not None:
        return _packed(q, k, v, *packed, options), None
    return flash_attn_func(q, k, v, **options), None


def _check_padding_mask(mask: torch.Tensor, batch: int) -> None:
    if mask.dim() != 2 or mask.shape[0] != batch:
        raise ValueError(
            f"flashtriton's transformers attention takes a (batch, seqlen) 0/1 padding mask, got shape "
            f"{tuple(mask.shape)} for batch {batch}: pass a 2-D attention_mask, or use attn_implementation='sdpa' "
            "for custom 4-D masks"
        )


def _unpad_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(batch rows, positions, cu_seqlens int32, longest length) of the True entries of a (batch, n) bool mask."""
    rows, positions = mask.nonzero(as_tuple=True)
    lengths = mask.sum(dim=1, dtype=torch.int32)
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return rows, positions, cu_seqlens, int(lengths.max())


def _check_no_holes(mask: torch.Tensor) -> None:
    """Refuses a padding mask with zeros between a row's real tokens under a sliding window that may hide keys:
    packed together, the window would count real tokens, not positions (left and right padding pack without
    changing it)."""
    n = mask.shape[1]
    columns = torch.arange(n, device=mask.device)
    first = torch.where(mask, columns, n).amin(dim=1)
    last = torch.where(mask, columns, -1).amax(dim=1)
    lengths = mask.sum(dim=1)
    if bool(((lengths > 0) & (last - first + 1 != lengths)).any()):
        raise NotImplementedError(
            "this padding mask has zeros between a row's real tokens (neither left nor right padding), which "
            "flashtriton's transformers attention does not compute under a sliding window: use "
            "attn_implementation='sdpa' for such masks"
        )


def _padded(q, k, v, mask: torch.Tensor, options: dict) -> torch.Tensor:
    """Attention of a padded batch through varlen: real tokens only, the queries being the mask's last n_q columns;
    in a cross-attention (not causal, queries and keys of different lengths: an encoder's padding mask) every query.
    A cross-attention whose encoder and decoder lengths are equal cannot be told from a self-attention here: it
    takes the encoder's padding for its queries' too."""
    _check_padding_mask(mask, q.shape[0])
    mask = mask.bool()
    k, v = k[:, : mask.shape[1]], v[:, : mask.shape[1]]  # a static cache's unwritten rows are not keys
    if bool(mask.all()):
        return flash_attn_func(q, k, v, **options)
    if 0 <= options["window_size"][0] < mask.shape[1] - 1:  # a window that may hide a key
        _check_no_holes(mask)
    rows_k, positions_k, cu_seqlens_k, max_k = _unpad_index(mask)
    queries = mask[:, -q.shape[1] :]
    if not options["causal"] and q.shape[1] != k.shape[1]:  # cross-attention: the mask is the encoder's keys'
        queries = torch.ones(q.shape[:2], dtype=torch.bool, device=mask.device)
    rows_q, positions_q, cu_seqlens_q, max_q = _unpad_index(queries)
    out = flash_attn_varlen_func(
        q[rows_q, positions_q], k[rows_k, positions_k], v[rows_k, positions_k], cu_seqlens_q, cu_seqlens_k,
        max_q, max_k, **options,
    )  # fmt: skip
    padded = out.new_zeros(q.shape)
    padded[rows_q, positions_q] = out
    return padded


def _packed_lengths(q, k, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of a padding-free packed batch, or None for a batch of
    whole rows. Given by cu_seq_lens_q/k and max_length_q/k, or read from the position_ids of a batch of one row (the
    packed layout; as transformers' flash_attn path, larger batches are not inspected, which would synchronise every
    layer): a sequence starts where the position does not follow the previous one by 1 (as transformers' masks read
    packing)."""
    if kwargs.get("cu_seq_lens_q") is not None:
        cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
        return cu_q.to(torch.int32), cu_k.to(torch.int32), int(kwargs["max_length_q"]), int(kwargs["max_length_k"])
    position_ids = kwargs.get("position_ids")
    n = q.shape[1]
    if position_ids is None or q.shape[0] != 1 or position_ids.shape != (1, n) or k.shape[1] != n or n < 2:
        return None
    starts = torch.ones(n, dtype=torch.bool, device=q.device)
    starts[1:] = position_ids[0].diff() != 1
    if int(starts.sum()) == 1:
        return None
    ends = torch.tensor([n], dtype=torch.int32, device=q.device)
    cu_seqlens = torch.cat((starts.nonzero().flatten().to(torch.int32), ends))
    longest = int(cu_seqlens.diff().max())
    return cu_seqlens, cu_seqlens, longest, longest


def _packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q: int, max_k: int, options: dict) -> torch.Tensor:
    """Attention of packed sequences through varlen; a view of q, k, v when the batch is one row."""
    q_packed, k_packed, v_packed = (x.flatten(0, 1) for x in (q, k, v))
    out = flash_attn_varlen_func(q_packed, k_packed, v_packed, cu_seqlens_q, cu_seqlens_k, max_q, max_k, **options)
    return out.unflatten(0, q.shape[:2])
