"""flashtriton.launch: its launch key separates whatever Triton specialises a kernel on; a Plan replays a call's
allocations and launches with a later call's tensors; on a Hopper GPU repeated calls launch without Triton's
per-call binding, replay their plans, and reproduce the first call's results."""

import itertools
from types import SimpleNamespace

import pytest
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.jit import JITFunction

from flashtriton import flash_attn_func, launch, tables, triton_backend
from helpers import hopper, poison_empty


def _descriptors() -> list[launch.Descriptor]:
    x = torch.randn(2, 256, 4, 64, dtype=torch.bfloat16)
    return [
        triton_backend._gluon_view(x, 64),
        triton_backend._gluon_view(x[:, 1:], 64),  # another base and shape, the same specialisation
        triton_backend._gluon_view(x, 128),
        triton_backend._gluon_view(x.half(), 64),
        triton_backend._gluon_view(x.float(), 64, 32),
        triton_backend._gluon_rows(torch.randn(300), 64),
    ]


def _values() -> list:
    ints = [0, 1, 2, 15, 16, 17, 48, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**32, 2**63 - 16, 2**63, 2**64 - 16]
    dtypes, offsets = (torch.bfloat16, torch.float32), (0, 1, 8)
    tensors = [torch.empty(64, dtype=dtype)[offset:] for dtype in dtypes for offset in offsets]
    return [*ints, True, False, None, 0.5, 1.0, *tensors, *_descriptors()]


def _triton(x):
    if isinstance(x, launch.Descriptor):
        x = x.gluon()
    return native_specialize_impl(CUDABackend, x, False, True, True)


def test_launch_key_separates_what_triton_specialises_on():
    values = _values()
    same = 0
    for a, b in itertools.combinations(values, 2):
        if launch._spec(a) == launch._spec(b) and type(a) is type(b):
            same += 1
            assert _triton(a) == _triton(b), (a, b)
    assert same > 10  # the check compared something


def test_launch_key_refuses_unknown_arguments():
    with pytest.raises(TypeError, match="no launch key"):
        launch._spec([1, 2])


class _Bound:
    """Stands for a launch.Bound: keeps the tensors each launch got."""

    def __init__(self):
        self.calls = []

    def __call__(self, tensors):
        self.calls.append(tensors)


def test_plan_replays_allocations_and_launches_with_the_new_calls_tensors():
    q, k = torch.randn(2, 3), torch.randn(2, 3)
    first, second = _Bound(), _Bound()
    recorder = launch.Recorder(q=q, k=k)
    out = recorder.empty("out", (2, 5), torch.float16, torch.device("cpu"))
    sums = recorder.empty("sums", [4], torch.float32, torch.device("cpu"))
    recorder.add((first, [k, out, q]))
    recorder.add((second, [sums, out]))
    plan = recorder.plan()

    q2, k2 = torch.randn(2, 3), torch.randn(2, 3)
    made = plan(q=q2, k=k2)
    assert made["out"].shape == (2, 5) and made["out"].dtype == torch.float16 and made["out"] is not out
    assert made["sums"].shape == (4,) and made["sums"].dtype == torch.float32 and made["sums"] is not sums
    assert first.calls == [[k2, made["out"], q2]]
    assert second.calls == [[made["sums"], made["out"]]]


def test_a_call_is_not_replayable_if_a_launch_read_another_tensor():
    q, k = torch.randn(2, 3), torch.randn(2, 3)
    cases = {
        "a copy": lambda recorder: recorder.add((_Bound(), [q.clone()])),
        "no bound": lambda recorder: recorder.add((None, [])),
    }
    for why, launch_it in cases.items():
        recorder = launch.Recorder(q=q, k=k)
        launch_it(recorder)
        assert recorder.plan() is None, why


def test_a_tensor_passed_twice_fills_its_slots_by_its_first_name():
    q, kv = torch.randn(2, 3), torch.randn(2, 3)
    bound = _Bound()
    recorder = launch.Recorder(q=q, k=kv, v=kv)  # the plan's key holds that k is v
    recorder.add((bound, [kv, q, kv]))
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    recorder.plan()(q=a, k=b, v=b)
    assert bound.calls == [[b, a, b]]


