"""Ring attention's error against one GPU's, both against the fp64 reference.

    PYTHONPATH=src torchrun --nproc-per-node 4 benchmarks/ring_error.py

Zigzag shards of one sequence (N = 8192, D = 128, bf16; heads 4/4 and GQA 8/2; causal and not): the ring's out,
dq, dk, dv (all-gathered) and flash_attn_func's on the whole sequence, each max error against the fp64 reference;
rank 0 prints the ring's error, the single GPU's and their ratio. Needs one GPU per rank (NCCL).
"""

import torch
import torch.distributed as dist

import flashtriton
from flashtriton.distributed import ring_flash_attn_func, shard, unshard
from flashtriton.reference import attention_reference

N, HEAD_DIM = 8192, 128


def max_error(actual: torch.Tensor, exact: torch.Tensor) -> float:
    return (actual.double() - exact.double()).abs().max().item()


def main() -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    for causal in (True, False):
        for heads, heads_k in ((4, 4), (8, 2)):
            torch.manual_seed(0)  # every rank draws the same full inputs
            q = torch.randn(1, N, heads, HEAD_DIM, device=device, dtype=torch.bfloat16)
            k, v = (torch.randn(1, N, heads_k, HEAD_DIM, device=device, dtype=torch.bfloat16) for _ in "kv")
            dout = torch.randn_like(q)
            exact_in = [x.double().requires_grad_() for x in (q, k, v)]
            exact = attention_reference(*exact_in, causal=causal)[0]
            exact = (exact, *torch.autograd.grad(exact, exact_in, dout.double()))
            whole = [x.clone().requires_grad_() for x in (q, k, v)]
            single = flashtriton.flash_attn_func(*whole, causal=causal)
            single = (single, *torch.autograd.grad(single, whole, dout))
            local = [shard(x).requires_grad_() for x in (q, k, v)]
            ring = ring_flash_attn_func(*local, causal=causal)
            ring = (ring.detach(), *torch.autograd.grad(ring, local, shard(dout)))
            ring = [unshard(x.contiguous()) for x in ring]
            if rank == 0:
                parts = []
                for name, r, s, e in zip(("out", "dq", "dk", "dv"), ring, single, exact, strict=True):
                    r_err, s_err = max_error(r, e), max_error(s, e)
                    parts.append(f"{name} {r_err:.2e} / {s_err:.2e} = {r_err / s_err:.2f}")
                print(f"causal={causal} heads {heads}/{heads_k} world {world} (ring / one GPU): " + "  ".join(parts))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
