"""What the users suite's providers run on a case (users.py lists the cases): each one's inputs laid out as it takes
them, its forward, and for fwd_bwd the leaves and the output's gradient; the trial that measures them; the ratios."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..interface import flash_attn_func, flash_attn_varlen_func
from .cases import OURS, Result, UserCase, attach_ratios
from .providers import compiled_flex
from .results import DEFINITIONS
from .timing import Trial, device_timer, forward_error, host_timer, peak_extra_mib, run_trials

ERROR_ROWS = 512  # queries checked against the fp32 reference: a 128k-token case's N x N scores would not fit

USERS_DEFINITIONS = {  # results.json's fields where the users suite's differ from the paper sweep's
    **DEFINITIONS,
    "case": "a users-suite case (flashtriton.bench.users): its group, shape, layout ('model': (B, N, H, D) views of "
    "(B, H, N, D) storage), documents (a packed batch's lengths), what is measured, modes and providers",
    "ms": "time cases: as the paper sweep's; host cases: wall milliseconds per call over blocks of calls with one "
    "synchronize after each block, the median block; fwd_bwd takes fresh gradients (torch.autograd.grad)",
    "ratios": f"{OURS} rows only: ratios[peer][mode] = peer ms / {OURS} ms, and on memory cases "
    f"ratios[peer]['peak_extra_mib'] = peer MiB / {OURS} MiB (> 1: {OURS} is faster or smaller)",
    "peak_extra_mib": "allocator peak during one fwd_bwd beyond what was allocated before it, the output and the "
    "fresh gradients included (CUDA only)",
    "max_error": f"max abs difference of the forward output from an fp32 reference, first (batch, head), last "
    f"{ERROR_ROWS} queries (packed documents: of the first document)",
}


@dataclass
class Calls:
    """A provider's calls on one case: fwd() -> its output; fwd_bwd differentiates ``leaves`` by ``dout``;
    bnhd(out) is the output as (B, N, H, D), for the error check."""

    fwd: Callable[[], torch.Tensor]
    leaves: tuple[torch.Tensor, ...]
    dout: torch.Tensor
    bnhd: Callable[[torch.Tensor], torch.Tensor]


def _same(out: torch.Tensor) -> torch.Tensor:
    return out


def _transposed(out: torch.Tensor) -> torch.Tensor:
    return out.transpose(1, 2)


def _inputs(case: UserCase, device: torch.device) -> list[torch.Tensor]:
    """q, k, v (B, N, H or H_KV, D) and the output's gradient (B, N, H, D): seeded, the same for every provider."""
    generator = torch.Generator(device).manual_seed(0)
    dtype = getattr(torch, case.dtype)
    shapes = [(case.batch, case.seqlen, h, case.head_dim) for h in (case.heads, case.heads_k, case.heads_k, case.heads)]
    return [torch.randn(s, generator=generator, device=device, dtype=dtype) for s in shapes]


def _bhnd_copies(q, k, v) -> tuple[torch.Tensor, ...]:
    return tuple(x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))


def _our_tensors(case: UserCase, q, k, v) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(leaves, what flash_attn_func is given): a model's (B, H, N, D) storage and its (B, N, H, D) views, or
    (B, N, H, D) tensors as both."""
    if case.layout == "model":
        leaves = _bhnd_copies(q, k, v)
        return leaves, tuple(x.transpose(1, 2) for x in leaves)
    leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))
    return leaves, leaves


def _ours(case: UserCase, q, k, v, dout) -> Calls:
    if case.documents:
        leaves = tuple(x[0].detach().requires_grad_() for x in (q, k, v))  # packed (total, H, D), as callers hold
        cu_seqlens = torch.tensor((0, *itertools.accumulate(case.documents)), dtype=torch.int32, device=q.device)
        longest = max(case.documents)

        def packed():
            return flash_attn_varlen_func(*leaves, cu_seqlens, cu_seqlens, longest, longest, causal=case.causal)

        return Calls(packed, leaves, dout[0], lambda out: out.unsqueeze(0))
    leaves, given = _our_tensors(case, q, k, v)
    return Calls(lambda: flash_attn_func(*given, causal=case.causal), leaves, dout, _same)


def _sdpa_call(backend: str | None, qkv, case: UserCase) -> Callable[[], torch.Tensor]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = case.heads != case.heads_k

    def fwd():
        with sdpa_kernel(getattr(SDPBackend, backend)) if backend else contextlib.nullcontext():
            return F.scaled_dot_product_attention(*qkv, is_causal=case.causal, enable_gqa=gqa)

    return fwd


def _sdpa(backend: str | None):
    """SDPA, pinned to ``backend`` (None: its own choice), on contiguous (B, H, N, D) copies: its best ordinary
    setup."""

    def make(case: UserCase, q, k, v, dout) -> Calls:
        leaves = _bhnd_copies(q, k, v)
        return Calls(_sdpa_call(backend, leaves, case), leaves, dout.transpose(1, 2).contiguous(), _transposed)

    return make


def _sdpa_on_ours(case: UserCase, q, k, v, dout) -> Calls:
    """cuDNN SDPA on flashtriton's own tensors seen as (B, H, N, D): in the model layout, the storage itself."""
    leaves, given = _our_tensors(case, q, k, v)
    seen = tuple(x.transpose(1, 2) for x in given)
    return Calls(_sdpa_call("CUDNN_ATTENTION", seen, case), leaves, dout.transpose(1, 2), _transposed)


