"""Block-sparse attention masks: for each query tile, the key tiles to visit.

Notation
  Nq, Nk     seqlen_q, seqlen_k
  BM, BN     block_size: query rows and key columns of one tile (multiples of 16)
  Mq, Mk     cdiv(Nq, BM), cdiv(Nk, BN): tiles along each sequence
  Bm, Hm     the mask's batch and head dims: 1 (the same mask for every batch / head; kernels
             read it with stride 0) or the batch size / number of query heads

Tile (m, n) of batch b, head h covers queries [m*BM, (m+1)*BM) and keys [n*BN, (n+1)*BN), cut
at Nq and Nk. Looking only at its pairs inside the sequences, a tile is
  empty     no pair visible: never visited
  full      every pair visible: visited without the element mask
  partial   otherwise: visited, with mask_mod applied elementwise
(the ragged ends of the sequences stay the kernels' own bounds masking).

Fields (int32, contiguous, on the mask's device):
  kv_num_blocks       (Bm, Hm, Mq)      partial key tiles of each query tile
  kv_indices          (Bm, Hm, Mq, Mk)  their key-tile indices, ascending in [..., :kv_num_blocks], then padding
  full_kv_num_blocks  (Bm, Hm, Mq)      the same for full key tiles; None (with full_kv_indices) when no tile is full
  full_kv_indices     (Bm, Hm, Mq, Mk)
  q_num_blocks        (Bm, Hm, Mk)      transposed, for the backward's dK/dV pass: partial query tiles of each key tile
  q_indices           (Bm, Hm, Mk, Mq)
  full_q_num_blocks   (Bm, Hm, Mk)      full query tiles of each key tile; None exactly when full_kv_num_blocks is
  full_q_indices      (Bm, Hm, Mk, Mq)
The padding after the counts is unspecified (in practice the unlisted tiles, ascending).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton

from .mods import Mod, as_mod, evaluate_mask
from .validation import host_read, host_read_cached

DEFAULT_BLOCK_SIZE = (128, 128)
BLOCK_SIZE_MULTIPLE = 16  # tl.dot needs tiles of at least 16 x 16
CHUNK_ELEMENTS = 1 << 24  # mask elements create_block_mask evaluates at once: 64 MiB per int32 temporary


def _check_positive_int(what: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{what} must be >= 1, got {value}")
    return value


def _check_block_size(block_size: int | tuple[int, int]) -> tuple[int, int]:
    sizes = (block_size, block_size) if isinstance(block_size, int) else block_size
    if not isinstance(sizes, (tuple, list)) or len(sizes) != 2:
        raise TypeError(f"block_size must be an int or a pair (BM, BN) of ints, got {block_size!r}")
    for what, size in zip(("query", "key"), sizes, strict=True):
        _check_positive_int(f"block_size ({what} tile)", size)
        if size % BLOCK_SIZE_MULTIPLE:
            raise ValueError(f"block_size ({what} tile) {size} is not a multiple of {BLOCK_SIZE_MULTIPLE}: round it")
    return tuple(sizes)


def _check_optional_dim(what: str, value: int | None) -> int:
    """batch / heads: None means 1 (broadcast)."""
    return 1 if value is None else _check_positive_int(what, value)


def _broadcast_factor(stored: int, given: int | None, what: str) -> int:
    """How many times a mask dim of size ``stored`` repeats to cover ``given`` (None: as stored)."""
    if given is None or given == stored:
        return 1
    if stored == 1:
        return given
    raise ValueError(f"the block mask has {what} {stored}, not 1 or {given}: make it for {what} {given}")


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _tile_lists(layout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., M, N) bool -> counts (..., M) and the listed column indices (..., M, N), ascending first."""
    counts = layout.sum(-1, dtype=torch.int32)
    # stable sort puts the listed tiles first, each group in ascending order
    indices = torch.sort(layout.to(torch.int8), dim=-1, descending=True, stable=True).indices
    return counts.contiguous(), indices.to(torch.int32).contiguous()


