"""Context parallelism: one sequence's attention split across the ranks of a process group (docs/distributed.md).

  shard, unshard                  a full sequence -> this rank's shard and back (layout.py: zigzag or contiguous)
  shard_varlen, unshard_varlen    the same for a packed batch of documents, document by document
  ring_flash_attn_func            exact attention on the shards, K/V passed around a ring (ring.py, steps.py);
                                  with an ulysses_group, ring x Ulysses (2-D)
  ring_flash_attn_varlen_func     the same on a packed batch's shards, with the global cu_seqlens
  ulysses_flash_attn_func         exact attention by all-to-all over heads (ulysses.py)
  ulysses_flash_attn_varlen_func  the same on a packed batch's shards

The ring's arithmetic runs without a group too: steps.simulate_forward / simulate_backward compute every rank's
results in one process, as the ring would.
"""

from .layout import CONTIGUOUS, LAYOUTS, ZIGZAG, shard, shard_varlen, unshard, unshard_varlen
from .ring import ring_flash_attn_func, ring_flash_attn_varlen_func
from .ulysses import ulysses_flash_attn_func, ulysses_flash_attn_varlen_func

__all__ = [
    "CONTIGUOUS",
    "LAYOUTS",
    "ZIGZAG",
    "ring_flash_attn_func",
    "ring_flash_attn_varlen_func",
    "shard",
    "shard_varlen",
    "ulysses_flash_attn_func",
    "ulysses_flash_attn_varlen_func",
    "unshard",
    "unshard_varlen",
]
