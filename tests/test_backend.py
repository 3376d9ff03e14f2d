"""FLASHTRITON_BACKEND selects the path; impossible selections fail with the fix."""

import dataclasses
import functools

import pytest
import torch

from flashtriton import flash_attn_func, flash_attn_varlen_func, route, triton_backend
from flashtriton.kernels import config
from flashtriton.params import AttentionParams
from helpers import assert_close_to_reference, hopper, poison_empty


def _family(device: str, dtype: torch.dtype) -> str:
    q = torch.empty(1, 128, 2, 64, device=device, dtype=dtype)
    return route.forward(q, q, q, AttentionParams(0.125)).family


def test_auto_picks_torch_path_on_cpu(monkeypatch):
    monkeypatch.delenv("FLASHTRITON_BACKEND", raising=False)
    assert _family("cpu", torch.float16) == route.TORCH


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_auto_picks_triton_on_cuda(monkeypatch):
    monkeypatch.delenv("FLASHTRITON_BACKEND", raising=False)
    assert _family("cuda", torch.bfloat16) in (route.HOPPER, route.PORTABLE)
    # fp32 goes to the PyTorch path: the kernels' approximate exp2 would cost fp32 accuracy
    assert _family("cuda", torch.float32) == route.TORCH


@hopper
def test_hopper_without_the_tested_triton_takes_the_portable_kernels(monkeypatch):
    """Where triton_compat finds Triton's private APIs missing (another Triton), Hopper routes to the portable
    kernels."""
    monkeypatch.delenv("FLASHTRITON_BACKEND", raising=False)
    monkeypatch.setattr(route, "_ROUTES", {})
    assert _family("cuda", torch.bfloat16) == route.HOPPER
    monkeypatch.setattr(route.triton_compat, "PRIVATE_API_OK", False)
    monkeypatch.setattr(route, "_ROUTES", {})  # the check is fixed for a process: routes remembered before it hold
    assert _family("cuda", torch.bfloat16) == route.PORTABLE


def test_unknown_backend(monkeypatch):
    monkeypatch.setenv("FLASHTRITON_BACKEND", "cuda")
    with pytest.raises(ValueError, match="one of auto, triton, torch"):
        _family("cpu", torch.float32)


