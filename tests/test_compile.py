"""torch.compile(fullgraph=True) traces every feature through the custom ops: no graph break, the eager numbers.

CPU targets trace with aot_eager (inductor on CPU needs a C++ toolchain and minutes; aot_eager traces the same
graph), the GPU with inductor.
"""

import pytest
import torch
import triton
import triton.language as tl

import flashtriton as ft
from flashtriton import ops, schema
from flashtriton.params import AttentionParams
from helpers import TARGETS

NOT_INTERPRETED = [t for t in TARGETS if t.name != "cpu-interp"]  # the tracing, not the kernels, is under test


@triton.jit
def _distance_bias(score, b, h, q_idx, kv_idx):
    return score - 0.05 * (q_idx - kv_idx).to(tl.float32)


@triton.jit
def _unit_grad(score, b, h, q_idx, kv_idx):
    return 1.0


def _inputs(device, n=37, heads=4, heads_k=2, dim=16, batch=2):
    q = torch.randn(batch, n, heads, dim, device=device, requires_grad=True)
    k, v = (torch.randn(batch, n, heads_k, dim, device=device, requires_grad=True) for _ in range(2))
    return q, k, v


def _cu_seqlens(device):
    return torch.tensor([0, 5, 37, 74], dtype=torch.int32, device=device)


def _packed(device):
    cu = _cu_seqlens(device)
    q, k, v = (x.detach().reshape(-1, *x.shape[2:]).requires_grad_() for x in _inputs(device))
    return q, k, v, cu


def _case(name, device):
    """(loss function of the inputs, the inputs) for one feature."""
    q, k, v = _inputs(device)
    dense = (q, k, v)
    if name == "causal-gqa":
        return lambda q, k, v: ft.flash_attn_func(q, k, v, causal=True), dense
    if name == "window-softcap-alibi":
        slopes = torch.rand(4, device=device)
        return lambda q, k, v: ft.flash_attn_func(
            q, k, v, window_size=(7, 3), softcap=5.0, alibi_slopes=slopes, softmax_scale=0.3
        ), dense
    if name == "dropout":
        return lambda q, k, v: ft.flash_attn_func(q, k, v, dropout_p=0.2), dense
    if name == "dropout-probs":  # the probabilities, a constant of the loss, must come out of the graph the same
        return lambda q, k, v: _with_probs(ft.flash_attn_func(q, k, v, dropout_p=0.2, return_attn_probs=True)), dense
    if name == "lse-loss":
        return lambda q, k, v: ft.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[1], dense
    if name == "score_mod":
        mod = ft.Mod(_distance_bias, grad=_unit_grad)
        return lambda q, k, v: ft.flash_attn_func(q, k, v, score_mod=mod), dense
    if name == "mask_mod":
        mask = ft.and_masks(ft.causal_mask(), ft.sliding_window_mask(9))  # mods are made outside a traced function
        return lambda q, k, v: ft.flash_attn_func(q, k, v, mask_mod=mask), dense
    if name == "block_mask":
        block_mask = ft.create_block_mask(ft.causal_mask(), None, None, 37, 37, device=device, block_size=16)
        return lambda q, k, v: ft.flash_attn_func(q, k, v, block_mask=block_mask), dense
    if name == "qkvpacked":
        qkv = torch.randn(2, 37, 3, 4, 16, device=device, requires_grad=True)
        return lambda qkv: ft.flash_attn_qkvpacked_func(qkv, causal=True), (qkv,)
    if name == "kvpacked":
        kv = torch.randn(2, 37, 2, 2, 16, device=device, requires_grad=True)
        return lambda q, kv: ft.flash_attn_kvpacked_func(q, kv, window_size=(5, -1)), (q, kv)
    q, k, v, cu = _packed(device)
    if name == "varlen":
        return lambda q, k, v: ft.flash_attn_varlen_func(q, k, v, cu, cu, 37, 37, causal=True, softcap=3.0), (q, k, v)
    if name == "varlen-qkvpacked":
        qkv = torch.randn(74, 3, 4, 16, device=device, requires_grad=True)
        return lambda qkv: ft.flash_attn_varlen_qkvpacked_func(qkv, cu, 37, causal=True), (qkv,)
    if name == "varlen-kvpacked":
        kv = torch.randn(74, 2, 2, 16, device=device, requires_grad=True)
        return lambda q, kv: ft.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 37, 37, window_size=(4, 4)), (q, kv)
    raise ValueError(name)


def _with_probs(result):
    out, _, probs = result
    return out * probs.sum()