def _tile_layout(counts: torch.Tensor | None, indices: torch.Tensor | None, shape: tuple[int, ...], device):
    """Inverse of _tile_lists: the (..., M, N) bool layout (all False for None)."""
    if counts is None:
        return torch.zeros(shape, dtype=torch.bool, device=device)
    n = shape[-1]
    listed = torch.arange(indices.shape[-1], device=device) < counts[..., None]
    target = torch.where(listed, indices.long(), n)  # padding goes to a spare column
    layout = torch.zeros((*shape[:-1], n + 1), dtype=torch.bool, device=device)
    return layout.scatter_(-1, target, True)[..., :n]


@dataclass(frozen=True, eq=False)
class BlockMask:
    """Which tiles attention visits, and where the element mask applies (see the module docstring for fields).

    Make one with ``create_block_mask`` (from a mask_mod) or ``BlockMask.from_layout`` (from a block
    layout). The kernels read the tile lists; the PyTorch path and the reference use ``element_mask``.
    """

    seqlen_q: int
    seqlen_k: int
    block_size: tuple[int, int]
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor | None
    full_kv_indices: torch.Tensor | None
    q_num_blocks: torch.Tensor
    q_indices: torch.Tensor
    full_q_num_blocks: torch.Tensor | None
    full_q_indices: torch.Tensor | None
    mask_mod: Mod | None = None

    def __post_init__(self):
        _check_positive_int("seqlen_q", self.seqlen_q)
        _check_positive_int("seqlen_k", self.seqlen_k)
        object.__setattr__(self, "block_size", _check_block_size(self.block_size))
        if self.mask_mod is not None:
            object.__setattr__(self, "mask_mod", as_mod(self.mask_mod, "mask_mod"))
        self._check_lists()

    def _check_lists(self):
        if not isinstance(self.kv_num_blocks, torch.Tensor) or self.kv_num_blocks.dim() != 3:
            raise ValueError("BlockMask.kv_num_blocks must be an int32 tensor of shape (Bm, Hm, Mq)")
        bm, hm = self.kv_num_blocks.shape[:2]
        mq, mk = self.num_tiles
        expected = {
            "kv_num_blocks": (bm, hm, mq), "kv_indices": (bm, hm, mq, mk),
            "full_kv_num_blocks": (bm, hm, mq), "full_kv_indices": (bm, hm, mq, mk),
            "q_num_blocks": (bm, hm, mk), "q_indices": (bm, hm, mk, mq),
            "full_q_num_blocks": (bm, hm, mk), "full_q_indices": (bm, hm, mk, mq),
        }  # fmt: skip
        for name, shape in expected.items():
            t = getattr(self, name)
            if t is None and name.startswith("full_"):
                continue
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != shape:
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"BlockMask.{name} must be an int32 tensor of shape {shape} (Bm, Hm, ...), got {got}")
            if not t.is_contiguous() or t.device != self.kv_num_blocks.device:
                raise ValueError(f"BlockMask.{name} must be contiguous and on the device of kv_num_blocks")
        if (self.full_kv_num_blocks is None) != (self.full_q_num_blocks is None) or any(
            (getattr(self, f"full_{s}_num_blocks") is None) != (getattr(self, f"full_{s}_indices") is None)
            for s in ("kv", "q")
        ):
            raise ValueError("BlockMask: the four full_* lists must be all tensors or all None")
        if self.mask_mod is None and bool(self.kv_num_blocks.any()):
            raise ValueError("BlockMask lists partial tiles but has no mask_mod to apply to them")

    @classmethod
    def from_layout(
        cls,
        layout: torch.Tensor,
        block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
        *,
        seqlen_q: int,
        seqlen_k: int,
        mask_mod: Mod | Any | None = None,
    ) -> BlockMask:
        """A block mask visiting the tiles where ``layout`` is True.

        layout: (Bm, Hm, cdiv(seqlen_q, BM), cdiv(seqlen_k, BN)) bool. Without ``mask_mod`` every
        listed tile is full (whole tiles attend); with one, every listed tile is partial and
        ``mask_mod`` decides each pair inside it.
        """
        block_size = _check_block_size(block_size)
        _check_positive_int("seqlen_q", seqlen_q)
        _check_positive_int("seqlen_k", seqlen_k)
        if not isinstance(layout, torch.Tensor):
            raise TypeError(f"layout must be a torch.Tensor of bools, got {type(layout).__name__}")
        if layout.dtype != torch.bool:
            raise TypeError(f"layout must be a bool tensor, got {layout.dtype}: pass layout.bool()")
        tiles = (triton.cdiv(seqlen_q, block_size[0]), triton.cdiv(seqlen_k, block_size[1]))
        if layout.dim() != 4 or tuple(layout.shape[2:]) != tiles:
            raise ValueError(
                f"layout must have shape (Bm, Hm, {tiles[0]}, {tiles[1]}) for seqlen_q={seqlen_q}, "
                f"seqlen_k={seqlen_k} and block_size={block_size}, got {tuple(layout.shape)} "
                "(add broadcast dims with layout[None, None])"
            )
        if 0 in layout.shape[:2]:
            raise ValueError(f"layout's batch and head dims must be >= 1, got {tuple(layout.shape)}")
        empty = torch.zeros_like(layout)
        if mask_mod is None:
            return _from_tiles(empty, layout, seqlen_q, seqlen_k, block_size, None)
        return _from_tiles(layout, None, seqlen_q, seqlen_k, block_size, as_mod(mask_mod, "mask_mod"))

    # -- description ------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(Bm, Hm, seqlen_q, seqlen_k)."""
        return (*self.kv_num_blocks.shape[:2], self.seqlen_q, self.seqlen_k)

    @property
    def num_tiles(self) -> tuple[int, int]:
        """(Mq, Mk): query and key tiles."""
        return triton.cdiv(self.seqlen_q, self.block_size[0]), triton.cdiv(self.seqlen_k, self.block_size[1])

    @property
    def device(self) -> torch.device:
        return self.kv_num_blocks.device

    def to(self, device: torch.device | str) -> BlockMask:
        """The same mask (tile lists and mask_mod tensors) on ``device``."""
        lists = {name: getattr(self, name) for name in LIST_FIELDS}
        moved = {name: None if t is None else t.to(device) for name, t in lists.items()}
        mask_mod = None if self.mask_mod is None else self.mask_mod.to(device)
        return BlockMask(self.seqlen_q, self.seqlen_k, self.block_size, **moved, mask_mod=mask_mod)

    def partial_layout(self) -> torch.Tensor:
        """(Bm, Hm, Mq, Mk) bool: the partial tiles."""
        return _tile_layout(self.kv_num_blocks, self.kv_indices, self._layout_shape, self.device)

    def full_layout(self) -> torch.Tensor:
        """(Bm, Hm, Mq, Mk) bool: the full tiles."""
        return _tile_layout(self.full_kv_num_blocks, self.full_kv_indices, self._layout_shape, self.device)

    def to_dense(self) -> torch.Tensor:
        """(Bm, Hm, Mq, Mk) bool: the tiles visited (partial or full)."""
        return self.partial_layout() | self.full_layout()

    @property
    def _layout_shape(self) -> tuple[int, int, int, int]:
        return (*self.kv_num_blocks.shape[:2], *self.num_tiles)

    def density(self) -> float:
        """Fraction of tiles visited, in [0, 1]."""
        return self.to_dense().float().mean().item()

    def mean_span(self) -> int:
        """About how many keys a query row visits: listed tiles per query tile, averaged over the
        mask, times the tile width (at most seqlen_k). A launch-config hint, read to the host once
        per mask (validation.host_read); while a CUDA graph is being captured an unread mask
        answers seqlen_k (the long-span configs) rather than synchronise.
        """
        key = ("mean_span", self.block_size, self.seqlen_k, id(self.full_kv_num_blocks))
        counts = self.kv_num_blocks
        if counts.is_cuda and torch.cuda.is_current_stream_capturing():
            found, value = host_read_cached(counts, key)
            return value if found else self.seqlen_k

        def read(counts: torch.Tensor) -> int:
            tiles = counts.sum() + (self.full_kv_num_blocks.sum() if self.full_kv_num_blocks is not None else 0)
            return min(self.seqlen_k, round(tiles.item() / max(counts.numel(), 1) * self.block_size[1]))

        return host_read(counts, key, read)

    def sparsity(self) -> float:
        """Fraction of tiles skipped, in [0, 1]: 1 - density()."""
        return 1.0 - self.density()

    def visited_pairs(self, batch: int | None = None, heads: int | None = None) -> int:
        """(q, kv) pairs inside visited tiles (cut at the sequence ends), summed over batch and heads.

        The work the kernels do: forward FLOPs = 4 * headdim * visited_pairs(batch, heads).
        Broadcast dims (Bm or Hm = 1) count ``batch`` / ``heads`` times.
        """
        factor = _broadcast_factor(self.shape[0], batch, "batch") * _broadcast_factor(self.shape[1], heads, "heads")
        (bm, bn), (mq, mk) = self.block_size, self.num_tiles
        rows = (self.seqlen_q - bm * torch.arange(mq, device=self.device)).clamp(max=bm)
        cols = (self.seqlen_k - bn * torch.arange(mk, device=self.device)).clamp(max=bn)
        pairs = (self.to_dense().long() * rows[:, None] * cols[None, :]).sum().item()
        return int(pairs) * factor

    def element_mask(self, q_idx=None, kv_idx=None, b=None, h=None) -> torch.Tensor:
        """Which (q, kv) pairs attention sees: the visited tiles, with mask_mod applied in partial ones.

        q_idx, kv_idx: 1-D query / key indices (default: all, 0..seqlen-1); b, h: 1-D batch / head
        indices or ints (default: 0..Bm-1 and 0..Hm-1; a broadcast dim serves any index, and
        mask_mod gets the index given, as in the kernels). Returns (len(b), len(h), len(q_idx),
        len(kv_idx)) bool. Materialises that many elements: for the reference and small inputs.
        """
        device = self.device
        q = torch.arange(self.seqlen_q, device=device) if q_idx is None else torch.as_tensor(q_idx, device=device)
        kv = torch.arange(self.seqlen_k, device=device) if kv_idx is None else torch.as_tensor(kv_idx, device=device)
        bs = torch.arange(self.shape[0], device=device) if b is None else torch.as_tensor(b, device=device)
        hs = torch.arange(self.shape[1], device=device) if h is None else torch.as_tensor(h, device=device)
        q, kv, bs, hs = (x.long().reshape(-1) for x in (q, kv, bs, hs))
        self._check_indices(q, kv, bs, hs)
        # the layout rows that serve these indices: a broadcast dim has only row 0
        tile = (
            (bs if self.shape[0] > 1 else torch.zeros_like(bs))[:, None, None, None],
            (hs if self.shape[1] > 1 else torch.zeros_like(hs))[None, :, None, None],
            (q // self.block_size[0])[None, None, :, None],
            (kv // self.block_size[1])[None, None, None, :],
        )
        visible = self.full_layout()[tile]
        if self.mask_mod is not None:
            partial = self.partial_layout()[tile]
            elements = evaluate_mask(self.mask_mod, bs[:, None, None, None], hs[None, :, None, None], q[:, None], kv)
            visible = visible | (partial & elements)
        return visible

    def _check_indices(self, q, kv, b, h):
        for what, idx, bound in (("q_idx", q, self.seqlen_q), ("kv_idx", kv, self.seqlen_k)):
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= bound):
                raise ValueError(f"element_mask: {what} must be in [0, {bound})")
        for what, idx, stored in (("b", b, self.shape[0]), ("h", h, self.shape[1])):
            if idx.numel() and (int(idx.min()) < 0 or (stored > 1 and int(idx.max()) >= stored)):
                raise ValueError(f"element_mask: {what} must be in [0, {stored})")

    def check_matches(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int, device: torch.device) -> None:
        """Raise ValueError, saying the fix, unless this mask serves q (batch, seqlen_q, heads, .) on ``device``."""
        if (self.seqlen_q, self.seqlen_k) != (seqlen_q, seqlen_k):
            raise ValueError(
                f"block_mask was made for seqlen_q={self.seqlen_q}, seqlen_k={self.seqlen_k}, but the inputs have "
                f"seqlen_q={seqlen_q}, seqlen_k={seqlen_k}: make it with those lengths"
            )
        _broadcast_factor(self.shape[0], batch, "batch")
        _broadcast_factor(self.shape[1], heads, "heads")
        devices = [self.device, *(t.device for t in (self.mask_mod.tensors if self.mask_mod is not None else ()))]
        if not all(_same_device(d, torch.device(device)) for d in devices):
            raise ValueError(f"block_mask is on {self.device}, the inputs on {device}: pass block_mask.to(device)")

    def __repr__(self) -> str:
        full = "none" if self.full_kv_num_blocks is None else int(self.full_kv_num_blocks.sum())
        mask_mod = "None" if self.mask_mod is None else self.mask_mod.name
        return (
            f"BlockMask(shape={self.shape}, block_size={self.block_size}, density={self.density():.3f}, "
            f"partial_tiles={int(self.kv_num_blocks.sum())}, full_tiles={full}, mask_mod={mask_mod})"
        )


LIST_FIELDS = (
    "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
    "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices",
)  # fmt: skip


def _from_tiles(
    partial: torch.Tensor,
    full: torch.Tensor | None,
    seqlen_q: int,
    seqlen_k: int,
    block_size: tuple[int, int],
    mask_mod: Mod | None,
) -> BlockMask:
    """A BlockMask from (Bm, Hm, Mq, Mk) bool layouts of partial and full tiles (full None: no full tile)."""
    kv_num_blocks, kv_indices = _tile_lists(partial)
    q_num_blocks, q_indices = _tile_lists(partial.transpose(-1, -2))
    full_lists = (None, None, None, None)
    if full is not None:
        full_lists = (*_tile_lists(full), *_tile_lists(full.transpose(-1, -2)))
    full_kv_num_blocks, full_kv_indices, full_q_num_blocks, full_q_indices = full_lists
    return BlockMask(
        seqlen_q, seqlen_k, block_size,
        kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
        q_num_blocks, q_indices, full_q_num_blocks, full_q_indices,
        mask_mod,
    )  # fmt: skip


def _classify_tiles(
    mod: Mod, bm: int, hm: int, seqlen_q: int, seqlen_k: int, block_size: tuple[int, int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Bm, Hm, Mq, Mk) bool layouts of the partial and the full tiles of ``mod``.

    Evaluates the mask a chunk of (b, h, query tile) rows at a time, each against every key, so at
    most about CHUNK_ELEMENTS mask elements exist at once. Indices past a sequence end repeat its
    last index, which leaves every tile's any / all unchanged.
    """
    (block_m, block_n), mq, mk = block_size, triton.cdiv(seqlen_q, block_size[0]), triton.cdiv(seqlen_k, block_size[1])
    kv = torch.arange(mk * block_n, device=device).clamp(max=seqlen_k - 1)
    rows = torch.arange(block_m, device=device)
    tiles_per_chunk = max(1, CHUNK_ELEMENTS // (block_m * mk * block_n))
    total = bm * hm * mq
    some = torch.empty(total, mk, dtype=torch.bool, device=device)
    every = torch.empty(total, mk, dtype=torch.bool, device=device)
    for start in range(0, total, tiles_per_chunk):
        stop = min(start + tiles_per_chunk, total)
        t = torch.arange(start, stop, device=device)  # flat (b, h, query tile)
        b, h, m = t // (hm * mq), t // mq % hm, t % mq
        q = (m[:, None] * block_m + rows).clamp(max=seqlen_q - 1)
        visible = evaluate_mask(mod, b[:, None, None], h[:, None, None], q[:, :, None], kv[None, None, :])
        visible = visible.expand(stop - start, block_m, mk * block_n).reshape(stop - start, block_m, mk, block_n)
        some[start:stop] = visible.any(dim=3).any(dim=1)
        every[start:stop] = visible.all(dim=3).all(dim=1)
    some, every = (x.view(bm, hm, mq, mk) for x in (some, every))
    return some & ~every, every


def mask_dims(mask_mod: Mod | Any, batch: int, heads: int, device: torch.device) -> tuple[int | None, int | None]:
    """create_block_mask's batch and heads for a mask_mod on inputs of that batch and heads: each dim the mask reads
    (b, h), None for the others. Evaluated with b and h as two values along dims of their own, the mask's result is a
    broadcast view (stride 0) along every dim it does not read."""
    mod = as_mod(mask_mod, "mask_mod").to(device)
    b, h = (torch.arange(min(n, 2), dtype=torch.int32, device=device) for n in (batch, heads))
    zero = torch.zeros((), dtype=torch.int32, device=device)
    visible = evaluate_mask(mod, b.view(-1, 1), h.view(1, -1), zero, zero)
    return tuple(n if visible.shape[d] > 1 and visible.stride(d) != 0 else None for d, n in enumerate((batch, heads)))


def create_block_mask(
    mask_mod: Mod | Any,
    batch: int | None,
    heads: int | None,
    seqlen_q: int,
    seqlen_k: int,
    device: torch.device | str | None = None,
    block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
) -> BlockMask:
    """Evaluate ``mask_mod`` on every (b, h, q, kv) and keep the tiles it touches.

    mask_mod: a @triton.jit ``mask_mod(b, h, q_idx, kv_idx, *tensors)`` or a ``Mod``; evaluated
    with PyTorch on ``device`` (default: its tensors' device, else CUDA if available, else CPU),
    vectorised over chunks of tiles. batch / heads None: the mask is the same for every batch /
    head (evaluated at b = 0 / h = 0, stored with a dim of 1); pass None for every dim the mask
    does not depend on (on an H200 at 16k x 16k: 5 ms for one (b, h), 1 s for 16 x 16). Tiles
    where the mask is all False are skipped, all True are full, the rest partial. Returns a
    BlockMask on ``device``.
    """
    mod = as_mod(mask_mod, "mask_mod")
    bm, hm = _check_optional_dim("batch", batch), _check_optional_dim("heads", heads)
    _check_positive_int("seqlen_q", seqlen_q)
    _check_positive_int("seqlen_k", seqlen_k)
    block_size = _check_block_size(block_size)
    if device is None:
        device = mod.tensors[0].device if mod.tensors else "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    mod = mod.to(device)
    if torch.compiler.is_compiling():
        # the mask's values cannot steer a trace: every tile is partial (exact, no tile skipped); a BlockMask made
        # outside the compiled function keeps its skipping
        shape = (bm, hm, triton.cdiv(seqlen_q, block_size[0]), triton.cdiv(seqlen_k, block_size[1]))
        every_tile = torch.ones(shape, dtype=torch.bool, device=device)
        return _from_tiles(every_tile, None, seqlen_q, seqlen_k, block_size, mod)
    partial, full = _classify_tiles(mod, bm, hm, seqlen_q, seqlen_k, block_size, device)
    return _from_tiles(partial, full if bool(full.any()) else None, seqlen_q, seqlen_k, block_size, mod)
