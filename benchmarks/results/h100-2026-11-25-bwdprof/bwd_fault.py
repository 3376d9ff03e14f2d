"""The portable backward at a forced BackwardConfig (NOTES 65's fault). argv: B H causal softcap
bm_kv bn_kv bm_q bn_q warps stages_kv stages_q tma warps_q"""

import sys

import torch

from flashtriton import flash_attn_func
from flashtriton.kernels import config
from flashtriton.reference import attention_reference

a = sys.argv[1:]
B, H, causal, softcap = int(a[0]), int(a[1]), a[2] == "1", float(a[3])
cfg = config.BackwardConfig(
    *map(int, a[4:8]), int(a[8]), int(a[9]), int(a[10]), tma=a[11] == "1", warps_q=int(a[12]) if len(a) > 12 else None
)
config.backward_config = lambda *x, **k: cfg
torch.manual_seed(0)
q, k, v = (torch.randn(B, 2048, H, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
out = flash_attn_func(q, k, v, causal=causal, softcap=softcap)
g = torch.randn_like(out)
out.backward(g)
dq = q.grad.clone()
q.grad = None
ref = attention_reference(q, k, v, causal=causal, compute_dtype=torch.float32, softcap=softcap)[0]
ref.backward(g.to(ref.dtype))
torch.cuda.synchronize()
err = ((dq.float() - q.grad.float()).norm() / q.grad.float().norm()).item()
print(f"ok {' '.join(a)} dq_rel_err {err:.2e}", flush=True)