def test_a_bound_launch_fills_its_slots_with_addresses_and_maps(monkeypatch):
    """Tensors reach the C launcher as their addresses (it would otherwise query the driver about each pointer),
    descriptors' bases as their TMA maps; the stream is the current one at each launch."""
    streams = iter([7, 8])
    monkeypatch.setattr(launch, "driver", SimpleNamespace(active=SimpleNamespace(
        get_current_stream=lambda device: next(streams))))  # fmt: skip
    launched = []
    template = [2, 1, 1, None, "function", None, 5, None]
    bound = launch.Bound(lambda *args: launched.append(args), template, [(5, None), (7, lambda x: ("map", x))], 0)
    a, b = torch.randn(3), torch.randn(4)
    bound([a, b])
    bound([b, a])
    assert launched == [(2, 1, 1, 7, "function", a.data_ptr(), 5, ("map", b)),
                        (2, 1, 1, 8, "function", b.data_ptr(), 5, ("map", a))]  # fmt: skip
    assert template == [2, 1, 1, None, "function", None, 5, None]  # each launch fills a copy


class _Compiled:
    """Stands for a compiled kernel: its registers per thread, and the launches it was given."""

    def __init__(self, n_regs: int):
        self.n_regs, self.function, self.packed_metadata, self.launches = n_regs, None, None, []

    def _init_handles(self):
        pass

    def run(self, *args):
        self.launches.append(args)


class _Kernel:
    """Stands for a JITFunction with one tensor argument, which takes ``need`` registers without a cap."""

    def __init__(self, need: int):
        self.arg_names, self.params = ["x"], [SimpleNamespace(name="x", is_constexpr=False, has_default=False)]
        self.need, self.compiles = need, []

    def run(self, *args, grid, warmup, maxnreg=None):
        self.compiles.append((warmup, maxnreg))
        return _Compiled(self.need if maxnreg is None else min(self.need, maxnreg))


@pytest.mark.parametrize("need,cap", [(114, None), (128, None), (160, 128)])
def test_a_register_cap_holds_only_where_the_kernel_takes_more(need, cap, monkeypatch):
    monkeypatch.setattr(launch, "PRIVATE_API_OK", True)
    monkeypatch.setattr(launch, "driver", SimpleNamespace(active=SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda device: 0)))  # fmt: skip
    kernel = _Kernel(need)
    launcher = launch.Launcher(kernel)
    x = torch.empty(4)
    for _ in range(3):
        launcher[(1,)](x, maxnreg=launch.RegisterCap(128))
    # compiled without the cap to learn its registers, then launched with the cap only where it needed more; later
    # launches of that key reuse the choice without compiling again
    assert kernel.compiles == [(True, None), (False, cap)]
    (compiled,) = launcher.kernels.values()
    assert len(compiled.launches) == 2


def test_a_register_cap_holds_where_its_need_cannot_be_learnt(monkeypatch):
    """Without Triton's private API nothing is kept, so each call would compile twice to learn its registers: the cap
    holds; so it does where the uncapped compile is a background one's future."""
    monkeypatch.setattr(launch, "driver", SimpleNamespace(active=SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda device: 0)))  # fmt: skip
    x = torch.empty(4)
    monkeypatch.setattr(launch, "PRIVATE_API_OK", False)
    kernel = _Kernel(114)
    for _ in range(2):
        launch.Launcher(kernel)[(1,)](x, maxnreg=launch.RegisterCap(128))
    assert kernel.compiles == [(False, 128)] * 2
    monkeypatch.setattr(launch, "PRIVATE_API_OK", True)
    kernel = _Kernel(114)
    future = kernel.run
    kernel.run = lambda *a, warmup, **kw: object() if warmup else future(*a, warmup=warmup, **kw)
    launch.Launcher(kernel)[(1,)](x, maxnreg=launch.RegisterCap(128))
    assert kernel.compiles == [(False, 128)]


class _Racing(dict):
    """A table into which another thread inserts between iter() and next() the first time: the iterator raises."""

    raced = False

    def __iter__(self):
        entries = super().__iter__()
        if not self.raced:
            self.raced = True
            self[object()] = "another thread's"
        return entries


def test_a_full_table_drops_its_oldest_entry_and_survives_other_threads():
    table = {}
    for i in range(4):
        assert tables.put(table, i, str(i), limit=3) == str(i)
    assert list(table) == [1, 2, 3]
    racing = _Racing({0: "0", 1: "1"})
    tables.put(racing, 2, "2", limit=2)  # looked up again past the other thread's insert
    assert racing.raced and len(racing) == 2 and racing[2] == "2"


