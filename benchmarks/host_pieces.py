"""The eager backward's host pieces at B1 N128 H1 D64 bf16 (the route's key, the plan replay's allocations and
launches), microseconds per call, best of 7 repeats of 5000 calls each, on the calling thread.

    PYTHONPATH=src python benchmarks/host_pieces.py        # on a GPU machine
"""

import timeit

import torch

import flashtriton
from flashtriton import ops, route, triton_backend

B, N, H, D = 1, 128, 1, 64
q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dout = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
captured = {}
orig = ops.backward


def spy(*args):
    captured.setdefault("args", args)
    return orig(*args)


ops.backward = spy
for _ in range(3):
    torch.autograd.grad(flashtriton.flash_attn_func(q, k, v), (q, k, v), dout)
ops.backward = orig
args = captured["args"]
p = args[-1]
r = route.backward(*args)
key = triton_backend._plan_key(r)
plan = triton_backend._PLANS[key]
names = dict(dout=args[0], dlse=args[1], q=args[2], k=args[3], v=args[4], out=args[5], lse=args[6])
made = plan(**names)
print("route", r)
print("allocations", [(a[0], a[1], a[3]) for a in plan.allocations])
for bound, slot_names in plan.launches:
    print(
        "launch",
        len(bound.template),
        "args,",
        len(slot_names),
        "slots:",
        slot_names,
        sum(m is not None for _, m in bound.slots),
        "descriptor maps",
    )


def t(name, stmt, n=5000):
    best = min(timeit.repeat(stmt, number=n, repeat=7, globals=globals())) / n * 1e6
    print(f"{best:8.2f} us  {name}", flush=True)


b0, n0 = plan.launches[0]
b1, n1 = plan.launches[1]
x0 = [made[nm] for nm in n0]
x1 = [made[nm] for nm in n1]
t("ops.backward", "ops.backward(*args)")
t("route.backward", "route.backward(*args)")
t("triton_backend._gradients", "triton_backend._gradients(*args[:-1], p, r)")
t("plan(**tensors)", "plan(**names)")
t("bound 0 call", "b0(x0)")
t("bound 1 call", "b1(x1)")
t("torch.empty x1", "torch.empty((1, 1, 128), dtype=torch.float32, device='cuda')")
t("template copy", "b0.template.copy()")
t("stream lookup", "b0.stream(b0.device)")
t("route._layout_key", "route._layout_key('backward', p, args[:7])")
t("tensors_layout 7", "route.tensors_layout(args[:7])")
t("ops._launchers", "ops._launchers('hopper')")
t("torch.cuda.current_device", "torch.cuda.current_device()")
t("torch.is_grad_enabled", "torch.is_grad_enabled()")
torch.cuda.synchronize()