def _flex(case: UserCase, q, k, v, dout) -> Calls:
    """FlexAttention compiled for the shape, on contiguous (B, H, N, D) copies, with the case's block mask (built
    once, outside the timed calls)."""
    from torch.nn.attention.flex_attention import create_block_mask

    leaves = _bhnd_copies(q, k, v)
    mask_mod = _document_causal(case.documents, q.device) if case.documents else _causal if case.causal else None
    n = case.seqlen
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, None, None, n, n, device=q.device)
    compiled, gqa = compiled_flex(), case.heads != case.heads_k
    fwd = lambda: compiled(*leaves, block_mask=block_mask, enable_gqa=gqa)
    return Calls(fwd, leaves, dout.transpose(1, 2).contiguous(), _transposed)


def _causal(b, h, i, j):
    return j <= i


def _document_causal(documents: tuple[int, ...], device):
    ids = torch.repeat_interleave(torch.arange(len(documents), device=device), torch.tensor(documents, device=device))

    def mask(b, h, i, j):
        return (ids[i] == ids[j]) & (j <= i)

    return mask


USERS_PROVIDERS: dict[str, Callable[..., Calls]] = {
    OURS: _ours,
    "sdpa": _sdpa(None),
    "sdpa-cudnn": _sdpa("CUDNN_ATTENTION"),
    "sdpa-cudnn-view": _sdpa_on_ours,
    "flex": _flex,
}
USERS_GPU_ONLY = {"sdpa-cudnn", "sdpa-cudnn-view", "flex"}


class UserTrial(Trial):
    """A Trial on a users-suite case: the provider's own inputs (a model's layout, packed documents), fwd_bwd by
    torch.autograd.grad, the error on the last ERROR_ROWS queries."""

    gpu_only = USERS_GPU_ONLY

    def _first_call(self) -> None:
        case, device, result = self.result.case, self.device, self.result
        q, k, v, dout = _inputs(case, device)
        calls = USERS_PROVIDERS[result.provider](case, q, k, v, dout)
        self.fwd, self.leaves, self.grad = calls.fwd, calls.leaves, calls.dout
        start = time.perf_counter()
        out = self.fwd()
        torch.autograd.grad(out, self.leaves, self.grad)
        if device.type == "cuda":
            torch.cuda.synchronize()
        result.first_call_s = time.perf_counter() - start
        span = case.documents[0] if case.documents else case.seqlen
        out, q, k, v = (x[:, :span] for x in (calls.bnhd(out), q, k, v))
        result.max_error = forward_error(out, q, k, v, case.causal, ERROR_ROWS)
        del out, q, k, v, dout, calls
        result.peak_extra_mib = peak_extra_mib(self.call("fwd_bwd"), device)

    def call(self, mode: str) -> Callable:
        fwd, leaves, dout = self.fwd, self.leaves, self.grad
        if mode == "fwd":
            return torch.no_grad()(fwd)
        assert mode == "fwd_bwd", mode
        return lambda: torch.autograd.grad(fwd(), leaves, dout)

    def _drop(self) -> None:
        super()._drop()
        self.leaves = None

    def rates(self) -> None:
        if self.result.case.measure != "host":  # wall time per call is not the kernels'
            super().rates()


def run_user_case(case: UserCase, providers, device: torch.device, rounds: int) -> list[Result]:
    """Every provider on one users-suite case: time cases on the device timer, host cases on the host timer,
    memory cases by their first calls only."""
    trials = [UserTrial(Result(case, p), device) for p in providers]
    modes = () if case.measure == "memory" else case.modes
    time_all = host_timer(device) if case.measure == "host" else device_timer(device)
    return run_trials(trials, device, dict.fromkeys(modes, time_all), rounds)


def attach_users_ratios(results: list[Result]) -> None:
    """attach_ratios, and on memory cases ratios[peer]["peak_extra_mib"] = peer MiB / our MiB."""
    attach_ratios(results)
    for ours in results:
        if ours.provider != OURS or ours.case.measure != "memory" or not ours.peak_extra_mib:
            continue
        for peer in results:
            if peer.case == ours.case and peer.provider != OURS and peer.peak_extra_mib is not None:
                ours.ratios.setdefault(peer.provider, {})["peak_extra_mib"] = peer.peak_extra_mib / ours.peak_extra_mib
