"""The routing table: which kernels serve which calls, for a fixed set of calls on each GPU's tables.

tests/route_table.txt holds the expected routes; a change in routing is a diff of it. After an intended change:
    PYTHONPATH=src python tests/test_route.py > tests/route_table.txt
"""

import itertools

import torch

from flashtriton import route
from flashtriton.params import AttentionParams
from flashtriton.validation import check_cu_seqlens

TABLE = __file__.replace("test_route.py", "route_table.txt")

MASKS = {
    "dense": {},
    "causal": dict(window_right=0),
    "causal-window-1024": dict(window_left=1024, window_right=0),
    "window-128-128": dict(window_left=128, window_right=128),
    "softcap": dict(softcap=30.0),
    "alibi": dict(alibi_slopes=torch.ones(1, 16)),
    "dropout": dict(dropout_p=0.1, dropout_seed=torch.tensor([1])),
}


def _tensors(batch, n_q, n_k, head_dim, dtype, layout="bnhd", heads=16, heads_k=16):
    """q, k, v on the meta device (shapes, strides and dtypes are what routing reads)."""

    def make(n, h):
        if layout == "bhnd":  # a model's (B, H, N, D) storage seen as (B, N, H, D)
            return torch.empty(batch, h, n, head_dim, device="meta", dtype=dtype).transpose(1, 2)
        return torch.empty(batch, n, h, head_dim, device="meta", dtype=dtype)

    return make(n_q, heads), make(n_k, heads_k), make(n_k, heads_k)


def _row(name: str, gpu: str, q, k, v, params: AttentionParams) -> str:
    forward = route.forward(q, k, v, params, gpu=gpu)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device="meta")
    backward = route.backward(q, lse, q, k, v, q, lse, params, gpu=gpu)
    return f"{gpu:5} {name:52} fwd: {forward}\n{'':58} bwd: {backward}"


def _varlen(lengths: list[int], head_dim: int, **options) -> tuple:
    starts = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    total, longest = int(starts[-1]), max(lengths)
    check_cu_seqlens(starts, starts, total, total, longest, longest)  # validation's host read, which routing reads
    q = torch.empty(total, 16, head_dim, device="meta", dtype=torch.bfloat16)
    params = AttentionParams(head_dim**-0.5, cu_seqlens_q=starts, cu_seqlens_k=starts, max_seqlen_q=longest,
                             max_seqlen_k=longest, **options)  # fmt: skip
    return q, params


def table() -> str:
    rows = []
    for gpu, head_dim, (mask, options), n in itertools.product(
        ("sm90", "cuda"), (64, 96, 128, 256), MASKS.items(), (512, 1000, 4096, 16384)
    ):
        q, k, v = _tensors(16384 // n, n, n, head_dim, torch.bfloat16)
        rows.append(_row(f"d{head_dim} {mask} n{n}", gpu, q, k, v, AttentionParams(head_dim**-0.5, **options)))
    for head_dim, n in itertools.product((64, 128, 256), (1024, 8192)):
        causal = AttentionParams(head_dim**-0.5, window_right=0)
        for name, q, k, v, params in (
            ("fp16", *_tensors(2, n, n, head_dim, torch.float16), causal),
            ("fp32", *_tensors(2, n, n, head_dim, torch.float32), causal),
            ("bhnd view", *_tensors(2, n, n, head_dim, torch.bfloat16, "bhnd"), causal),
            ("gqa 16/4", *_tensors(2, n, n, head_dim, torch.bfloat16, heads_k=4), causal),
            ("q shorter", *_tensors(2, n // 2, n, head_dim, torch.bfloat16), causal),
            ("deterministic", *_tensors(2, n, n, head_dim, torch.bfloat16),
             AttentionParams(head_dim**-0.5, window_right=0, deterministic=True)),
            ("sinks", *_tensors(2, n, n, head_dim, torch.bfloat16),
             AttentionParams(head_dim**-0.5, window_right=0, sinks=torch.zeros(16, device="meta"))),
        ):  # fmt: skip
            rows.append(_row(f"d{head_dim} causal n{n} {name}", "sm90", q, k, v, params))
        for name, lengths in (("whole tiles", [n // 2, n // 4, n // 4]), ("ragged", [n // 2 - 3, n // 4 + 3, n // 4])):
            q, params = _varlen(lengths, head_dim, window_right=0)
            rows.append(_row(f"d{head_dim} causal varlen {name} {n}", "sm90", q, q, q, params))
        for name, n_q, n_k in (("q shorter", n // 2, n), ("q longer", n, n // 2 - 3)):  # no mask
            q, k, v = _tensors(2, n_q, n_k, head_dim, torch.bfloat16)
            rows.append(_row(f"d{head_dim} cross {name} {n}", "sm90", q, k, v, AttentionParams(head_dim**-0.5)))
    # flash_attn_with_kvcache's decode kernels: one token per sequence, 32 query heads, splits for an H100's 132 SMs
    for gpu, (batch, heads_k, capacity, head_dim) in itertools.product(
        ("sm90", "cuda"),
        ((1, 8, 8192, 128), (8, 8, 32768, 128), (64, 8, 4096, 128), (4, 1, 512, 64), (2, 4, 2048, 256)),
    ):
        q = torch.empty(batch, 1, 32, head_dim, device="meta", dtype=torch.bfloat16)
        decode = route.decode(q, capacity, heads_k, 0, gpu=gpu, sms=132)
        rows.append(f"{gpu:5} {f'decode d{head_dim} b{batch} hkv{heads_k} cache{capacity}':52} dec: {decode}")
    return "\n".join(rows) + "\n"


def test_routing_table_unchanged():
    with open(TABLE) as f:
        expected = f.read()
    got = table()
    if got != expected:
        changed = [f"- {a}\n+ {b}" for a, b in zip(expected.splitlines(), got.splitlines(), strict=False) if a != b]
        raise AssertionError(
            "routing changed; if intended, regenerate tests/route_table.txt (see this file's docstring):\n"
            + "\n".join(changed[:20])
        )


def test_cpu_tensors_take_the_torch_path(monkeypatch):
    monkeypatch.setenv(route.BACKEND_ENV, "auto")
    q = torch.empty(1, 8, 2, 16)
    assert route.forward(q, q, q, AttentionParams(0.25)).family == route.TORCH
    assert route.forward(q[:, :0], q, q, AttentionParams(0.25)).family == route.NONE


if __name__ == "__main__":
    print(table(), end="")