def test_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("FLASHTRITON_BACKEND", "triton")
    monkeypatch.setattr(route, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        _family("cpu", torch.float32)


def test_tma_view_only_for_layouts_the_copy_engine_can_read():
    x = torch.zeros(2, 10, 3, 16, dtype=torch.bfloat16)
    desc = triton_backend._tma_view(x, 8, 16, enabled=True)
    assert desc.shape == [20, 48] and desc.strides == [48, 1] and desc.block_shape == [8, 16]
    # a packed qkv slice: rows 3x wider than the heads, base 96 bytes in (16-byte aligned)
    qkv = torch.zeros(2, 10, 3, 3, 16, dtype=torch.bfloat16)
    assert triton_backend._tma_view(qkv[:, :, 1], 8, 16, enabled=True).strides == [144, 1]
    assert triton_backend._tma_view(x, 8, 16, enabled=False) is None
    assert triton_backend._tma_view(x[..., :12], 8, 16, enabled=True) is None  # head dim padded to 16
    assert triton_backend._tma_view(x[:, :5], 8, 16, enabled=True) is None  # batches not back to back
    odd = torch.zeros(2 * 10 * 3 * 16 + 1, dtype=torch.bfloat16)[1:].view(2, 10, 3, 16)
    assert triton_backend._tma_view(odd, 8, 16, enabled=True) is None  # base not 16-byte aligned
    spread = torch.zeros(2, 10, 3, 32, dtype=torch.bfloat16)[..., :16]
    assert triton_backend._tma_view(spread, 8, 16, enabled=True) is None  # heads not packed
    narrow = torch.zeros(2, 10, 3 * 16 + 4, dtype=torch.bfloat16)[..., :48].view(2, 10, 3, 16)
    assert triton_backend._tma_view(narrow, 8, 16, enabled=True) is None  # row stride 104 bytes
    assert triton_backend._tma_view(x[:, :1], 8, 16, enabled=True) is None  # N=1 batches 480 apart
    assert triton_backend._tma_view(x[:1, :1], 8, 16, enabled=True).shape == [1, 48]


def test_dkdv_steps_read_whole_lse_rows():
    """The Gluon dK/dV kernel reads LSE and delta block_m rows at a time from rows padded to LSE_ROWS_ALIGN: a step
    stays within its head's rows only while block_m divides the alignment."""
    for width, cfg in config._SM90_HOPPER_BACKWARD.items():
        assert config.LSE_ROWS_ALIGN % cfg.block_m == 0, (width, cfg.block_m)


def test_hopper_scope():
    """The Gluon kernels take plain dense, causal or causal sliding-window self-attention of any length, and dense
    cross-attention without a mask; the portable kernels run the rest (the kernels' results are tested against the
    reference in test_attention)."""
    q = torch.zeros(2, 256, 4, 64, dtype=torch.bfloat16)
    kv = torch.zeros(2, 256, 2, 64, dtype=torch.bfloat16)

    def fits(q=q, k=kv, **params):
        return route.hopper_fits(AttentionParams(0.125, **params), q, k, k)

    assert fits() and fits(window_right=0)
    assert not fits(softcap=5.0) and not fits(dropout_p=0.1)
    assert fits(window_left=8, window_right=0)  # causal sliding window
    assert not fits(window_right=4) and not fits(window_left=8, window_right=4) and not fits(window_left=8)
    assert fits(q=q[:, :191], k=kv[:, :191])  # a sequence that ends inside a tile
    assert fits(k=kv[:, :128]) and fits(q=q[:, :77])  # cross-attention, no mask
    # masks aligned bottom-right between two lengths, and a ring step's fp32 partial results, stay portable
    assert not fits(k=kv[:, :128], window_right=0) and not fits(k=kv[:, :128], fp32_results=True)
    assert fits(q=q[..., :48], k=kv[..., :48])  # a head dim between widths: 64-wide tiles
    assert not fits(q=q[..., :44], k=kv[..., :44])  # 88-byte rows: TMA reads 16-byte multiples
    config = triton_backend.config
    forward = functools.partial(config.hopper_forward_config, banded=False, left_bounded=False, span=1024)
    assert forward("sm90", 128, torch.bfloat16) is not None
    assert forward("sm90", 64, torch.float16) is not None
    assert forward("sm90", 128, torch.float32) is None
    assert forward("cuda", 128, torch.bfloat16) is None
    assert forward("sm90", 256, torch.bfloat16).block_n == 64
    # three consumer warpgroups for D=64 over long spans: unbanded from 1k keys, banded from 4k
    wide = config.WIDE_SPAN
    assert wide == 1024 and config.WIDE_BAND_SPAN == 4096
    assert forward("sm90", 64, torch.bfloat16, span=wide).consumers == 3
    assert forward("sm90", 64, torch.bfloat16, span=wide - 1).consumers == 2
    assert forward("sm90", 64, torch.bfloat16, span=wide, banded=True).consumers == 2
    assert forward("sm90", 128, torch.bfloat16, span=wide).consumers == 2
    # the row reductions as chains in every table row (trees lost on the H200: an autotune candidate)
    spans = (512, wide, config.WIDE_BAND_SPAN)
    assert not any(forward("sm90", d, torch.bfloat16, span=s, banded=b).tree_rows
                   for d in (64, 128, 256) for s in spans for b in (False, True))  # fmt: skip
    assert any(c.tree_rows for c in config.hopper_forward_candidates(64, forward("sm90", 64, torch.bfloat16)))
    # a head dim between the widths is tuned among its width's rows
    table = forward("sm90", 80, torch.bfloat16)
    assert table == forward("sm90", 128, torch.bfloat16)
    assert set(config.hopper_forward_candidates(80, table)) == set(config.hopper_forward_candidates(128, table))
    # the consumers' MMAs in turns for D=256, banded or not, and D=64's three unbanded
    assert forward("sm90", 256, torch.bfloat16).pingpong and forward("sm90", 256, torch.bfloat16, banded=True).pingpong
    assert forward("sm90", 64, torch.bfloat16, span=wide).pingpong
    unturned = ((64, wide - 1), (128, 512), (128, wide))
    assert not any(forward("sm90", d, torch.bfloat16, span=s).pingpong for d, s in unturned)
    banded_wide = forward("sm90", 64, torch.bfloat16, span=config.WIDE_BAND_SPAN, banded=True)
    assert banded_wide.consumers == 3 and not banded_wide.pingpong
    # 64-key tiles for short banded spans only
    short = config.SHORT_BAND_SPAN
    assert forward("sm90", 128, torch.bfloat16, span=short, banded=True).block_n == 64
    assert forward("sm90", 128, torch.bfloat16, span=short + 1, banded=True).block_n == 128
    assert forward("sm90", 128, torch.bfloat16, span=short).block_n == 128
    assert config.hopper_backward_config("sm90", 128, torch.bfloat16) is not None
    assert config.hopper_backward_config("sm90", 64, torch.bfloat16) is not None
    split = config.hopper_backward_config("sm90", 256, torch.bfloat16)
    assert split.split_d and split.dq is None and split.rows == 64  # fused only: deterministic runs the portable pair
    align = config.LSE_ROWS_ALIGN
    for head_dim in (64, 128, 256):
        cfg = config.hopper_backward_config("sm90", head_dim, torch.bfloat16)
        assert cfg.block_m == config.PREPROCESS_BLOCK_M  # the preprocess zeroes the fused dQ sums in whole tiles
        # the aligned LSE and delta rows past a sequence's end are written (zeros) by whichever pass writes delta,
        # in whole programs, and the dK/dV kernel reads no further than the next multiple of LSE_ROWS_ALIGN
        assert config.PREPROCESS_BLOCK_M % align == 0 and align % cfg.block_m == 0
        assert cfg.dq is None or 2 * cfg.dq.block_m % align == 0


@hopper
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_hopper_kernels_run_where_they_fit(causal, head_dim, monkeypatch):
    monkeypatch.setattr(triton_backend, "_PLANS", {})  # an earlier test's plan would launch without these functions
    monkeypatch.setattr(route, "_ROUTES", {})  # routes hold the table configs too
    calls = []
    for name in ("_hopper_forward", "_hopper_dkdv", "_hopper_dq"):
        launch = getattr(triton_backend, name)
        monkeypatch.setattr(triton_backend, name, lambda *args, n=name, f=launch: calls.append(n) or f(*args))
    # 4096 keys: a mean span of 2048 or more, where the backward takes the fused kernel
    shapes = ((1, 4096, h, head_dim) for h in (8, 4, 4))
    q, k, v = (torch.randn(s, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s in shapes)
    flash_attn_func(q, k, v, causal=causal).sum().backward()
    flash_attn_func(q, k, v, causal=causal, deterministic=True).sum().backward()
    # one fused backward pass; deterministic, dQ's own pass first (it computes delta for dK/dV), or at D=256,
    # which has no Gluon dQ kernel, the portable kernels (tests/test_hopper_shapes.py: other lengths and layouts)
    deterministic = ["_hopper_dq", "_hopper_dkdv"] if head_dim == 128 else []
    assert calls == ["_hopper_forward", "_hopper_dkdv", "_hopper_forward", *deterministic]


def _config_switch(monkeypatch, launcher: str, chooser: str, cfg_at: int):
    """For tests that run a Gluon path with a config field switched: poisons torch.empty, notes the config that each
    call of triton_backend's `launcher` gets (its argument at cfg_at), and returns (run, noted) where run(field, value,
    fn, *args, **kwargs) calls fn(*args, **kwargs) with config.`chooser`'s configs holding that value."""
    poison_empty(monkeypatch)
    choose = getattr(triton_backend.config, chooser)
    launch = getattr(triton_backend, launcher)
    noted = []
    monkeypatch.setattr(triton_backend, launcher, lambda *args: noted.append(args[cfg_at]) or launch(*args))

    def run(field: str, value, fn, *args, **kwargs):
        def switched(*a, **kw):
            cfg = choose(*a, **kw)
            return cfg and dataclasses.replace(cfg, **{field: value})

        monkeypatch.setattr(triton_backend, "_PLANS", {})  # a plan is keyed by layout, not config

        monkeypatch.setattr(route, "_ROUTES", {})  # routes hold the table configs too
        monkeypatch.setattr(triton_backend.config, chooser, switched)
        return fn(*args, **kwargs)

    return run, noted


def _qkv(gen: torch.Generator, *shape: int, group: int = 1, grad: bool = False) -> list[torch.Tensor]:
    """q of this shape and k, v with group times fewer heads (the next-to-last dim), bf16 on the GPU."""
    kv_shape = (*shape[:-2], shape[-2] // group, shape[-1])
    return [
        torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(grad)
        for s in (shape, kv_shape, kv_shape)
    ]


@hopper
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_hopper_forward_turns_change_no_bits(head_dim, monkeypatch):
    """The consumers' MMAs in turns (pingpong) only reorder their issue: every forward path gives the same bits with
    and without, and none hangs. Causal tiles whose warpgroups own different numbers of key tiles, a window's lead
    tiles, sequences that end inside a tile, three warpgroups (D=64's long spans), banded or not (the table's D=64
    banded three take no turns; autotuning may give them turns)."""
    run, calls = _config_switch(monkeypatch, "_hopper_forward", "hopper_forward_config", -2)
    gen = torch.Generator(device="cuda").manual_seed(0)
    cu = torch.tensor([0, 64, 320, 448], device="cuda", dtype=torch.int32)  # 64 rows: half a two-warpgroup tile
    long = torch.tensor([0, 64, 1100, 1200], device="cuda", dtype=torch.int32)  # unbanded 1036: three warpgroups
    cases = [
        (flash_attn_func, _qkv(gen, 2, 512, 3, head_dim), {"causal": True}),
        (flash_attn_func, _qkv(gen, 1, 1024, 2, head_dim), {"causal": True, "window_size": (300, 0)}),
        (flash_attn_varlen_func, [*_qkv(gen, 448, 2, head_dim), cu, cu, 256, 256], {"causal": True}),
        (flash_attn_func, _qkv(gen, 1, 2048, 2, head_dim), {}),
        (flash_attn_varlen_func, [*_qkv(gen, 1200, 2, head_dim), long, long, 1036, 1036], {}),
        (flash_attn_func, _qkv(gen, 1, 4096, 1, head_dim), {"causal": True}),
        (flash_attn_func, _qkv(gen, 1, 8192, 1, head_dim), {"causal": True}),  # a span of 4096: D=64's three
    ]
    consumers = []
    for fn, args, kwargs in cases:
        outs = [run("pingpong", on, fn, *args, **kwargs) for on in (False, True)]
        assert [cfg.pingpong for cfg in calls[-2:]] == [False, True]  # both ran the Gluon forward
        assert not outs[0].isnan().any()
        assert torch.equal(outs[0], outs[1])
        consumers.append(calls[-1].consumers)
    if head_dim == 64:  # three for the dense 2048, the dense varlen 1036 and the causal 8192
        assert consumers == [2, 2, 2, 3, 3, 2, 3]


@pytest.mark.parametrize("gluon", [False, True], ids=["portable", "gluon"])
def test_preprocess_writes_delta_and_zeroes_the_fused_backwards_dq(gluon):
    """The preprocess kernel computes delta = rowsum(dO * O) - dLSE: laid out as dLSE for the portable kernels or, for
    the Gluon dK/dV kernel, in aligned rows beside a copy of the LSE, zeros up to whole tiles; and, given the fused
    backward's fp32 dQ sums, zeroes them in whole tiles (a ragged last row block) and all BLOCK_D columns (they are as
    wide as the Gluon tiles; D under BLOCK_D), in whichever of the interpreter or the GPU runs here."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch, n, heads, head_dim = 2, 37, 3, 40
    align = config.LSE_ROWS_ALIGN if gluon else 0
    out, dout = (torch.randn(batch, n, heads, head_dim, device=device, dtype=torch.bfloat16) for _ in range(2))
    dlse, lse = torch.randn(batch, heads, n, device=device), torch.randn(batch, heads, n, device=device)
    rows = (batch, heads, align) if gluon else dlse.shape
    delta, lse_rows = (torch.full(rows, float("nan"), device=device) for _ in range(2))
    sums = torch.full((batch, 64, heads, 64), float("nan"), device=device) if gluon else None
    triton_backend._PREPROCESS[(2, batch * heads)](
        out, dout, dlse, delta, sums, lse, lse_rows, *triton_backend._strides(out), *triton_backend._strides(dout),
        *triton_backend._strides(out if sums is None else sums), dlse.stride(0), dlse.stride(1), delta.stride(0),
        delta.stride(1), N_Q=n, H=heads, CU_SEQLENS_Q=None, D=head_dim, BLOCK_D=64, BLOCK_M=32, VARLEN=False,
        ALIGN=align,
    )  # fmt: skip
    exact = (out.double() * dout.double()).sum(-1).transpose(1, 2) - dlse.double()
    plain = (out * dout).sum(-1).transpose(1, 2).float() - dlse
    assert_close_to_reference("delta", delta[..., :n], exact, plain)
    if gluon:
        assert torch.equal(sums, torch.zeros_like(sums))
        assert torch.equal(lse_rows[..., :n], lse)
        assert not delta[..., n:].any() and not lse_rows[..., n:].any()


def test_preprocess_zeroes_only_each_sequences_tiles():
    """Varlen, the fused backward's dQ sums are zeroed in each sequence's whole tiles and nowhere past them: a short
    sequence's program rows run up to the longest's, and the buffer ends at the last sequence's last tile."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    heads, head_dim, block = 2, 16, config.PREPROCESS_BLOCK_M
    cu = torch.tensor([0, 3 * block, 4 * block - 5], device=device, dtype=torch.int32)  # 192 rows, then 59
    total, rows = cu[-1].item(), 4 * block
    out, dout = (torch.randn(1, total, heads, head_dim, device=device, dtype=torch.bfloat16) for _ in range(2))
    lse, dlse = (torch.randn(heads, total, device=device) for _ in range(2))
    delta = torch.full((heads, 6 * block), float("nan"), device=device)
    lse_rows = torch.full_like(delta, float("nan"))
    buffer = torch.full((2 * rows, heads, head_dim), float("nan"), device=device)
    sums = buffer[:rows].unsqueeze(0)  # the rows past it: another tensor's
    triton_backend._PREPROCESS[(3, 2 * heads)](
        out, dout, dlse, delta, sums, lse, lse_rows, *triton_backend._strides(out, True),
        *triton_backend._strides(dout, True), *triton_backend._strides(sums, True), 0, dlse.stride(0), 0,
        delta.stride(0), N_Q=block * 3, H=heads, CU_SEQLENS_Q=cu, D=head_dim, BLOCK_D=head_dim, BLOCK_M=block,
        VARLEN=True, ALIGN=config.LSE_ROWS_ALIGN,
    )  # fmt: skip
    assert torch.equal(sums, torch.zeros_like(sums))
    assert buffer[rows:].isnan().all()
    # the second sequence's delta and LSE from aligned row (cdiv(192, 64) + 1) * 64 = 256 on, zeros to a whole tile
    assert torch.equal(lse_rows[:, 4 * block : 5 * block - 5], lse[:, 3 * block :])
    assert not lse_rows[:, 5 * block - 5 : 5 * block].any() and not delta[:, 5 * block - 5 : 5 * block].any()


def _fragment_positions(rows: int, width: int, half: int) -> torch.Tensor:
    """Where the fused backward's reductions put dQ's (row, column) in its fp32 sums, by the formula of
    kernels/hopper/dkdv.py's _fragments (the buffer as (row tile, fragment row) x (column tile,
    config.DQ_FRAGMENT_COLS))."""
    row, col = torch.arange(rows)[:, None], torch.arange(width)[None, :]
    w, h, r = row % 64 // 16, row % 16 // 8, row % 8
    j, c, e = col % half // 8, col % 8 // 2, col % 2
    flat = ((w * (half // 8) + j) * 32 + 4 * r + c) * 4 + 2 * h + e
    frag = config.DQ_FRAGMENT_COLS
    return (row // 64 * (64 * half // frag) + flat // frag) * (width // half * frag) + col // half * frag + flat % frag


@pytest.mark.parametrize("n", [100, 128], ids=["ragged", "whole"])
@pytest.mark.parametrize(
    "head_dim, width, fragments",
    [(64, 64, True), (128, 128, True), (256, 256, False), (80, 128, True), (192, 256, False)],
)
def test_dq_convert_reads_the_fused_backwards_order(head_dim, width, fragments, n):
    """The conversion after the fused backward reads its fp32 sums in the order the kernel's reductions wrote them
    (64 and 128 wide: fragment order; 256's split kernel: row-major), whole tiles of rows per batch of which the first
    N are dQ's, as wide as the kernel's tiles of which the first head_dim columns are dQ's, into dQ's own layout
    (here a model's (B, H, N, D) storage), in whichever of the interpreter or the GPU runs."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch, rows, heads = 2, 128, 3
    half = width // 2 if fragments else config.DQ_CONVERT_COLS
    dq = torch.randn(batch * rows, heads * width, device=device, dtype=torch.bfloat16).float()  # exact in both
    sums = torch.full_like(dq, float("nan")).view(-1)
    at = _fragment_positions(batch * rows, heads * width, width // 2) if fragments else torch.arange(dq.numel())
    sums[at.view(-1).to(device)] = dq.view(-1)
    storage = torch.full((batch, heads, n + 1, head_dim), float("nan"), device=device, dtype=torch.bfloat16)
    out = storage.transpose(1, 2)[:, :n]  # a row past dQ's: nothing may land there
    triton_backend._DQ_CONVERT[(batch * rows // 64, heads * width // half)](
        sums, out, *out.stride()[:3], n, rows, heads * width, D=width, HEAD_D=head_dim, BLOCK_M=64, HALF=half,
        FRAGMENTS=fragments, FRAGMENT_COLS=config.DQ_FRAGMENT_COLS, EVEN=n == rows,
    )  # fmt: skip
    assert torch.equal(out.float(), dq.view(batch, rows, heads, width)[:, :n, :, :head_dim])
    assert storage[:, :, n].isnan().all()


def _input_grads(fn, *args, **kwargs) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv of fn(q, k, v, ...).sum()."""
    out = fn(*args, **kwargs)
    return torch.autograd.grad(out, args[:3], torch.ones_like(out))


@hopper
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_hopper_backward_order_changes_no_bits(head_dim, monkeypatch):
    """The causal dK/dV programs in groups of heads (order_programs) only reorder the grid: every key block of every
    head runs once, whole groups and a last partial one (20 K/V heads in groups of 16), GQA, ragged sequences, the
    fused kernel and, at D=64/128's short spans, the pair's dK/dV kernel."""
    run, calls = _config_switch(monkeypatch, "_hopper_dkdv", "hopper_backward_config", -1)
    gen = torch.Generator(device="cuda").manual_seed(0)
    cu = torch.tensor([0, 128, 640, 768], device="cuda", dtype=torch.int32)
    cases = [
        (flash_attn_func, _qkv(gen, 5, 512, 4, head_dim, grad=True), {"causal": True}),
        (flash_attn_func, _qkv(gen, 2, 1024, 6, head_dim, group=3, grad=True), {"causal": True}),
        (flash_attn_func, _qkv(gen, 1, 1024, 2, head_dim, grad=True), {"causal": True, "window_size": (300, 0)}),
        (flash_attn_func, _qkv(gen, 1, 4096, 3, head_dim, grad=True), {"causal": True}),  # D=128's fused kernel
        (flash_attn_varlen_func, [*_qkv(gen, 768, 7, head_dim, grad=True), cu, cu, 512, 512], {"causal": True}),
    ]
    for fn, args, kwargs in cases:
        (dq0, dk0, dv0), (dq1, dk1, dv1) = (
            run("order_programs", order, _input_grads, fn, *args, **kwargs) for order in (0, 10**6)
        )
        assert [cfg.order_programs for cfg in calls[-2:]] == [0, 10**6]  # both ran the Gluon dK/dV kernel
        assert not (dk0.isnan().any() or dv0.isnan().any() or dq0.isnan().any())
        assert torch.equal(dk0, dk1) and torch.equal(dv0, dv1)
        torch.testing.assert_close(dq1, dq0, atol=2e-2, rtol=1e-2)  # dQ's shares add up in another order


def test_heads_grid_splits_batch_times_heads_over_two_axes():
    """More (batch, head) programs than CUDA's 65535 along y go over y and z, a whole number of heads on y, exactly."""
    assert triton_backend._heads_grid(7, 4, 16) == (7, 64, 1)
    assert triton_backend._heads_grid(7, 4096, 32) == (7, 65536 // 2, 4)
    assert triton_backend._heads_grid(3, 70007, 3) == (3, 30003, 7)  # 70007 = 7 * 10001
    with pytest.raises(ValueError, match="split the batch"):
        triton_backend._heads_grid(1, 70001, 1)  # a prime batch past y's limit: no whole split


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_programs_split_over_grid_axes_agree(causal, monkeypatch):
    """The portable kernels with their (batch, head) programs split over y and z (a tiny y limit stands in for CUDA's)
    give the same bits as on one axis, forward and backward, in whichever of the interpreter or the GPU runs."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setenv("FLASHTRITON_BACKEND", "triton")
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 33, h, 16, device=device, dtype=torch.float16) for h in (4, 2, 2))
    p = AttentionParams(0.25, window_right=0 if causal else -1)

    def run():
        r = route.forward(q, k, v, p)
        out, lse = triton_backend.forward(q, k, v, p, r)
        back = route.backward(out, lse, q, k, v, out, lse, p)
        return out, lse, *triton_backend.backward(out, torch.ones_like(lse), q, k, v, out, lse, p, back)[:3]

    expected = run()
    monkeypatch.setattr(triton_backend, "_GRID_Y", 4)  # 16 query-head programs: y = 4 (one batch), z = 4
    monkeypatch.setattr(triton_backend, "_PLANS", {})
    for a, b in zip(run(), expected, strict=True):
        assert torch.equal(a, b)


def test_windows_wider_than_any_sequence_hide_nothing(monkeypatch):
    """Window bounds near 2**31 are clamped on the host (row + bound stays inside the kernels' 32-bit arithmetic): the
    same result as no bound, in whichever of the interpreter or the GPU runs here."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setenv("FLASHTRITON_BACKEND", "triton")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 64, 2, 16, device=device, dtype=torch.float16) for _ in range(3))
    wide = flash_attn_func(q, k, v, window_size=(2**31 - 2, 2**31 - 2))
    torch.testing.assert_close(wide, flash_attn_func(q, k, v), atol=0, rtol=0)
