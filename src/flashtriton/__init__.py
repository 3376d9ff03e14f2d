"""flashtriton: FlashAttention-2 (exact, IO-aware attention) in Triton, flash_attn-compatible."""

# The one place the version is written: pyproject.toml reads it from here (setuptools, without importing).
__version__ = "0.1.0"

from .block_mask import BlockMask, create_block_mask
from .dropout import dropout_mask
from .interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from .mods import Mod, and_masks, causal_mask, document_mask, or_masks, prefix_lm_mask, sliding_window_mask
from .reference import attention_reference

__all__ = [
    "BlockMask",
    "Mod",
    "and_masks",
    "attention_reference",
    "causal_mask",
    "create_block_mask",
    "document_mask",
    "dropout_mask",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "or_masks",
    "prefix_lm_mask",
    "sliding_window_mask",
]