FEATURES = [
    "causal-gqa", "window-softcap-alibi", "dropout", "dropout-probs", "lse-loss", "score_mod", "mask_mod",
    "block_mask", "qkvpacked", "kvpacked", "varlen", "varlen-qkvpacked", "varlen-kvpacked",
]  # fmt: skip
# The interpreter runs a kernel in seconds: one traced case per kernel feature family there.
INTERPRETER_FEATURES = {"window-softcap-alibi", "score_mod", "varlen", "dropout"}


def _compiler(device: str) -> str:
    return "inductor" if device == "cuda" else "aot_eager"


def _params():
    return [
        pytest.param(target, name, id=f"{target}-{name}")
        for target in TARGETS
        for name in FEATURES
        if target.name != "cpu-interp" or name in INTERPRETER_FEATURES
    ]


@pytest.mark.parametrize(("backend", "feature"), _params(), indirect=["backend"])
def test_fullgraph_matches_eager(backend, feature, monkeypatch):
    torch._dynamo.reset()
    loss_of, inputs = _case(feature, backend.device)

    def step(*inputs):
        return loss_of(*inputs).float().square().sum()

    torch.manual_seed(1)  # the dropout seed is drawn from torch's generator, in the graph and eagerly alike
    eager = step(*inputs)
    grads_eager = torch.autograd.grad(eager, inputs)
    torch.manual_seed(1)
    # inductor draws random numbers its own way unless told to fall back to eager's (the dropout seed is one)
    monkeypatch.setattr(torch._inductor.config, "fallback_random", True)
    compiled = torch.compile(step, fullgraph=True, backend=_compiler(backend.device))(*inputs)
    grads = torch.autograd.grad(compiled, inputs)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    for grad, grad_eager in zip(grads, grads_eager, strict=True):
        assert grad.isfinite().all()
        torch.testing.assert_close(grad, grad_eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", TARGETS, ids=str, indirect=True)
def test_traced_inference_call_writes_no_lse(backend, monkeypatch):
    """Without a gradient and without return_attn_probs, the traced op asks its kernels for no LSE."""
    torch._dynamo.reset()
    seen = []
    forward = ops.forward
    monkeypatch.setattr(ops, "forward", lambda q, k, v, p: seen.append(p.write_lse) or forward(q, k, v, p))
    q, k, v = (x.detach() for x in _inputs(backend.device))
    step = torch.compile(lambda q, k, v: ft.flash_attn_func(q, k, v, causal=True), fullgraph=True,
                         backend=_compiler(backend.device))  # fmt: skip
    with torch.no_grad():
        out = step(q, k, v)
    assert seen == [False]  # the traced call's own (before the eager call below adds its)
    torch.testing.assert_close(out, ft.flash_attn_func(q, k, v, causal=True))


@triton.jit
def _bare_causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def test_a_bare_jit_mask_mod_inside_a_trace_says_to_make_its_mod_outside():
    torch._dynamo.reset()
    q, k, v = (x.detach() for x in _inputs("cpu"))
    step = torch.compile(lambda q, k, v: ft.flash_attn_func(q, k, v, mask_mod=_bare_causal), fullgraph=True,
                         backend="aot_eager")  # fmt: skip
    message = r"flashtriton.Mod\(fn\), made outside the compiled function"
    if torch.torch_version.TorchVersion(torch.__version__) < "2.13":  # 2.11's dynamo refuses isinstance() of a kernel
        message += r"|isinstance\(\) cannot determine type of argument"  # first, with its own message
    with pytest.raises(Exception, match=message):
        step(q, k, v)
    mod = ft.Mod(_bare_causal)
    made_outside = torch.compile(lambda q, k, v: ft.flash_attn_func(q, k, v, mask_mod=mod), fullgraph=True,
                                 backend="aot_eager")  # fmt: skip
    torch.testing.assert_close(made_outside(q, k, v), ft.flash_attn_func(q, k, v, causal=True))


@pytest.mark.parametrize("backend", NOT_INTERPRETED, ids=str, indirect=True)
def test_new_lengths_do_not_recompile_without_end(backend):
    """A packed batch's max_seqlen changes from step to step: the op takes it as a SymInt, so a fullgraph compile
    does not recompile per value (it failed past dynamo's recompile limit, 8); dynamic=True traces the default
    softcap and a softmax_scale argument (math.isfinite on a traced float had refused them)."""
    torch._dynamo.reset()
    varlen = torch.compile(ft.flash_attn_varlen_func, fullgraph=True, backend=_compiler(backend.device))
    q, k, v = (torch.randn(80, 2, 16, device=backend.device) for _ in range(3))
    for longest in range(20, 30):
        cu = torch.tensor([0, longest, 80], dtype=torch.int32, device=backend.device)
        out = varlen(q, k, v, cu, cu, 80 - longest, 80 - longest, causal=True)
        torch.testing.assert_close(out, ft.flash_attn_varlen_func(q, k, v, cu, cu, 80 - longest, 80 - longest,
                                                                  causal=True))  # fmt: skip

    def scaled(q, k, v, scale):
        return ft.flash_attn_func(q, k, v, softmax_scale=scale, causal=True)

    dense = torch.compile(scaled, fullgraph=True, dynamic=True, backend=_compiler(backend.device))
    for n in (24, 40):
        q, k, v = (torch.randn(1, n, 2, 16, device=backend.device) for _ in range(3))
        torch.testing.assert_close(dense(q, k, v, 0.3), scaled(q, k, v, 0.3))


@pytest.mark.parametrize("backend", TARGETS, ids=str, indirect=True)
def test_one_schema_field_end_to_end(backend):
    """A field of AttentionParams reaches the kernels through the op's schema: empty_lse, the LSE of a row that
    sees no key (+inf for flash_attn's final result, -inf for a partial one that a merge combines)."""
    dtype = torch.bfloat16 if backend.device == "cuda" else torch.float32
    q, k, v = (torch.randn(1, 6, 2, 16, device=backend.device, dtype=dtype) for _ in range(3))
    k, v = k[:, :3], v[:, :3]
    params = AttentionParams(0.25, window_right=0, empty_lse=float("-inf"))  # causal, bottom-right aligned
    assert "float empty_lse" in schema.SIGNATURE
    assert schema.from_schema(schema.to_schema(params)) == params
    out, lse = torch.ops.flashtriton.attention_forward(q, k, v, *schema.to_schema(params))
    empty = (
        torch.arange(6, device=backend.device) + k.shape[1] - q.shape[1] < 0
    )  # query i sees keys j <= i - 3: rows 0..2 see none
    assert empty.sum() == 3
    assert torch.isneginf(lse[:, :, empty]).all() and lse[:, :, ~empty].isfinite().all()
    assert (out[:, empty] == 0).all()


def test_dropout_probabilities_trace_as_one_op():
    """return_attn_probs' probabilities with dropout trace as their op, not as Philox's integer rounds, which inductor
    fused into one expression that grew exponentially (a compile that did not end)."""
    q, k, v = _inputs("cpu")
    ops_seen = []

    def record(graph, inputs):
        ops_seen.extend(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
        return graph.forward

    call = torch.compile(lambda q, k, v: ft.flash_attn_func(q, k, v, dropout_p=0.2, return_attn_probs=True),
                         fullgraph=True, backend=record)  # fmt: skip
    torch._dynamo.reset()
    out, _, probs = call(q, k, v)
    assert any("dropped_probs" in name for name in ops_seen) and not any("xor" in name for name in ops_seen)
    kept = torch.where(torch.signbit(probs), 0.0, probs) / 0.8  # the probabilities the output was made of
    torch.testing.assert_close(torch.einsum("bhij,bjhd->bihd", kept, v.repeat_interleave(2, 2)), out.detach())


def test_opcheck():
    """torch.library's own consistency checks of the fake, autograd and schema registrations."""
    q, k, v = (torch.randn(1, 9, 2, 16, requires_grad=True) for _ in range(3))
    dense = AttentionParams(0.25, window_left=3, window_right=0, softcap=5.0, alibi_slopes=torch.rand(1, 2),
                            dropout_p=0.1, dropout_seed=torch.tensor([1234]))  # fmt: skip
    torch.library.opcheck(torch.ops.flashtriton.attention_forward.default, (q, k, v, *schema.to_schema(dense)))
    cu_seqlens = torch.tensor([0, 4, 9], dtype=torch.int32)
    packed = [x[0].detach().requires_grad_() for x in (q, k, v)]
    varlen = AttentionParams(0.25, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=5, max_seqlen_k=5)
    torch.library.opcheck(torch.ops.flashtriton.attention_forward.default, (*packed, *schema.to_schema(varlen)))
    wide = AttentionParams(0.25, window_right=0, fp32_results=True)  # out (and the backward's dq, dk, dv) in fp32
    bf16 = [x.detach().to(torch.bfloat16).requires_grad_() for x in (q, k, v)]
    torch.library.opcheck(torch.ops.flashtriton.attention_forward.default, (*bf16, *schema.to_schema(wide)))
    inputs = [x.detach() for x in (q, k)]
    torch.library.opcheck(torch.ops.flashtriton.dropped_probs.default, (*inputs, *schema.to_schema(dense)))


@pytest.mark.parametrize("backend", [t for t in TARGETS if t.name != "cpu-interp"], ids=str, indirect=True)
def test_fp32_results_trace_as_fp32(backend):
    """A traced call that asks for fp32 results: the ops' fake implementations report fp32 out, dq, dk, dv for bf16
    inputs, and the compiled graph gives the eager numbers (the interpreter's kernels: test_fullgraph_matches_eager's
    and test_attention's)."""
    torch._dynamo.reset()
    q, k, v = (x.detach().to(torch.bfloat16) for x in _inputs(backend.device))
    fields = schema.to_schema(AttentionParams(0.25, window_right=0, fp32_results=True))

    def step(q, k, v):
        out, lse = torch.ops.flashtriton.attention_forward(q, k, v, *fields)
        dout = out.to(q.dtype)  # the backward as a ring runs it: the merged out in the inputs' dtype
        return out, *torch.ops.flashtriton.attention_backward(dout, lse.cos(), q, k, v, dout, lse, *fields)[:3]

    with torch._subclasses.FakeTensorMode() as mode:
        fake = step(*(mode.from_tensor(x) for x in (q, k, v)))
    assert [x.dtype for x in fake] == [torch.float32] * 4
    compiled = torch.compile(step, fullgraph=True, backend=_compiler(backend.device))(q, k, v)
    for x, eager in zip(compiled, step(q, k, v), strict=True):
        assert x.dtype == torch.float32
        torch.testing.assert_close(x, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", NOT_INTERPRETED, ids=str, indirect=True)
def test_flop_counter_counts_as_it_counts_sdpa(backend):
    """FlopCounterMode counts an eager fwd+bwd through the ops as torch counts SDPA's: every (query, key) pair, per
    sequence of a varlen call, 2 (d + dv) forward and 2 (3 d + 2 dv) backward per pair and query head."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    def counted(loss_of, inputs):
        with FlopCounterMode(display=False) as counter:
            loss_of(*inputs).float().sum().backward()
        counts = counter.get_flop_counts()["Global"]
        return counts[torch.ops.flashtriton.attention_forward], counts[torch.ops.flashtriton.attention_backward]

    device = backend.device
    q, k, v = (x.detach().repeat_interleave(2, dim=2).requires_grad_() if x.shape[2] == 2 else x for x in
               _inputs(device))  # fmt: skip
    shape = (q.shape[0], q.shape[2], q.shape[1], q.shape[3])  # MHA, (B, H, N, D): SDPA's count
    assert counted(lambda q, k, v: ft.flash_attn_func(q, k, v, causal=True), (q, k, v)) == (
        sdpa_flop_count(shape, shape, shape),
        sdpa_backward_flop_count(shape, shape, shape, shape),
    )
    q, k, v, cu = _packed(device)  # GQA 4/2, sequences of 5, 32 and 37 rows
    pairs = 5 * 5 + 32 * 32 + 37 * 37
    heads, dim = q.shape[1], q.shape[2]
    forward, backward = counted(lambda q, k, v: ft.flash_attn_varlen_func(q, k, v, cu, cu, 37, 37), (q, k, v))
    assert (forward, backward) == (2 * heads * pairs * 2 * dim, 2 * heads * pairs * 5 * dim)
    # paged keys, (pages, 16 rows, K/V heads, dim): the pairs of the sequences' lengths, not of the pages' rows
    k_pages, v_pages = (torch.randn(9, 16, 2, dim, device=device) for _ in range(2))
    table = torch.arange(9, dtype=torch.int32, device=device).view(3, 3)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        ft.flash_attn_varlen_func(q, k_pages, v_pages, cu, cu, 37, 37, block_table=table)
    assert counter.get_total_flops() == 2 * heads * pairs * 2 * dim
    # fake cu_seqlens (a trace's): every sequence at max_seqlen, as torch counts a nested SDPA call
    real = q.detach(), k.detach(), v.detach(), cu
    with torch._subclasses.FakeTensorMode() as mode:
        fake_q, fake_k, fake_v, fake_cu = (mode.from_tensor(x) for x in real)
        fake = AttentionParams(0.25, cu_seqlens_q=fake_cu, cu_seqlens_k=fake_cu, max_seqlen_q=37, max_seqlen_k=37)
        with FlopCounterMode(display=False) as counter:
            torch.ops.flashtriton.attention_forward(fake_q, fake_k, fake_v, *schema.to_schema(fake))
    assert counter.get_total_flops() == 2 * heads * 3 * 37 * 37 * 2 * dim
