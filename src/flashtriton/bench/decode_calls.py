"""What the decode suite's providers run on a case (decode.py lists the cases): the inputs, built once per case and
shared by its providers (a 128k-row cache is gigabytes: a copy per provider would not fit), each provider's call, the
trial that measures it (device and host time per call, bandwidth), and the definitions of its fields."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable
from functools import cached_property

import torch
import torch.nn.functional as F

from ..interface import flash_attn_with_kvcache
from .cases import OURS, DecodeCase, Result
from .providers import compiled_flex
from .results import DEFINITIONS
from .timing import Trial, device_timer, forward_error, host_timer, peak_extra_mib, run_trials

MODES = ("fwd", "host")  # device time, host time: each call the same forward
HOST_CALLS = 50  # calls per host-time block on a GPU: they queue without blocking, and a large cache's stay short

DECODE_DEFINITIONS = {  # results.json's fields where the decode suite's differ from the paper sweep's
    **DEFINITIONS,
    "case": "a decode-suite case (flashtriton.bench.decode): seqlen_q queries of each of batch sequences against "
    "cache_len cache rows, all attended (cache_seqlens = cache_len, nothing appended); heads query heads on heads_k "
    "K/V heads; page_size 0: a contiguous (batch, cache_len, heads_k, head_dim) cache, else pages of page_size rows "
    "in a shuffled block table; causal aligned bottom-right. Peers read contiguous (batch, heads_k, cache_len, "
    "head_dim) copies of the cache, paged cases too",
    "ms": "fwd: device milliseconds per call, as the paper sweep's but with L2 flushed by a read (a written flush's "
    "dirty lines would be written back during the call) and the GPU kept ahead of the host (a spin before each timed "
    "call, three times the longest host time of the calls: timing.TIMING_AHEAD), so that neither shows in the call's "
    "device time; host: wall milliseconds per call over blocks of "
    f"calls ({HOST_CALLS} on a GPU) with one synchronize after each block, the median block, the median over the "
    "rounds (the host's time per call where the device keeps up, else the device's)",
    "tb_per_s": "fwd: effective bandwidth in TB/s (1e12 bytes/s): the bytes of K and V of every sequence's attended "
    "cache rows in the cache's dtype, 2 * batch * cache_len * heads_k * head_dim * itemsize, / device time",
    "tflops": "not written: decoding is measured in bandwidth (tb_per_s)",
    "ratios": f"{OURS} rows only: ratios[peer][mode] = peer ms / {OURS} ms, mode fwd (device) and host (> 1: {OURS} "
    "is faster)",
    "peak_extra_mib": "allocator peak during one call beyond what was allocated before it (CUDA only): the output "
    "and any scratch (split-KV partials)",
    "max_error": "max abs difference of the output from an fp32 reference on the cache, first (batch, head), every "
    "query",
    "first_call_s": "wall seconds of the provider's first call on the case, compile included (Triton, "
    "FlexAttention's Inductor, a cuDNN plan) when not yet done in this process",
    "sweep.skipped": "cases of the table not run, each with why (K and V held over sweep.memory_budget_bytes)",
}


class DecodeInputs:
    """A case's inputs, each built on first use and then shared: q (B, N_Q, H, D); the cache as flash_attn_with_kvcache
    takes it; the peers' q (B, H, N_Q, D) and dense (B, H_KV, L, D) copies of the cache. Random, seeded per case."""

    def __init__(self, case: DecodeCase, device: torch.device):
        self.case, self.device = case, device
        self.generator = torch.Generator(device).manual_seed(0)

    def _randn(self, *shape: int) -> torch.Tensor:
        dtype = getattr(torch, self.case.dtype)
        return torch.randn(shape, generator=self.generator, device=self.device, dtype=dtype)

    @cached_property
    def q(self) -> torch.Tensor:
        c = self.case
        return self._randn(c.batch, c.seqlen_q, c.heads, c.head_dim)

    @cached_property
    def cache(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(k_cache, v_cache, block_table): (B, L, H_KV, D) and None, or pages (B * L / page_size, page_size, H_KV,
        D) and each sequence's pages (B, L / page_size) int32, a random permutation of them all."""
        c = self.case
        if not c.page_size:
            return *(self._randn(c.batch, c.cache_len, c.heads_k, c.head_dim) for _ in range(2)), None
        pages = c.batch * c.cache_len // c.page_size
        k, v = (self._randn(pages, c.page_size, c.heads_k, c.head_dim) for _ in range(2))
        order = torch.randperm(pages, generator=self.generator, device=self.device)
        return k, v, order.view(c.batch, -1).to(torch.int32)

    def sequence(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence b's keys and values (L, H_KV, D), gathered from its pages."""
        k, v, block_table = self.cache
        if block_table is None:
            return k[b], v[b]
        pages = block_table[b].long()
        return k[pages].flatten(0, 1), v[pages].flatten(0, 1)

    @cached_property
    def dense(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The peers' q (B, H, N_Q, D), k and v (B, H_KV, L, D): contiguous copies, a sequence at a time."""
        c = self.case
        shape, dtype = (c.batch, c.heads_k, c.cache_len, c.head_dim), getattr(torch, c.dtype)
        k, v = (torch.empty(shape, dtype=dtype, device=self.device) for _ in range(2))
        for b in range(c.batch):
            k_b, v_b = self.sequence(b)
            k[b], v[b] = k_b.transpose(0, 1), v_b.transpose(0, 1)
        return self.q.transpose(1, 2).contiguous(), k, v


def _bnhd(out: torch.Tensor) -> torch.Tensor:
    return out.transpose(1, 2)


def _same(out: torch.Tensor) -> torch.Tensor:
    return out


def _ours(case: DecodeCase, inputs: DecodeInputs):
    k_cache, v_cache, block_table = inputs.cache
    q, lengths = inputs.q, torch.full((case.batch,), case.cache_len, dtype=torch.int32, device=inputs.device)

    def fwd():
        return flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lengths, block_table=block_table, causal=case.causal
        )

    return fwd, _same


def _bottom_right_mask(case: DecodeCase, q: torch.Tensor) -> torch.Tensor:
    """An additive (1, 1, N_Q, L) mask, 0 where query i sees row j (j <= i + L - N_Q), -inf elsewhere: SDPA's
    is_causal aligns top-left."""
    i = torch.arange(case.seqlen_q, device=q.device)[:, None]
    visible = torch.arange(case.cache_len, device=q.device) <= i + case.cache_len - case.seqlen_q
    return torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, float("-inf"))[None, None]


def _sdpa(backend: str | None):
    """SDPA, pinned to ``backend`` (None: its own choice), enable_gqa, on the dense copies; causal through an
    additive bottom-right mask built once, or for the FlashAttention-2 backend (which takes no mask)
    torch.nn.attention.bias.causal_lower_right, which SDPA runs on that kernel when it can (checked first)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def make(case: DecodeCase, inputs: DecodeInputs):
        q, k, v = inputs.dense
        mask = None
        if case.causal and backend == "FLASH_ATTENTION":
            from torch.backends.cuda import SDPAParams, can_use_flash_attention
            from torch.nn.attention.bias import causal_lower_right

            with warnings.catch_warnings(record=True) as why:
                warnings.simplefilter("always")
                fits = can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, True), True)
            if not fits:
                reasons = "; ".join(str(w.message) for w in why) or "no reason given"
                raise RuntimeError(f"SDPA's FlashAttention-2 kernel does not take this case: {reasons}")
            mask = causal_lower_right(case.seqlen_q, case.cache_len)
        elif case.causal:
            mask = _bottom_right_mask(case, q)

        def fwd():
            with sdpa_kernel(getattr(SDPBackend, backend)) if backend else contextlib.nullcontext():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

        return fwd, _bnhd

    return make


def _flex(case: DecodeCase, inputs: DecodeInputs):
    """FlexAttention compiled for the shape (its decoding kernel: a few queries), enable_gqa, on the dense copies,
    the block mask built once: bottom-right causal, or every block full."""
    from torch.nn.attention.flex_attention import create_block_mask, noop_mask

    q, k, v = inputs.dense
    offset = case.cache_len - case.seqlen_q

    def causal(b, h, i, j):
        return j <= i + offset

    mask_mod = causal if case.causal else noop_mask
    block_mask = create_block_mask(mask_mod, None, None, case.seqlen_q, case.cache_len, device=q.device)
    compiled = compiled_flex()
    return (lambda: compiled(q, k, v, block_mask=block_mask, enable_gqa=True)), _bnhd


DECODE_PROVIDERS: dict[str, Callable] = {
    OURS: _ours,
    "sdpa": _sdpa(None),
    "sdpa-cudnn": _sdpa("CUDNN_ATTENTION"),
    "sdpa-flash": _sdpa("FLASH_ATTENTION"),
    "flex": _flex,
}
DECODE_GPU_ONLY = {"sdpa-cudnn", "sdpa-flash", "flex"}


class DecodeTrial(Trial):
    """A Trial on a decode-suite case: the case's shared inputs, the same forward timed on the device and on the host,
    bandwidth instead of FLOP/s."""

    gpu_only = DECODE_GPU_ONLY

    def __init__(self, result: Result, device: torch.device, inputs: DecodeInputs):
        super().__init__(result, device)
        self.inputs = inputs

    def _first_call(self) -> None:
        result, inputs, device = self.result, self.inputs, self.device
        self.fwd, bnhd = DECODE_PROVIDERS[result.provider](result.case, inputs)  # inputs built outside the clock
        start = time.perf_counter()
        out = self.fwd()
        if device.type == "cuda":
            torch.cuda.synchronize()
        result.first_call_s = time.perf_counter() - start
        k, v = (x[None] for x in inputs.sequence(0))
        result.max_error = forward_error(bnhd(out)[:1], inputs.q[:1], k, v, result.case.causal)
        del out, k, v
        result.peak_extra_mib = peak_extra_mib(self.fwd, device)

    def call(self, mode: str) -> Callable:
        return self.fwd

    def _drop(self) -> None:
        super()._drop()
        self.inputs = None

    def rates(self) -> None:
        result = self.result
        if "fwd" in result.ms:
            result.tb_per_s["fwd"] = result.case.kv_bytes / (result.ms["fwd"] * 1e-3) / 1e12


def run_decode_case(case: DecodeCase, providers, device: torch.device, rounds: int) -> list[Result]:
    """Every provider on one decode case, on one set of inputs: device time and host time, in rounds."""
    inputs = DecodeInputs(case, device)
    trials = [DecodeTrial(Result(case, p), device, inputs) for p in providers]
    del inputs  # the trials let go of it as they finish: freed before run_trials empties the allocator's cache
    timers = {"fwd": device_timer(device, ahead=True), "host": host_timer(device, HOST_CALLS)}
    return run_trials(trials, device, timers, rounds)
