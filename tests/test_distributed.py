"""flashtriton.distributed (docs/distributed.md): the layouts, the ring's step rule, its arithmetic simulated in one
process at 8 and 16 ranks, and real gloo groups of 2 and 4 processes, against the fp64 reference by the one
tolerance rule.

A group's processes are spawned once per world size (a spawn costs seconds), so each of those tests runs every case
of CASES in its processes (distributed_worker.py) and names the case in each assertion.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from distributed_worker import NAMES, Case, full_inputs, join, simulate, worker
from flashtriton import flash_attn_func, flash_attn_varlen_func
from flashtriton.__main__ import main
from flashtriton.bench import ring as ring_bench
from flashtriton.distributed import (
    CONTIGUOUS,
    LAYOUTS,
    ZIGZAG,
    merge,
    ring_flash_attn_func,
    ring_flash_attn_varlen_func,
)
from flashtriton.distributed import layout as L
from flashtriton.distributed import steps as S
from flashtriton.distributed.halo import Halo
from helpers import FLOOR_ULPS, TARGETS, assert_close_to_reference, max_error, reference_outputs, target_params


def test_zigzag_gives_rank_r_chunks_r_and_its_mirror():
    x = torch.arange(8).view(1, 8)
    assert [s.flatten().tolist() for s in L.split(x, 2, ZIGZAG)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [s.flatten().tolist() for s in L.split(x, 2, CONTIGUOUS)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 3, 8])
def test_split_and_join_are_inverse(world, layout):
    x = torch.randn(2, 2 * world * 3, 5)
    assert torch.equal(L.join(L.split(x, world, layout), layout), x)
    lengths = [2 * world * n for n in (2, 0, 1)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = torch.randn(sum(lengths), 3)
    shards = L.split_varlen(packed, cu, world, layout)
    assert all(s.shape[0] == sum(lengths) // world for s in shards)
    assert torch.equal(L.join_varlen(shards, cu, layout), packed)
    none = torch.zeros(1, dtype=torch.int32)  # a batch of no documents: empty shards
    shards = L.split_varlen(packed[:0], none, world, layout)
    assert [s.shape for s in shards] == [(0, 3)] * world and L.join_varlen(shards, none, layout).shape == (0, 3)


def test_a_length_the_layout_cannot_split_says_how_to_pad():
    with pytest.raises(ValueError, match="multiple of 4; pad it to 8"):
        L.split(torch.randn(1, 6), 2, ZIGZAG)


def _visible_in_step(step: S.Step, n_rows: int, n_keys: int) -> torch.Tensor:
    """(rows, keys) bool of the pairs a step's call computes, by params.py's window rule (aligned bottom-right)."""
    i = torch.arange(n_rows)[:, None] + n_keys - n_rows
    j = torch.arange(n_keys)[None, :]
    left, right = step.params.window_left, step.params.window_right
    return ((j >= i - left) | (left < 0)) & ((j <= i + right) | (right < 0))


@pytest.mark.parametrize("mask", ["causal", "full", "window-0", "window-2", "window-4", "window-9"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8, 16])
def test_the_steps_compute_each_visible_pair_once(world, layout, mask):
    """Over all ranks and steps, every (query, key) pair the mask shows is computed exactly once, no other pair."""
    rows = 2 * 3  # two chunks of 3 per rank (zigzag), one of 6 (contiguous)
    positions = L.split(torch.arange(rows * world), world, layout, dim=0)
    count = torch.zeros(rows * world, rows * world, dtype=torch.int64)
    params = S.partial_params(1.0, False)
    left = int(mask.removeprefix("window-")) if mask.startswith("window") else None
    for rank in range(world):
        if left is None:
            plan = S.dense_steps(world, rank, rows, layout, mask == "causal", params)
        else:
            plan = S.window_steps(world, rank, rows, layout, left, params)
        for src, step in ((src, step) for src, pieces in enumerate(plan) for step in pieces):
            q_pos, k_pos = positions[rank][step.rows], positions[src][step.keys]
            seen = _visible_in_step(step, len(q_pos), len(k_pos))
            count[q_pos[:, None].expand_as(seen)[seen], k_pos[None, :].expand_as(seen)[seen]] += 1
    expected = torch.ones_like(count).tril() if mask != "full" else torch.ones_like(count)
    if left is not None:
        expected = expected.triu(-left)
    assert torch.equal(count, expected)


def check_case(label: str, case: Case, x: dict, outputs: dict) -> None:
    """The distributed results against the fp64 reference on the full inputs, by the one tolerance rule."""
    cu = (x["cu_seqlens"],) * 2 if case.packed else None
    common = dict(causal=case.causal, cu_seqlens=cu, window_size=case.window)
    args = [x[name] for name in ("q", "k", "v", "dout", "dlse")]
    exact = reference_outputs(*args, **common)
    plain = reference_outputs(*args, compute_dtype=x["q"].dtype, **common)
    for name, actual, e, p in zip(NAMES, (outputs[n] for n in NAMES), exact, plain, strict=True):
        assert_close_to_reference(f"{label} {name}", actual, e, p)


SIMULATED = [
    Case("zigzag-causal-gqa-fp32", "ring", True, "float32", rows=4, heads=2, heads_k=1),
    Case("zigzag-causal-bf16", "ring", True, "bfloat16", rows=4, heads=2, heads_k=2),
    Case("zigzag-full-bf16", "ring", False, "bfloat16", rows=4, heads=2, heads_k=1),
    Case("zigzag-window-bf16", "ring", True, "bfloat16", rows=4, heads=2, heads_k=1, window=(5, 0)),
    # causal with a right bound: flash_attn's rule makes it (5, 0)
    Case("zigzag-causal-window-right-fp32", "ring", True, "float32", rows=4, heads=2, heads_k=1, window=(5, 3)),
    Case("contiguous-window-fp32", "ring", False, "float32", layout=CONTIGUOUS, rows=4, heads=2, window=(3, 0)),
    Case("contiguous-causal-fp32", "ring", True, "float32", layout=CONTIGUOUS, rows=4, heads=2, heads_k=1),
    Case("varlen-zigzag-causal-fp32", "varlen", True, "float32", heads=2, heads_k=1, documents=(2, 0, 1, 3)),
    Case("varlen-zigzag-causal-bf16", "varlen", True, "bfloat16", heads=2, heads_k=2, documents=(1, 2)),
    Case("varlen-contiguous-causal-bf16", "varlen", True, "bfloat16", layout=CONTIGUOUS, heads=2, documents=(3, 1)),
]


@pytest.mark.parametrize("case", SIMULATED, ids=lambda c: c.name)
@pytest.mark.parametrize("world", [8, 16])
def test_a_simulated_ring_of_many_ranks_matches_the_reference(world, case):
    x = full_inputs(case, world, seed=world)
    shards = simulate(case, x, world)
    check_case(f"world {world} {case.name}", case, x, {n: join(case, x, n, [s[n] for s in shards]) for n in NAMES})


# bf16 rings at worlds 4 and 8 (the interpreter: 4), simulated on each target; on the GPU the sm90 Gluon kernels serve
# their pieces (D=64, 128, 256; dense, causal, windowed and varlen; GQA)
RING_ERROR = {
    "tiny": [Case("zigzag-causal-gqa-bf16", "ring", True, "bfloat16", rows=4, heads=2, heads_k=1)],
    "cpu": [
        Case("zigzag-causal-gqa-bf16", "ring", True, "bfloat16", rows=32, heads=4, heads_k=2, head_dim=32),
        Case("zigzag-full-bf16", "ring", False, "bfloat16", rows=32, heads=4, heads_k=4, head_dim=32),
        Case(
            "varlen-causal-gqa-bf16", "varlen", True, "bfloat16", heads=4, heads_k=2, head_dim=32, documents=(3, 1, 4)
        ),
    ],
    "gpu": [
        Case("zigzag-causal-bf16", "ring", True, "bfloat16", rows=512, heads=4, heads_k=4, head_dim=128),
        Case("zigzag-full-gqa-bf16", "ring", False, "bfloat16", rows=512, heads=8, heads_k=2, head_dim=128),
        Case("zigzag-causal-gqa-d64-bf16", "ring", True, "bfloat16", rows=1024, heads=8, heads_k=2, head_dim=64),
        Case("zigzag-causal-d256-bf16", "ring", True, "bfloat16", rows=256, heads=4, heads_k=2, head_dim=256),
        Case(
            "zigzag-window-bf16", "ring", True, "bfloat16", rows=512, heads=4, heads_k=2, head_dim=128, window=(700, 0)
        ),
        Case(
            "varlen-causal-gqa-bf16",
            "varlen",
            True,
            "bfloat16",
            heads=8,
            heads_k=2,
            head_dim=128,
            documents=(48, 8, 64),
        ),
    ],
}
RING_ERROR_WORLDS = {"tiny": (4,), "cpu": (4, 8), "gpu": (4, 8)}


def _one_call(case: Case, x: dict) -> dict[str, torch.Tensor]:
    """out, dq, dk, dv of flash_attn_func (varlen: flash_attn_varlen_func) on the full inputs, the same loss."""
    q, k, v = (x[name].clone().requires_grad_() for name in ("q", "k", "v"))
    options = dict(causal=case.causal, window_size=case.window, return_attn_probs=True)
    if case.packed:
        cu, longest = x["cu_seqlens"], int(x["cu_seqlens"].diff().max())
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, **options)
    else:
        out, lse, _ = flash_attn_func(q, k, v, **options)
    ((out * x["dout"]).sum() + (lse * x["dlse"]).sum()).backward()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize("backend,case", target_params(RING_ERROR), indirect=["backend"])
def test_a_bf16_ring_is_as_accurate_as_one_call(backend, case):
    """The ring's out, dq, dk, dv against the fp64 reference: at most 1.1 x the error of one call on the whole
    sequence (plus a floor of a few fp32 ulps): each step's results come in fp32 and are rounded once, after the
    merge. (On the CPU path the steps also compute in fp32; the interpreter and GPU targets compute as one call
    does, so they isolate the merge.)"""
    for world in RING_ERROR_WORLDS[backend.size]:
        x = {name: t.to(backend.device) for name, t in full_inputs(case, world, seed=world).items()}
        shards = simulate(case, x, world)
        ring = {name: join(case, x, name, [s[name] for s in shards]) for name in NAMES}
        single = _one_call(case, x)
        cu = (x["cu_seqlens"],) * 2 if case.packed else None
        inputs = (x[name].double() for name in ("q", "k", "v", "dout", "dlse"))
        exact = reference_outputs(*inputs, case.causal, cu_seqlens=cu, window_size=case.window)
        for name, e in zip(("out", "dq", "dk", "dv"), (exact[0], *exact[2:5]), strict=True):
            err, base = max_error(ring[name], e), max_error(single[name], e)
            floor = FLOOR_ULPS * torch.finfo(torch.float32).eps * max(1.0, e.abs().max().item())
            assert err <= 1.1 * base + floor, f"world {world} {name}: ring {err:.3e} > 1.1 x one call's {base:.3e}"


def test_a_short_window_trades_only_the_rows_its_band_reaches():
    """Zigzag at world 4, 16 rows per rank (chunks of 8), a causal window of 3: each chunk reads the last 3 rows of
    the chunk before it, which the ranks next to it hold (distances 1 and 3); no rank wants anything at distance 2."""
    params = S.partial_params(1.0, False)
    plans = [S.dense_plan(4, r, 16, ZIGZAG, True, 3, params) for r in range(4)]
    halo = Halo.of(plans, 0)
    assert halo.distances == (1, 3)
    wanted = {r: {src: rows for src, rows in enumerate(halo.wants[r]) if rows} for r in range(4)}
    assert wanted == {0: {1: ((13, 16),)}, 1: {0: ((5, 8),), 2: ((13, 16),)}, 2: {1: ((5, 8),), 3: ((13, 16),)},
                      3: {2: ((5, 8),)}}  # fmt: skip
    moved = Halo.of(plans, 1).pieces_on_received(2)  # chunk 6's first 3 queries against the last 3 rows of chunk 5
    assert [(p.rows, p.keys) for p in moved] == [(slice(8, 11), slice(0, 3))]


MERGES = ["slice", "packed", "gathered-one-copy", "gathered-two-copies"]


@pytest.mark.parametrize("target", [t for t in TARGETS if t.backend != "torch"], ids=str)
@pytest.mark.parametrize("kind", MERGES)
def test_the_merge_kernels_match_torchs_merges(target, kind, monkeypatch):
    """The ring's fp32 merge and gradient add (distributed/merge.py) in one Triton pass against torch's ops a copy at
    a time: a (batch, seqlen, heads, dim) slice view, a packed batch, and gathered rows with one or two copies;
    rows empty in the accumulator, in a copy or in all give what torch gives, and rows not picked stay untouched."""
    device, heads, head_dim, n = target.device, 3, 40, 37
    packed = kind != "slice"
    out = torch.randn((n, heads, head_dim) if packed else (2, n + 5, heads, head_dim), device=device)
    lse = 3 * torch.randn((heads, n) if packed else (2, heads, n + 5), device=device)
    targets, sources = None, ()
    if kind.startswith("gathered"):
        copies = 1 if kind == "gathered-one-copy" else 2
        targets = torch.randperm(n, device=device)[:20]
        sources = tuple(torch.randperm(copies * 20, device=device).view(copies, 20))
        part, part_lse = torch.randn(copies * 20, heads, head_dim, device=device), torch.randn(heads, copies * 20)
        part_lse = 3 * part_lse.to(device)
        part_lse[:, sources[0][0]] = -math.inf  # a copy empty
        lse[:, targets[1]] = -math.inf  # the accumulator empty
        lse[:, targets[2]] = -math.inf
        for rows in sources:
            part_lse[:, rows[2]] = -math.inf  # empty everywhere
    else:
        part, part_lse = torch.randn_like(out), 3 * torch.randn_like(lse)
        lse[..., 1] = part_lse[..., 2] = -math.inf
        lse[..., 3] = part_lse[..., 3] = -math.inf
    view = (lambda x: x) if packed else (lambda x: x[:, 2:-3] if x.dim() == 4 else x[..., 2:-3])
    if kind == "slice":
        part, part_lse = view(part).contiguous(), view(part_lse).contiguous()
    results = {}
    for backend in ("torch", target.backend):
        monkeypatch.setenv("FLASHTRITON_BACKEND", backend)
        o, l, g = out.clone(), lse.clone(), out.clone()
        merge.merge(view(o), view(l), part, part_lse, targets, sources, dtype=torch.bfloat16)  # a bf16 ring's
        merge.add(view(g), part, targets, sources, dtype=torch.bfloat16)
        results[backend] = (o, l, g)
    for name, ours, theirs in zip(("out", "lse", "add"), results[target.backend], results["torch"], strict=True):
        assert not ours.isnan().any(), name
        assert torch.equal(ours.isinf(), theirs.isinf()), name
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5, msg=name)
    o, l, _ = results[target.backend]
    picked = torch.zeros(o.shape[0] if packed else o.shape[1], dtype=torch.bool, device=device)
    picked[slice(2, -3) if kind == "slice" else slice(None) if targets is None else targets] = True
    untouched = (o[~picked], l[:, ~picked]) if packed else (o[:, ~picked], l[..., ~picked])
    original = (out[~picked], lse[:, ~picked]) if packed else (out[:, ~picked], lse[..., ~picked])
    assert all(torch.equal(a, b) for a, b in zip(untouched, original, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_without_a_process_group_the_ring_is_one_flash_attn_func_call(dtype):
    """One call on the whole shard. Its results come in fp32 (AttentionParams.fp32_results), which the PyTorch path
    computes in fp32: in bf16 they are flash_attn_func's on the inputs in fp32, rounded once (the gradients to bf16's
    precision: the backward takes the rounded out)."""
    q, k, v = (torch.randn(1, 24, h, 16, dtype=dtype, requires_grad=True) for h in (4, 2, 2))
    out, lse = ring_flash_attn_func(q, k, v, causal=True, return_lse=True)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    wide = [x.detach().float().requires_grad_() for x in (q, k, v)]
    expected_out, expected_lse, _ = flash_attn_func(*wide, causal=True, return_attn_probs=True)
    expected_grads = torch.autograd.grad(expected_out.sum(), wide)
    assert torch.equal(out, expected_out.to(dtype)) and torch.equal(lse, expected_lse)
    for grad, expected in zip(grads, expected_grads, strict=True):
        if dtype == torch.float32:
            assert torch.equal(grad, expected)
        else:
            torch.testing.assert_close(grad, expected.to(dtype), atol=1e-2, rtol=1.6e-2)


def _qkv(rows=8, heads=4, heads_k=2, head_dim=16):
    return torch.randn(1, rows, heads, head_dim), *(torch.randn(1, rows, heads_k, head_dim) for _ in range(2))


CU = torch.tensor([0, 4, 12], dtype=torch.int32)  # two documents of a 12-row packed batch
REFUSED = {
    "window": (lambda: ring_flash_attn_func(*_qkv(), window_size=(4, 2)), NotImplementedError, "causal sliding"),
    "varlen window": (
        lambda: ring_flash_attn_varlen_func(*(x[0] for x in _qkv(12)), CU, 8, window_size=(3, 0)),
        NotImplementedError,
        "dense shards only",
    ),
    "head dim": (lambda: ring_flash_attn_func(*_qkv(head_dim=12)), ValueError, "with zeros to 16"),
    "layout": (lambda: ring_flash_attn_func(*_qkv(), layout="striped"), ValueError, "is not a layout"),
    "lengths": (lambda: ring_flash_attn_func(_qkv()[0], *_qkv(rows=4)[1:]), ValueError, "same length"),
    "odd rows": (lambda: ring_flash_attn_func(*_qkv(rows=7)), ValueError, "multiple of 2; pad it to 8"),
    "scale": (lambda: ring_flash_attn_func(*_qkv(), softmax_scale=-1.0), ValueError, "positive scale"),
    "group": (lambda: ring_flash_attn_func(*_qkv(), group=object()), ValueError, "init_process_group"),
    "document": (
        lambda: ring_flash_attn_varlen_func(*(x[0] for x in _qkv(12)), torch.tensor([0, 5, 12], dtype=torch.int32), 8),
        ValueError,
        "document 0's length is 5",
    ),
    "cu_seqlens start": (
        lambda: ring_flash_attn_varlen_func(*(x[0] for x in _qkv(12)), torch.tensor([2, 8, 14], dtype=torch.int32), 8),
        ValueError,
        "must start at 0",
    ),
    "cu_seqlens order": (
        lambda: ring_flash_attn_varlen_func(
            *(x[0] for x in _qkv(12)), torch.tensor([0, 8, 4, 12], dtype=torch.int32), 8
        ),
        ValueError,
        "never decrease",
    ),
    "global cu_seqlens": (
        lambda: ring_flash_attn_varlen_func(*(x[0, :6] for x in _qkv(12)), CU, 8),
        ValueError,
        "global cu_seqlens",
    ),
}


@pytest.mark.parametrize("name", REFUSED)
def test_bad_input_is_refused_with_the_fix(name):
    call, error, message = REFUSED[name]
    with pytest.raises(error, match=message):
        call()


CASES = [
    Case("ring-zigzag-causal-gqa-fp32", "ring", True, "float32"),
    Case("ring-zigzag-full-bf16", "ring", False, "bfloat16", heads_k=4),
    Case("ring-contiguous-causal-bf16", "ring", True, "bfloat16", layout=CONTIGUOUS),
    Case("ring-deterministic-causal-bf16", "ring", True, "bfloat16", deterministic=True),
    Case("varlen-zigzag-causal-gqa-fp32", "varlen", True, "float32", documents=(3, 0, 1, 2)),
    Case("varlen-contiguous-full-bf16", "varlen", False, "bfloat16", layout=CONTIGUOUS, documents=(5, 2)),
    Case("ulysses-zigzag-causal-gqa-fp32", "ulysses", True, "float32", heads=8, heads_k=4),
    Case("ulysses-window-bf16", "ulysses", True, "bfloat16", layout=CONTIGUOUS, heads=8, heads_k=4, window=(5, 0)),
    Case("ulysses-varlen-causal-gqa-fp32", "ulysses-varlen", True, "float32", heads=8, heads_k=4, documents=(3, 0, 2)),
    Case(
        "ulysses-varlen-window-bf16",
        "ulysses-varlen",
        True,
        "bfloat16",
        heads=8,
        heads_k=4,
        documents=(1, 4),
        window=(6, 0),
    ),
    Case("ring-x-ulysses-causal-gqa-bf16", "ring", True, "bfloat16", heads=8, heads_k=4, ulysses=2),
    Case("ring-window-gqa-fp32", "ring", True, "float32", window=(11, 0)),
    Case("ring-short-window-bf16", "ring", True, "bfloat16", layout=CONTIGUOUS, window=(3, 0), deterministic=True),
]


@pytest.mark.parametrize(
    "backend",
    [
        "gloo",
        pytest.param("nccl", marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")),
    ],
)
# two processes take half the time of four, which cover the same code and the 2-D groups too (make test runs four)
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_groups_match_the_reference(world, backend, tmp_path):
    """Each case on `world` processes (gloo on the CPU; NCCL, one GPU each): results against the reference; the ring
    bit for bit as its simulation; deterministic calls bit for bit on a repeat; wrong calls refused on every rank
    before any transfer."""
    if backend == "nccl" and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    out_path = str(tmp_path / "results.pt")
    mp.spawn(worker, args=(world, str(tmp_path / "store"), CASES, out_path, backend), nprocs=world)
    saved = torch.load(out_path)
    for case in CASES:
        result = saved[case.name]
        check_case(f"{backend} world {world} {case.name}", case, result["inputs"], result["outputs"])
        if case.simulated and (backend == "gloo" or case.deterministic):
            assert result["simulated"], f"world {world} {case.name}: the ring differs from its simulation"
        if case.deterministic:
            assert result["repeats"], f"world {world} {case.name}: a deterministic repeat differs"
    refusals = saved["refusals"]
    assert refusals["ulysses_heads"].startswith("ValueError") and f"multiples of {world}" in refusals["ulysses_heads"]
    assert refusals["ring_window"].startswith("NotImplementedError: the ring takes causal sliding windows")
    assert refusals["zigzag_rows"].startswith("ValueError") and "pad it to" in refusals["zigzag_rows"]
    assert refusals["two_d_heads"].startswith("ValueError") and "multiples of 2" in refusals["two_d_heads"]
    assert refusals["two_d_no_ring"].startswith("ValueError") and "pass group=" in refusals["two_d_no_ring"]
    assert refusals["two_d_same_groups"].startswith("ValueError") and "no other" in refusals["two_d_same_groups"]
    for name in ("not_a_member", "shard_not_a_member", "unshard_not_a_member", "shard_varlen_not_a_member"):
        assert refusals[name].startswith("ValueError") and "a group this rank is in" in refusals[name], name
    if backend == "gloo":
        assert saved["empty_window"] == (1, 0, 2, 16)
    if world == 4:
        assert refusals["two_d_crossed"].startswith("ValueError") and "one place" in refusals["two_d_crossed"]


def test_the_ring_bench_in_one_process_measures_world_1_and_says_how_to_scale(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["bench", "--suite", "ring", "--rounds", "1", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "torchrun --nproc-per-node 4 -m flashtriton bench --suite ring" in captured.err
    with open(tmp_path / "results.json") as f:
        payload = json.load(f)
    rings = [r for r in payload["results"] if r["provider"] == "ring"]
    assert payload["complete"] and rings and all(r["case"]["world"] == 1 for r in rings)
    assert all(r["tflops_per_gpu"] > 0 and r["efficiency"] == 1.0 for r in rings)
    # every case's row in the printed table (the CPU's tiny cases here, the GPU's real ones on CUDA)
    assert all(case.name in captured.out for case in ring_bench.cases(torch.cuda.is_available(), 1))
    # benchmarks/ring_report.py: a row per result in the table it writes beside the JSON
    report = Path(__file__).parents[1] / "benchmarks" / "ring_report.py"
    subprocess.run([sys.executable, str(report), str(tmp_path / "results.json")], check=True, capture_output=True)
    rows = [line for line in (tmp_path / "README.md").read_text().splitlines() if line.startswith("| ")][1:]
    assert len(rows) == len(payload["results"]) and all("100.0%" in row for row in rows if "| ring |" in row)
