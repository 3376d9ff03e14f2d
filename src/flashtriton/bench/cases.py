"""A case of the paper sweep, the users suite or the decode suite, a provider's result on it, the FLOP count and the
ratios to our results."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MODES = ("fwd", "bwd", "fwd_bwd")
OURS = "flashtriton"


def attention_flops(batch, heads, n_q, n_k, head_dim, causal, mode) -> float:
    fwd = 4.0 * batch * heads * n_q * n_k * head_dim * (0.5 if causal else 1.0)
    return fwd * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]


@dataclass(frozen=True)
class Case:
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    causal: bool
    dtype: str = "bfloat16"

    @property
    def name(self) -> str:
        return f"d{self.head_dim}{'-causal' if self.causal else ''}-n{self.seqlen}"

    def flops(self, mode: str) -> float:
        return attention_flops(self.batch, self.heads, self.seqlen, self.seqlen, self.head_dim, self.causal, mode)


@dataclass(frozen=True)
class UserCase:
    """A case of the users suite (users.py): a shape, how its inputs are laid out, what is measured and by whom.

    layout "model": q, k, v are (B, N, H, D) views of (B, H, N, D) storage, as transformers hands them over;
    "contiguous": (B, N, H, D) tensors. documents: the lengths of a packed batch (summing to seqlen, batch 1),
    each attending within itself. measure "time": device ms per call; "host": wall ms per call over many calls
    and one synchronize; "memory": the allocator's peak in one fwd+bwd, not timed."""

    group: str
    batch: int
    seqlen: int
    heads: int
    heads_k: int
    head_dim: int
    causal: bool
    modes: tuple[str, ...]
    providers: tuple[str, ...]
    layout: str = "contiguous"
    documents: tuple[int, ...] = ()
    measure: str = "time"
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:  # read back from JSON, the tuples are lists
        for name in ("modes", "providers", "documents"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def name(self) -> str:
        heads = f"h{self.heads}" + (f"/{self.heads_k}" if self.heads_k != self.heads else "")
        start = f"docs{len(self.documents)}" if self.documents else f"b{self.batch}"
        tail = ("-causal" if self.causal else "") + ("-model" if self.layout == "model" else "")
        tail += "" if self.measure == "time" else f"-{self.measure}"  # a host or memory case shares a time case's shape
        return f"{start}-n{self.seqlen}-{heads}-d{self.head_dim}{tail}"

    def flops(self, mode: str) -> float:
        lengths = self.documents or (self.seqlen,) * self.batch
        return sum(attention_flops(1, self.heads, n, n, self.head_dim, self.causal, mode) for n in lengths)


@dataclass(frozen=True)
class DecodeCase:
    """A case of the decode suite (decode.py): seqlen_q queries of each of ``batch`` sequences against cache_len cache
    rows, all of them attended (cache_seqlens = cache_len, nothing appended): a pure read of K and V.

    page_size 0: a contiguous (batch, cache_len, heads_k, head_dim) cache; otherwise pages of page_size rows, each
    sequence's in a shuffled block table. causal: aligned bottom-right (the last query sees the whole cache), as
    speculative decoding's draft tokens."""

    batch: int
    cache_len: int
    heads: int
    heads_k: int
    head_dim: int
    seqlen_q: int
    causal: bool
    page_size: int
    providers: tuple[str, ...]
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:  # read back from JSON, the tuple is a list
        object.__setattr__(self, "providers", tuple(self.providers))

    @property
    def layout(self) -> str:
        return f"page{self.page_size}" if self.page_size else "contiguous"

    @property
    def name(self) -> str:
        shape = f"b{self.batch}-l{self.cache_len}-h{self.heads}/{self.heads_k}-d{self.head_dim}"
        return f"{shape}-q{self.seqlen_q}{'-causal' if self.causal else ''}-{self.layout}"

    @property
    def kv_bytes(self) -> int:
        """The bytes of K and V that one call reads: every sequence's attended rows, in the cache's dtype."""
        return 2 * self.batch * self.cache_len * self.heads_k * self.head_dim * getattr(torch, self.dtype).itemsize

    def flops(self, mode: str = "fwd") -> float:
        """The forward's FLOPs, every query against every row (a causal query misses at most seqlen_q - 1)."""
        return attention_flops(self.batch, self.heads, self.seqlen_q, self.cache_len, self.head_dim, False, "fwd")


CASE_TYPES = {"paper": Case, "users": UserCase, "decode": DecodeCase}  # results.json's sweep.suite -> its records


@dataclass
class Result:
    case: Case | UserCase | DecodeCase
    provider: str
    ms: dict[str, float] = field(default_factory=dict)
    ms_rounds: dict[str, list[float]] = field(default_factory=dict)
    tflops: dict[str, float] = field(default_factory=dict)
    tb_per_s: dict[str, float] = field(default_factory=dict)
    ratios: dict[str, dict[str, float]] = field(default_factory=dict)
    peak_extra_mib: float | None = None
    max_error: float | None = None
    first_call_s: float | None = None
    unavailable: str | None = None


def attach_ratios(results: list[Result]) -> None:
    """ratios[peer][mode] = peer ms / our ms on each of our results, for every peer measured on its case."""
    by_case: dict[Case, list[Result]] = {}
    for r in results:
        by_case.setdefault(r.case, []).append(r)
    for r in results:
        if r.provider != OURS:
            continue
        r.ratios = {
            peer.provider: {m: peer.ms[m] / r.ms[m] for m in r.ms if m in peer.ms}
            for peer in by_case[r.case]
            if peer.provider != OURS and peer.ms
        }
