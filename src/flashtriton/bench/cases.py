"""A case of the sweep, a provider's result on it, the FLOP count and the ratios to our results."""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass
class Result:
    case: Case
    provider: str
    ms: dict[str, float] = field(default_factory=dict)
    ms_rounds: dict[str, list[float]] = field(default_factory=dict)
    tflops: dict[str, float] = field(default_factory=dict)
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
