"""What each process of test_distributed.py's gloo groups runs: every case's full inputs (the same seed on every
rank), this rank's shards through the distributed API, a backward, the results unsharded. Rank 0 saves them with the
inputs for the test to compare against the reference; the checks that need every rank (bitwise repeats, the real
ring against its in-process simulation) are reduced to one flag over the group."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from datetime import timedelta
from unittest import mock

import torch
import torch.distributed as dist

from flashtriton.distributed import layout as L
from flashtriton.distributed import (
    ring_flash_attn_func,
    ring_flash_attn_varlen_func,
    shard,
    shard_varlen,
    ulysses_flash_attn_func,
    ulysses_flash_attn_varlen_func,
    unshard,
    unshard_varlen,
)
from flashtriton.distributed import steps as S
from flashtriton.distributed.checks import ring_window

NAMES = ("out", "lse", "dq", "dk", "dv")  # what a case returns
_GROUPS: dict[tuple, dict] = {}  # (world, ulysses size): this rank's groups, made by every rank in turn
TIMEOUT = timedelta(seconds=60)  # a rank stuck in a transfer fails the test instead of hanging it


@dataclass(frozen=True)
class Case:
    """One call on every rank. api: "ring", "varlen" (ring on a packed batch), "ulysses" or "ulysses-varlen". rows:
    local rows per rank (dense); documents: a packed batch's lengths in units of the layout's chunk count (2 * world
    for zigzag)."""

    name: str
    api: str
    causal: bool
    dtype: str
    layout: str = L.ZIGZAG
    heads: int = 4
    heads_k: int = 2
    head_dim: int = 16
    rows: int = 16
    documents: tuple[int, ...] = ()
    window: tuple[int, int] = (-1, -1)
    deterministic: bool = False
    ulysses: int = 1  # > 1: the ring's 2-D form, groups of this many consecutive ranks trading heads

    def __str__(self) -> str:
        return self.name

    def groups(self, world: int) -> dict:
        """The ring's group and ulysses_group of this rank (ring_flash_attn_func's 2-D form), or none."""
        return _GROUPS[(world, self.ulysses)] if self.ulysses > 1 else {}

    @property
    def packed(self) -> bool:
        return self.api in ("varlen", "ulysses-varlen")

    @property
    def simulated(self) -> bool:
        """Whether steps.simulate_* compute it (the ring's calls, without a Ulysses exchange)."""
        return self.api in ("ring", "varlen") and self.ulysses == 1

    def lengths(self, world: int) -> list[int]:
        return [n * world * L.chunks_per_rank(self.layout) for n in self.documents]


def full_inputs(case: Case, world: int, seed: int) -> dict[str, torch.Tensor]:
    """q, k, v, the output's gradient and the LSE's (the loss is <out, dout> + <lse, dlse>), and cu_seqlens."""
    generator = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    lengths = case.lengths(world)
    rows = (sum(lengths),) if case.packed else (1, case.rows * world)

    def randn(*shape, dtype=dtype):
        return torch.randn(*shape, generator=generator).to(dtype)

    x = {
        "q": randn(*rows, case.heads, case.head_dim),
        "k": randn(*rows, case.heads_k, case.head_dim),
        "v": randn(*rows, case.heads_k, case.head_dim),
        "dout": randn(*rows, case.heads, case.head_dim),
    }
    lse_shape = (case.heads, rows[0]) if case.packed else (1, case.heads, rows[1])
    x["dlse"] = randn(*lse_shape, dtype=torch.float32)
    if case.packed:
        x["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return x


def _call(case: Case, x: dict, q, k, v):
    options = dict(causal=case.causal, deterministic=case.deterministic, return_lse=True, layout=case.layout)
    if case.packed:
        longest = int(x["cu_seqlens"].diff().max())
        if case.api == "ulysses-varlen":
            return ulysses_flash_attn_varlen_func(q, k, v, x["cu_seqlens"], longest, window_size=case.window, **options)
        return ring_flash_attn_varlen_func(q, k, v, x["cu_seqlens"], longest, **options)
    if case.api == "ulysses":
        return ulysses_flash_attn_func(q, k, v, window_size=case.window, **options)
    return ring_flash_attn_func(q, k, v, window_size=case.window, **options, **case.groups(dist.get_world_size()))


def _run(case: Case, x: dict) -> dict[str, torch.Tensor]:
    """This rank's out, lse, dq, dk, dv."""
    if case.packed:
        local = {name: shard_varlen(x[name], x["cu_seqlens"], layout=case.layout) for name in ("q", "k", "v", "dout")}
        local["dlse"] = shard_varlen(x["dlse"].t(), x["cu_seqlens"], layout=case.layout).t()
    else:
        groups = case.groups(dist.get_world_size())
        local = {name: shard(x[name], layout=case.layout, **groups) for name in ("q", "k", "v", "dout")}
        local["dlse"] = shard(x["dlse"], layout=case.layout, dim=2, **groups)
    q, k, v = (local[name].clone().requires_grad_() for name in ("q", "k", "v"))
    out, lse = _call(case, x, q, k, v)
    ((out * local["dout"]).sum() + (lse * local["dlse"]).sum()).backward()
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, **local}


def _unshard(case: Case, x: dict, name: str, t: torch.Tensor) -> torch.Tensor:
    if not case.packed:
        return unshard(t, layout=case.layout, dim=2 if name == "lse" else 1, **case.groups(dist.get_world_size()))
    if name == "lse":  # (nheads, total): the packed rows are its second dim
        return unshard_varlen(t.t(), x["cu_seqlens"], layout=case.layout).t()
    return unshard_varlen(t, x["cu_seqlens"], layout=case.layout)


def _split(case: Case, x: dict, world: int, name: str) -> list[torch.Tensor]:
    """Every rank's shard of input ``name`` (the LSE's gradient along its own sequence dim)."""
    t = x[name]
    if not case.packed:
        return L.split(t, world, case.layout, dim=2 if name == "dlse" else 1)
    if name == "dlse":
        return [s.t() for s in L.split_varlen(t.t(), x["cu_seqlens"], world, case.layout)]
    return L.split_varlen(t, x["cu_seqlens"], world, case.layout)


def join(case: Case, x: dict, name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full result ``name`` from every rank's shard."""
    if not case.packed:
        return L.join(shards, case.layout, dim=2 if name == "lse" else 1)
    if name == "lse":
        return L.join_varlen([s.t() for s in shards], x["cu_seqlens"], case.layout).t()
    return L.join_varlen(shards, x["cu_seqlens"], case.layout)


def simulate(case: Case, x: dict, world: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's out, lse, dq, dk, dv from steps.simulate_forward / simulate_backward in this process."""
    params = S.partial_params(1 / math.sqrt(case.head_dim), case.deterministic)
    if case.packed:
        lengths = [n // world for n in case.lengths(world)]
        plans = [
            S.varlen_steps(world, r, lengths, case.layout, case.causal, params, x["q"].device) for r in range(world)
        ]
    else:
        left, causal = ring_window(case.window, case.causal)
        plans = [S.dense_plan(world, r, case.rows, case.layout, causal, left, params) for r in range(world)]
    shards = {name: _split(case, x, world, name) for name in ("q", "k", "v", "dout", "dlse")}
    qs = shards["q"]
    kvs = [torch.stack(pair) for pair in zip(shards["k"], shards["v"], strict=True)]
    results = S.simulate_forward(plans, qs, kvs)
    outs, lses = [o for o, _ in results], [lse for _, lse in results]
    grads = S.simulate_backward(plans, shards["dout"], shards["dlse"], qs, kvs, outs, lses)
    return [
        {"out": out, "lse": lse, "dq": dq, "dk": dkv[0], "dv": dkv[1]}
        for out, lse, (dq, dkv) in zip(outs, lses, grads, strict=True)
    ]


def _everywhere(flag: bool, device: torch.device) -> bool:
    """The flag of every rank, and-ed."""
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _no_transfer(*args, **kwargs):
    raise AssertionError("a refused call moved data before its error")


def _refusals(world: int, device: torch.device) -> dict[str, str]:
    """The errors of calls every rank makes wrongly in the same way: each must be raised before any transfer of
    data (the 2-D form's placement check gathers each rank's place in its groups first, by design), which the
    point-to-point and all-to-all calls here fail if it is not."""
    q = torch.randn(1, 2 * world, 2 * world - 1, 16, device=device)
    errors = {}
    calls = {
        "ulysses_heads": lambda: ulysses_flash_attn_func(q, q, q),
        "ring_window": lambda: ring_flash_attn_func(q, q, q, window_size=(4, 1)),
        "zigzag_rows": lambda: ring_flash_attn_func(q[:, 1:], q[:, 1:], q[:, 1:]),
        "two_d_heads": lambda: ring_flash_attn_func(q, q, q, **_GROUPS[(world, 2)]),
        "two_d_no_ring": lambda: ring_flash_attn_func(q, q, q, ulysses_group=_GROUPS[(world, 2)]["ulysses_group"]),
        "two_d_same_groups": lambda: ring_flash_attn_func(
            q, q, q, group=_GROUPS[(world, 2)]["ulysses_group"], ulysses_group=_GROUPS[(world, 2)]["ulysses_group"]
        ),
    }
    outside = dist.new_group([1])  # made by every rank; rank 0, whose refusals are saved, is not in it
    calls["not_a_member"] = lambda: ring_flash_attn_func(q, q, q, group=outside)
    calls["shard_not_a_member"] = lambda: shard(q, group=outside)
    calls["unshard_not_a_member"] = lambda: unshard(q, group=outside)
    calls["shard_varlen_not_a_member"] = lambda: shard_varlen(q[0], torch.tensor([0, q.shape[1]]), group=outside)
    if world == 4:  # a ring of ranks at different places in their Ulysses groups: 0 (first of 0, 1), 3 (second of 2, 3)
        crossed = {"group": _GROUPS[(world, "crossed")], "ulysses_group": _GROUPS[(world, 2)]["ulysses_group"]}
        calls["two_d_crossed"] = lambda: ring_flash_attn_func(q, q, q, **crossed)
    transfers = ("batch_isend_irecv", "isend", "irecv", "all_to_all_single", "all_gather")
    with contextlib.ExitStack() as stack:
        for transfer in transfers:
            stack.enter_context(mock.patch.object(dist, transfer, _no_transfer))
        for name, call in calls.items():
            try:
                call()
                errors[name] = "no error"
            except (ValueError, NotImplementedError) as exc:
                errors[name] = f"{type(exc).__name__}: {exc}"
    return errors


def _make_groups(world: int, sizes: set[int]) -> None:
    """For each Ulysses size u: groups of u consecutive ranks, and rings of the ranks at the same place in them."""
    rank = dist.get_rank()
    for u in sorted(sizes):
        for first in range(0, world, u):
            group = dist.new_group(list(range(first, first + u)))
            if first <= rank < first + u:
                _GROUPS[(world, u)] = {"ulysses_group": group}
        for place in range(u):
            group = dist.new_group(list(range(place, world, u)))
            if rank % u == place:
                _GROUPS[(world, u)]["group"] = group
    if world == 4:  # rings across places, for a refusal: {0, 3} and {1, 2}
        for ranks in ([0, 3], [1, 2]):
            group = dist.new_group(ranks)
            if rank in ranks:
                _GROUPS[(world, "crossed")] = group


def worker(rank: int, world: int, store: str, cases: list[Case], out_path: str, backend: str = "gloo") -> None:
    """backend "gloo": CPU tensors; "nccl": this rank's GPU (the inputs drawn on the CPU as for gloo, the results
    saved back there)."""
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world, timeout=TIMEOUT,
        device_id=device if backend == "nccl" else None,
    )  # fmt: skip
    _make_groups(world, {case.ulysses for case in cases if case.ulysses > 1 and world % case.ulysses == 0})
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # torch.empty gives NaN: unwritten rows would show
    saved = {}
    for seed, case in enumerate(cases):
        x = {name: t.to(device) for name, t in full_inputs(case, world, seed).items()}
        mine = _run(case, x)
        outputs = {n: _unshard(case, x, n, mine[n]).cpu() for n in NAMES}
        result = {"inputs": {name: t.cpu() for name, t in x.items()}, "outputs": outputs}
        if case.deterministic:
            again = _run(case, x)
            result["repeats"] = _everywhere(all(torch.equal(mine[n], again[n]) for n in NAMES), device)
        # on a GPU only deterministic calls repeat bit for bit (the fused backward adds dQ by atomics)
        if case.simulated and (backend == "gloo" or case.deterministic):
            simulated = simulate(case, x, world)[rank]
            result["simulated"] = _everywhere(all(torch.equal(simulated[n], mine[n]) for n in NAMES), device)
        saved[case.name] = result
    saved["refusals"] = _refusals(world, device)
    if backend == "gloo":  # shards of an empty sequence under a window: nothing to trade (not yet run on NCCL)
        empty = torch.zeros(1, 0, 2, 16, device=device)
        saved["empty_window"] = tuple(ring_flash_attn_func(empty, empty, empty, window_size=(2, 0)).shape)
    if rank == 0:
        torch.save(saved, out_path)
    dist.destroy_process_group()