@hopper
def test_hopper_repeat_calls_skip_tritons_binding(monkeypatch):
    monkeypatch.setattr(triton_backend, "_plan_key", lambda *args: None)  # Launcher's own path, without plans
    runs = []
    run = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **kw: runs.append(self.fn.__name__) or run(self, *a, **kw))

    def step():
        # fresh tensors each call (new addresses), 512 keys: the Gluon forward, dQ and dK/dV kernels
        torch.manual_seed(0)
        shapes = [(2, 512, h, 128) for h in (8, 2, 2)]
        q, k, v = (torch.randn(s, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s in shapes)
        out = flash_attn_func(q, k, v, causal=True)
        out.backward(torch.randn_like(out))
        return out, q.grad, k.grad, v.grad

    first = step()  # compiles, or finds the kernels an earlier test compiled
    runs.clear()
    for _ in range(3):
        again = step()
        assert runs == []
        for x, y in zip(first, again, strict=True):
            assert torch.equal(x, y)


@hopper
@pytest.mark.parametrize(
    "head_dim, seqlen, causal",
    [(128, 512, True), (64, 512, False), (256, 256, True)],  # backward: dQ's own pass; fused; fused, D split
)
def test_hopper_plans_replay_the_first_calls_launches(head_dim, seqlen, causal, monkeypatch):
    monkeypatch.setattr(triton_backend, "_PLANS", {})
    replays = []
    replay = launch.Plan.__call__
    monkeypatch.setattr(launch.Plan, "__call__", lambda self, **kw: replays.append(1) or replay(self, **kw))
    poison_empty(monkeypatch)
    planned_key = triton_backend._plan_key

    def step(seed: int, layout: str, plans: bool = True, grad: str = "fresh"):
        monkeypatch.setattr(triton_backend, "_plan_key", planned_key if plans else lambda *args: None)
        torch.manual_seed(seed)
        heads = (4, 2, 2)
        if layout == "packed":  # q, k, v as views of one (batch, seqlen, 3, heads, head_dim) tensor: other strides
            qkv = torch.randn(2, seqlen, 3, 2, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            q, k, v = qkv.unbind(2)
            leaves = [qkv]
        else:
            q, k, v = (torch.randn(2, seqlen, h, head_dim, device="cuda", dtype=torch.bfloat16) for h in heads)
            if layout == "k is v":
                v = k
            leaves = [x.requires_grad_() for x in {id(x): x for x in (q, k, v)}.values()]
        out = flash_attn_func(q, k, v, causal=causal)
        # a backward's plan is one layout's, the gradients' included: dO strided as a view of (B, H, N, D), or q
        # itself (one tensor in two of the plan's slots)
        if grad == "strided":
            dout = torch.randn(2, 4, seqlen, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        else:
            dout = q if grad == "q" else torch.randn_like(out)
        out.backward(dout)
        return [out, *(x.grad for x in leaves)]

    for layout in ("plain", "packed"):  # what the backend caches for the process: a causal forward's schedule
        step(2, layout, plans=False)
    allocated = torch.cuda.memory_allocated()
    calls = [("plain", "fresh"), ("plain", "strided"), ("plain", "q"), ("packed", "fresh"), ("k is v", "fresh")]
    for layout, grad in calls:
        replays.clear()
        step(0, layout, grad=grad)  # records the backward's plan, and the forward's at a layout's first call
        forward_kept = grad != "fresh"  # (each layout's first call has fresh gradients)
        assert len(replays) == forward_kept
        replayed = step(1, layout, grad=grad)  # other inputs, other addresses
        assert len(replays) == forward_kept + 2
        unplanned = step(1, layout, plans=False, grad=grad)
        for i, (a, b) in enumerate(zip(replayed, unplanned, strict=True)):
            assert not a.isnan().any(), (layout, grad, i)
            if i == 1 and head_dim != 128:  # dq of the fused kernels: its shares are added up in no fixed order
                torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)
            else:
                assert torch.equal(a, b), (layout, grad, i)
    assert len(triton_backend._PLANS) == 3 + len(calls)  # a plan per forward layout and per backward one
    del replayed, unplanned, a, b
    assert torch.cuda.memory_allocated() == allocated  # the plans keep no tensor of the calls they came from
