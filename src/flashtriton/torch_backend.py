"""The PyTorch path: CPU tensors, fp32 on any device, and FLASHTRITON_BACKEND=torch.

Two implementations, chosen per call by ``fused_serves``:

fused  ATen's CPU flash-attention kernel (the one F.scaled_dot_product_attention runs on CPU), for
       CPU tensors whose scores are softmax_scale * q.k under no mask, a causal mask or a sliding
       window. Its causal mask is top-left aligned and it has no window, so a call is cut into
       pieces it computes exactly (_pieces): query rows against a key range, each either unmasked,
       top-left causal, or under a small additive mask of its own rows and keys; pieces that share
       rows are merged by their LSE. Memory stays O(N * d) per (batch, head) plus a mask of one
       query tile's band. An eager call that one kernel call answers whole and whose LSE is discarded
       runs ATen's op under torch's own autograd formula (aten_serves).
tiled  the same algorithm as the Triton kernels, in PyTorch ops, for every option (softcap, ALiBi,
       dropout, score_mod, block masks) and for tensors off the CPU.

The tiled forward walks query tiles and, inside, the key tiles they can see with an online softmax;
the backward recomputes each score tile from Q, K and the saved LSE. Extra memory is
O(N * d + BLOCK_M * BLOCK_N) per (batch, head): no seqlen_q x seqlen_k matrix is ever allocated.
Arithmetic is fp32 whatever the input dtype (the fused kernel's with fp32 results: params.fp32_results).

Every option of AttentionParams (params.py has the semantics) is applied to a score tile in
_scores: softcap, ALiBi, score_mod, then the window's and the block mask's element masks. A sink is
one more logit of each row: the tiled forward folds it into the row's running max and sum after the
last tile, the fused one merges it into the kernel's (out, lse) by log-sum-exp. Key
tiles wholly outside the window, or not listed by the block mask (whose tile sizes the loops then
take), are never visited. Dropout regenerates its keep mask per tile from the seed and the global
indices. Varlen batches run the dense code on each sequence, as a batch of one.

GQA: the GROUP query heads that share a K/V head are stacked along the row axis of each tile, so
one batched matmul serves them all and dK/dV sum over the group without a separate reduction.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch

from . import dropout
from .kernels.config import TORCH_BLOCK_M, TORCH_BLOCK_N
from .mods import evaluate_score, evaluate_score_grad
from .params import NO_BOUND, AttentionParams, final_lse, sinks_grad
from .route import Route

PHILOX_CHUNK = 1 << 16  # dropout mask elements drawn at once (see _dropout_scale)


def _group_rows(x: torch.Tensor, heads_k: int) -> torch.Tensor:
    """(B, m, H, D) -> (B, HKV, GROUP * m, D): the query heads of one K/V head stacked by rows."""
    b, m, h, d = x.shape
    return x.view(b, m, heads_k, h // heads_k, d).permute(0, 2, 3, 1, 4).reshape(b, heads_k, -1, d)


def _ungroup_rows(x: torch.Tensor, m: int) -> torch.Tensor:
    """Inverse of _group_rows: (B, HKV, GROUP * m, D) -> (B, m, H, D)."""
    b, hk, gm, d = x.shape
    return x.view(b, hk, gm // m, m, d).permute(0, 3, 1, 2, 4).reshape(b, m, -1, d)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """(B, n, HKV, D) -> (B, HKV, n, D) in fp32."""
    return x.transpose(1, 2).float()


@dataclass(frozen=True)
class _Rows:
    """Indices of a query tile [m0, m1) in GROUP-stacked layout, shaped to broadcast over (B, HKV, GROUP*m, n)."""

    m0: int
    m1: int
    offset: int  # seqlen_k - seqlen_q: query i is aligned with key i + offset
    heads: int  # query heads H = HKV * GROUP
    batch: torch.Tensor  # (B, 1, 1, 1): batch index (the sequence's index for varlen)
    head: torch.Tensor  # (1, HKV, GROUP*m, 1): query head of each row
    query: torch.Tensor  # (1, 1, GROUP*m, 1): query index of each row within its sequence


def _rows(m0: int, m1: int, offset: int, first_batch: int, batch: int, heads_k: int, group: int, device) -> _Rows:
    heads = torch.arange(heads_k, device=device)[:, None] * group + torch.arange(group, device=device)
    return _Rows(
        m0, m1, offset, heads_k * group,
        batch=torch.arange(first_batch, first_batch + batch, device=device).view(-1, 1, 1, 1),
        head=heads.repeat_interleave(m1 - m0, dim=1).view(1, heads_k, -1, 1),
        query=torch.arange(m0, m1, device=device).repeat(group).view(1, 1, -1, 1),
    )  # fmt: skip


def _query_block(params: AttentionParams) -> int:
    """Rows per query tile: the block mask's tile height when there is one (its lists are per tile)."""
    return TORCH_BLOCK_M if params.block_mask is None else params.block_mask.block_size[0]


def _key_tiles(rows: _Rows, n_k: int, params: AttentionParams) -> list[tuple[int, int]]:
    """Key tiles [n0, n1) that some query of the tile sees; the keys outside are never visited."""
    if params.block_mask is not None:
        block_m, block_n = params.block_mask.block_size
        listed = params.block_mask.to_dense()[:, :, rows.m0 // block_m].flatten(0, 1).any(0)  # any batch or head
        return [(t * block_n, min(t * block_n + block_n, n_k)) for t in listed.nonzero()[:, 0].tolist()]
    start, stop = 0, n_k
    if params.window_left != NO_BOUND:
        start = max(0, rows.m0 + rows.offset - params.window_left)
    if params.window_right != NO_BOUND:
        stop = min(n_k, rows.m1 + rows.offset + params.window_right)
    return [(n0, min(n0 + TORCH_BLOCK_N, stop)) for n0 in range(start, stop, TORCH_BLOCK_N)]


def _window_visible(rows: _Rows, n0: int, n1: int, params: AttentionParams) -> torch.Tensor | None:
    """(1, 1, GROUP*m, n) bool: where query sees key inside the window; None when it sees all of keys n0:n1."""
    left, right = params.window_left, params.window_right
    all_after_left = left == NO_BOUND or n0 >= rows.m1 - 1 + rows.offset - left
    all_before_right = right == NO_BOUND or n1 - 1 <= rows.m0 + rows.offset + right
    if all_after_left and all_before_right:
        return None
    keys = torch.arange(n0, n1, device=rows.query.device)
    diagonal = rows.query + rows.offset
    visible = torch.ones_like(keys, dtype=torch.bool)
    if left != NO_BOUND:
        visible = visible & (keys >= diagonal - left)
    if right != NO_BOUND:
        visible = visible & (keys <= diagonal + right)
    return visible


def _visible(rows: _Rows, n0: int, n1: int, params: AttentionParams) -> torch.Tensor | None:
    """Bool, broadcastable to (B, HKV, GROUP*m, n): where query sees key; None when every score of the tile exists."""
    visible = _window_visible(rows, n0, n1, params)
    if params.block_mask is not None:
        device = rows.query.device
        block = params.block_mask.element_mask(
            q_idx=torch.arange(rows.m0, rows.m1, device=device), kv_idx=torch.arange(n0, n1, device=device),
            b=rows.batch.flatten(), h=torch.arange(rows.heads, device=device),
        )  # fmt: skip
        heads_k, rows_per_head = rows.head.shape[1:3]
        block = block.reshape(-1, heads_k, rows_per_head, n1 - n0)  # (B, H, m, n) -> (B, HKV, GROUP*m, n)
        visible = block if visible is None else visible & block
    return visible


def _scores(
    q_t: torch.Tensor, k_t: torch.Tensor, rows: _Rows, n0: int, n1: int, params: AttentionParams, with_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Score tile (B, HKV, GROUP*m, n) of the scaled queries q_t against keys n0:n1, -inf where not visible.

    With ``with_grad``, also d score / d (scale * q.k) where softcap or score_mod make it other than 1
    (0 where not visible), else None.
    """
    scores = torch.matmul(q_t, k_t.transpose(-1, -2))
    keys = torch.arange(n0, n1, device=scores.device)
    grad = None
    if params.softcap > 0:
        capped = torch.tanh(scores / params.softcap)
        scores = params.softcap * capped
        if with_grad:
            grad = 1.0 - capped * capped  # d(softcap * tanh(x / softcap)) / dx
    if params.alibi_slopes is not None:
        slopes = params.alibi_slopes[rows.batch, rows.head]  # (B, HKV, GROUP*m, 1)
        scores = scores - slopes * (rows.query + rows.offset - keys).abs()
    if params.score_mod is not None:
        index = (rows.batch, rows.head, rows.query, keys)
        if with_grad:
            mod_grad = evaluate_score_grad(params.score_mod, scores, *index)
            grad = mod_grad if grad is None else grad * mod_grad
        scores = evaluate_score(params.score_mod, scores, *index)
    visible = _visible(rows, n0, n1, params)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
        if grad is not None:  # a mod's derivative may be inf or NaN where no score exists
            grad = grad.masked_fill(~visible, 0.0)
    return scores, grad


def _dropout_scale(rows: _Rows, n0: int, n1: int, params: AttentionParams) -> torch.Tensor | None:
    """(B, HKV, GROUP*m, n) fp32: 1 / (1 - p) where the probability is kept, 0 where dropped; None without dropout."""
    if params.dropout_p == 0:
        return None
    keys = torch.arange(n0, n1, device=rows.query.device)
    batch, heads_k, rows_per_head = rows.batch.shape[0], *rows.head.shape[1:3]
    keep = torch.empty(batch, heads_k, rows_per_head, n1 - n0, dtype=torch.bool, device=keys.device)
    # Philox in int64 torch ops makes ~40 temporaries per element: draw it in slices that stay in cache
    step = max(1, PHILOX_CHUNK // keep[:, :, 0].numel())
    for r0 in range(0, rows_per_head, step):
        r = slice(r0, r0 + step)
        keep[:, :, r] = dropout.keep(
            params.seed, rows.batch, rows.head[:, :, r], rows.query[:, :, r], keys, params.dropout_p
        )
    return keep / (1.0 - params.dropout_p)


def _sequences(params: AttentionParams) -> list[tuple[slice, slice]]:
    """(rows of q, rows of k and v) of each sequence of a varlen batch."""
    starts_q, starts_k = params.cu_seqlens_q.tolist(), params.cu_seqlens_k.tolist()
    return [(slice(*q), slice(*k)) for q, k in zip(pairwise(starts_q), pairwise(starts_k), strict=True)]


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams, route: Route
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """out (shaped as q, in params.result_dtype's) and the natural-log LSE in fp32 (None unless params.write_lse: the
    blockwise softmax computes it all the same, so it is only dropped).

    Dense: q (batch, seqlen_q, nheads, headdim), k, v (batch, seqlen_k, nheads_k, headdim),
    lse (batch, nheads, seqlen_q). Varlen: q (total_q, nheads, headdim), k, v (total_k, nheads_k,
    headdim), lse (nheads, total_q). Rows that see no key: out 0, lse params.empty_lse.
    """
    if not params.varlen:
        out, lse = _dense_forward(q, k, v, params, first_batch=0)
    else:
        out = torch.empty(q.shape, dtype=params.result_dtype(q.dtype), device=q.device)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        for b, (rows_q, rows_k) in enumerate(_sequences(params)):
            out_b, lse_b = _dense_forward(q[None, rows_q], k[None, rows_k], v[None, rows_k], params, first_batch=b)
            out[rows_q], lse[:, rows_q] = out_b[0], lse_b[0]
    return out, lse if params.write_lse else None


def _dense_forward(q, k, v, params: AttentionParams, first_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    if fused_serves(q, params):
        return _fused_forward(q, k, v, params)
    return _tiled_forward(q, k, v, params, first_batch)


def _tiled_forward(q, k, v, params: AttentionParams, first_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled dense forward on batch entries first_batch, first_batch + 1, ... (their alibi and dropout indices)."""
    batch, n_q, heads, head_dim = q.shape
    n_k, heads_k = k.shape[1], k.shape[2]
    out = torch.empty(batch, n_q, heads, head_dim, dtype=params.result_dtype(q.dtype), device=q.device)
    lse = torch.empty(batch, heads, n_q, dtype=torch.float32, device=q.device)
    block_m = _query_block(params)
    for m0 in range(0, n_q, block_m):
        m1 = min(m0 + block_m, n_q)
        rows = _rows(m0, m1, n_k - n_q, first_batch, batch, heads_k, heads // heads_k, q.device)
        q_t = _group_rows(q[:, m0:m1].float(), heads_k) * params.softmax_scale
        row_max = torch.full(q_t.shape[:-1], float("-inf"), device=q.device)
        row_sum = torch.zeros(q_t.shape[:-1], device=q.device)
        acc = torch.zeros(q_t.shape, device=q.device)
        for n0, n1 in _key_tiles(rows, n_k, params):
            scores, _ = _scores(q_t, _heads_first(k[:, n0:n1]), rows, n0, n1, params, with_grad=False)
            new_max = torch.maximum(row_max, scores.amax(-1))
            # rows with no visible key yet keep max = -inf; shift them by 0 to avoid inf - inf
            shift = torch.where(torch.isneginf(new_max), 0.0, new_max)
            probs = torch.exp(scores - shift[..., None])
            alpha = torch.exp(row_max - shift)
            row_sum = row_sum * alpha + probs.sum(-1)  # the LSE is that of the undropped probabilities
            keep_scale = _dropout_scale(rows, n0, n1, params)
            if keep_scale is not None:
                probs = probs * keep_scale
            acc = acc * alpha[..., None] + torch.matmul(probs, _heads_first(v[:, n0:n1]))
            row_max = new_max
        if params.sinks is not None:  # one more logit: mass in the row's sum, no value in acc
            sink = params.sinks[rows.head[..., 0]]
            new_max = torch.maximum(row_max, sink)
            shift = torch.where(torch.isneginf(new_max), 0.0, new_max)  # no key and no sink: an empty row
            alpha = torch.exp(row_max - shift)
            row_sum = row_sum * alpha + torch.exp(sink - shift)
            acc = acc * alpha[..., None]
            row_max = shift
        empty = row_sum == 0
        out[:, m0:m1] = _ungroup_rows(acc / torch.where(empty, 1.0, row_sum)[..., None], m1 - m0)
        tile_lse = torch.where(empty, params.empty_lse, row_max + torch.log(row_sum))
        lse[:, :, m0:m1] = tile_lse.view(batch, heads, m1 - m0)
    return out, lse


def backward(
    dout: torch.Tensor,
    dlse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    params: AttentionParams,
    route: Route,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (shaped as q, k, v, in params.result_dtype's) by recomputation from q, k, v and the forward's lse,
    and dsinks (None without sinks).

    dout, out: shaped as q; dlse, lse: as forward's lse (dense (batch, nheads, seqlen_q), varlen
    (nheads, total_q)). Rows that see no key (lse = +inf) contribute nothing.
    """
    lse = final_lse(lse, params)
    delta = None  # ATen's fused backward takes it from out itself; the tiled one and the sinks' gradient need it
    if params.sinks is not None or not fused_serves(q, params):
        # delta = rowsum(dO * O) - dLSE, shaped as the LSE; the dLSE term carries gradients through the returned
        # LSE. With dropout, rowsum(dO * O) is still rowsum(P * dP), dP being the gradient of the undropped P.
        delta = (dout.float() * out.float()).sum(-1).transpose(-2, -1) - dlse
    if not params.varlen:
        dq, dk, dv = _dense_backward(dout, dlse, q, k, v, out, lse, delta, params, first_batch=0)
        return dq, dk, dv, sinks_grad(params, lse, delta)
    dq, dk, dv = (torch.empty(x.shape, dtype=params.result_dtype(x.dtype), device=x.device) for x in (q, k, v))
    for b, (rows_q, rows_k) in enumerate(_sequences(params)):
        dq_b, dk_b, dv_b = _dense_backward(
            dout[None, rows_q], dlse[None, :, rows_q], q[None, rows_q], k[None, rows_k], v[None, rows_k],
            out[None, rows_q], lse[None, :, rows_q], None if delta is None else delta[None, :, rows_q], params,
            first_batch=b,
        )  # fmt: skip
        dq[rows_q], dk[rows_k], dv[rows_k] = dq_b[0], dk_b[0], dv_b[0]
    return dq, dk, dv, sinks_grad(params, lse, delta)


def _dense_backward(dout, dlse, q, k, v, out, lse, delta, params: AttentionParams, first_batch: int):
    if fused_serves(q, params):
        return _fused_backward(dout, dlse, q, k, v, out, lse, params)
    return _tiled_backward(dout, q, k, v, lse, delta, params, first_batch)


def _tiled_backward(dout, q, k, v, lse, delta, params: AttentionParams, first_batch: int):
    """Tiled dense backward on batch entries first_batch, first_batch + 1, ... (delta: backward's)."""
    batch, n_q, heads = q.shape[:3]
    n_k, heads_k = k.shape[1], k.shape[2]
    dq = torch.empty(q.shape, dtype=params.result_dtype(q.dtype), device=q.device)
    dk = torch.zeros(batch, heads_k, n_k, k.shape[-1], device=q.device)
    dv = torch.zeros(batch, heads_k, n_k, v.shape[-1], device=q.device)
    block_m = _query_block(params)
    for m0 in range(0, n_q, block_m):
        m1 = min(m0 + block_m, n_q)
        rows = _rows(m0, m1, n_k - n_q, first_batch, batch, heads_k, heads // heads_k, q.device)
        q_t = _group_rows(q[:, m0:m1].float(), heads_k) * params.softmax_scale
        do_t = _group_rows(dout[:, m0:m1].float(), heads_k)
        lse_t = lse[:, :, m0:m1].reshape(batch, heads_k, -1, 1)
        delta_t = delta[:, :, m0:m1].reshape(batch, heads_k, -1, 1)
        dq_t = torch.zeros(q_t.shape, device=q.device)
        for n0, n1 in _key_tiles(rows, n_k, params):
            k_t, v_t = _heads_first(k[:, n0:n1]), _heads_first(v[:, n0:n1])
            scores, score_grad = _scores(q_t, k_t, rows, n0, n1, params, with_grad=True)
            # recompute P from the saved LSE; rows with no visible key have lse = +inf, so P = 0
            probs = torch.exp(scores - lse_t)
            dprobs = torch.matmul(do_t, v_t.transpose(-1, -2))
            keep_scale = _dropout_scale(rows, n0, n1, params)
            if keep_scale is not None:
                dv[:, :, n0:n1] += torch.matmul((probs * keep_scale).transpose(-1, -2), do_t)
                dprobs = dprobs * keep_scale
            else:
                dv[:, :, n0:n1] += torch.matmul(probs.transpose(-1, -2), do_t)
            dscores = probs * (dprobs - delta_t)
            if score_grad is not None:
                dscores = dscores * score_grad
            dq_t += torch.matmul(dscores, k_t)
            dk[:, :, n0:n1] += torch.matmul(dscores.transpose(-1, -2), q_t)  # q_t carries the scale
        dq[:, m0:m1] = _ungroup_rows(dq_t * params.softmax_scale, m1 - m0)
    dk, dv = (x.to(params.result_dtype(like.dtype)).transpose(1, 2).contiguous() for x, like in ((dk, k), (dv, v)))
    return dq, dk, dv


# The fused path. ATen's kernel takes (batch, nheads, seqlen, headdim) views whose head dim is contiguous and returns
# the natural-log LSE in fp32 (batch, nheads, seqlen_q). It reads K/V head h for query head h (no GQA), gives a row
# that sees no key out 0 and LSE 0, and its backward takes rowsum(dO * O) from the out it is given (no dLSE input).
ATEN_FORWARD = torch._scaled_dot_product_flash_attention_for_cpu
ATEN_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def fused_serves(q: torch.Tensor, params: AttentionParams) -> bool:
    """Whether ATen's fused CPU kernel computes this call: CPU tensors (it has no other device) whose scores are
    softmax_scale * q.k (it has no softcap, ALiBi, dropout or score_mod), under no mask, a causal mask or a window
    (which _pieces cuts into calls it computes exactly), and no block mask (whose mask_mod is arbitrary code)."""
    return q.device.type == "cpu" and params.plain and not params.sparse


def _fused_dtype(dtype: torch.dtype, params: AttentionParams) -> torch.dtype:
    """The dtype the fused kernel runs in. fp16 runs as fp32: without fp16 matrix units (most CPUs) ATen's fp16
    kernel converts in its inner loops and is several times slower than its fp32 one, its backward most of all. So do
    fp32 results: the kernel rounds its outputs to its inputs' dtype."""
    return torch.float32 if dtype == torch.float16 or params.fp32_results else dtype


@dataclass(frozen=True)
class _Piece:
    """One call of the fused kernel: query rows [m0, m1) against keys [n0, n1), top-left causal or under ``mask``."""

    m0: int
    m1: int
    n0: int
    n1: int
    causal: bool = False
    mask: torch.Tensor | None = None  # (m1 - m0, n1 - n0) additive: 0 where the query sees the key, -inf elsewhere
    seeing: torch.Tensor | None = None  # (m1 - m0,) bool: the rows that see some key here; None: all of them

    def whole(self, n_q: int, n_k: int) -> bool:
        """Every query against every key, each query seeing some key: the call's answer is this piece's."""
        return (self.m0, self.m1, self.n0, self.n1) == (0, n_q, 0, n_k) and self.mask is None


def _pieces(n_q: int, n_k: int, params: AttentionParams, dtype: torch.dtype) -> list[_Piece]:
    """The fused-kernel calls that make up one dense call, query i seeing key j as params.py's window says.

    No window: one call. Bounded on the right only (causal, or causal shifted by window_right): with
    d = n_k - n_q + window_right, query i sees the keys j <= i + d, so every query sees the keys below d (an
    unmasked call) and key d + c iff c <= i (the kernel's top-left causal mask); for d <= 0 the first -d queries see
    no key. Bounded on the left: a call per query tile against the keys its band spans, under the band's mask.
    An empty sequence of a varlen batch makes no call (the kernel divides by both lengths).
    """
    if n_q == 0 or n_k == 0:
        return []
    causal = _one_call(n_q, n_k, params)
    if causal is not None:
        return [_Piece(0, n_q, 0, n_k, causal=causal)]
    if params.right_only:  # 0 < d < n_k, or d < 0
        d = n_k - n_q + params.window_right
        if d < 0:
            return [_Piece(-d, n_q, 0, n_k, causal=True)] if -d < n_q else []
        return [_Piece(0, n_q, 0, d), _Piece(0, n_q, d, n_k, causal=True)]
    pieces = []
    for m0 in range(0, n_q, TORCH_BLOCK_M):
        m1 = min(m0 + TORCH_BLOCK_M, n_q)
        rows = _rows(m0, m1, n_k - n_q, 0, 1, 1, 1, torch.device("cpu"))
        tiles = _key_tiles(rows, n_k, params)
        if not tiles:
            continue
        n0, n1 = tiles[0][0], tiles[-1][1]
        visible = _window_visible(rows, n0, n1, params)
        if visible is None:
            pieces.append(_Piece(m0, m1, n0, n1))
            continue
        visible = visible.view(m1 - m0, n1 - n0)
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
        pieces.append(_Piece(m0, m1, n0, n1, mask=mask, seeing=visible.any(-1)))
    return pieces


def _one_call(n_q: int, n_k: int, params: AttentionParams) -> bool | None:
    """Whether one kernel call answers every query against every key (no window, or a right bound at d = n_k - n_q
    + window_right that is the kernel's top-left causal mask, d = 0, or hides nothing, d >= n_k): its is_causal, or
    None where the call takes other pieces (_pieces)."""
    if not params.windowed:
        return False
    if params.right_only:
        d = n_k - n_q + params.window_right
        if d == 0 or d >= n_k:
            return d == 0
    return None


def aten_serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams) -> bool | None:
    """The is_causal of the one call of ATen's fused kernel that answers this dense call whole (_one_call), on q, k,
    v as they are; None where there is none, and for sinks, fp32 results, varlen, GQA, fp16 or a strided head dim.
    Those last three take copies (K/V heads repeated, fp32, contiguous), which torch's autograd would keep for the
    backward where the autograd.Function keeps the inputs."""
    if params.varlen or params.sinks is not None or params.fp32_results or not fused_serves(q, params):
        return None
    if q.dtype == torch.float16 or q.shape[2] != k.shape[2] or not q.stride(-1) == k.stride(-1) == v.stride(-1) == 1:
        return None
    return _one_call(q.shape[1], k.shape[1], params) if q.shape[1] and k.shape[1] else None


def aten_whole(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams, causal: bool):
    """out of a call that aten_serves (causal: its answer), made by ATen's op itself on views of q, k, v, so that
    torch's autograd formula for it (C++) takes the gradients: an eager fwd+bwd then runs no Python in its
    backward. The op's LSE takes no gradient, so only for callers that discard the LSE."""
    out, _ = ATEN_FORWARD(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                          attn_mask=None, scale=params.softmax_scale)  # fmt: skip
    return out.transpose(1, 2).contiguous()


def _fused_input(x: torch.Tensor, dtype: torch.dtype, heads: int) -> torch.Tensor:
    """(B, n, HKV, D) -> the kernel's (B, H, n, D) view in ``dtype``, K/V heads repeated for the GQA group (a copy
    where the head dim is strided: the kernel reads it contiguous)."""
    if x.dtype != dtype:
        x = x.to(dtype)
    if x.shape[2] != heads:
        x = x.repeat_interleave(heads // x.shape[2], dim=2)
    return (x if x.stride(-1) == 1 else x.contiguous()).transpose(1, 2)


def _span(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """x[:, :, start:stop]; x itself when that is all of it. Host time right after a kernel is dear (its caches are
    cold), and the one-piece calls, the common ones, need no views."""
    return x if start == 0 and stop == x.shape[2] else x[:, :, start:stop]


def _merge(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Adds a piece's (out, lse) to the running (out, lse) of the same rows, in place, by log-sum-exp weights (every
    row has seen a key in both: the LSEs are finite)."""
    total = torch.logaddexp(lse, part_lse)
    out.mul_(torch.exp(lse - total)[..., None]).add_(part_out * torch.exp(part_lse - total)[..., None])
    lse.copy_(total)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in ``dtype``, contiguous (as the custom ops' fake outputs are)."""
    return (x if x.dtype == dtype else x.to(dtype)).contiguous()


def _fused_forward(q, k, v, params: AttentionParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense forward, a kernel call per piece: out (B, N_Q, H, D) in params.result_dtype's, lse (B, H, N_Q) fp32."""
    batch, n_q, heads, head_dim = q.shape
    n_k = k.shape[1]
    dtype, out_dtype = _fused_dtype(q.dtype, params), params.result_dtype(q.dtype)
    q_t, k_t, v_t = (_fused_input(x, dtype, heads) for x in (q, k, v))
    pieces = _pieces(n_q, n_k, params, dtype)
    parts = [
        ATEN_FORWARD(
            _span(q_t, p.m0, p.m1),
            _span(k_t, p.n0, p.n1),
            _span(v_t, p.n0, p.n1),
            is_causal=p.causal,
            attn_mask=p.mask,
            scale=params.softmax_scale,
        )
        for p in pieces
    ]
    if len(pieces) == 1 and pieces[0].whole(n_q, n_k):  # the kernel's answer is the call's
        out, lse = parts[0]
        if params.sinks is not None:
            out, lse = _with_sinks(out.transpose(1, 2), lse, params)
            return _as(out, out_dtype), lse
        return _as(out.transpose(1, 2), out_dtype), lse.contiguous()
    out = torch.zeros(batch, n_q, heads, head_dim, dtype=torch.float32)
    lse = torch.full((batch, heads, n_q), float("-inf"))
    seen = torch.zeros(n_q, dtype=torch.bool)  # rows that see some key
    for piece, (part_out, part_lse) in zip(pieces, parts, strict=True):
        rows = slice(piece.m0, piece.m1)
        if seen[rows].any():
            assert piece.seeing is None, "pieces that share rows are unmasked or causal (_pieces)"
            _merge(out.transpose(1, 2)[:, :, rows], lse[:, :, rows], part_out, part_lse)
        else:
            out[:, rows], lse[:, :, rows] = part_out.transpose(1, 2), part_lse
        seen[rows] |= True if piece.seeing is None else piece.seeing
    if params.sinks is None:
        lse[:, :, ~seen] = params.empty_lse
        return _as(out, out_dtype), lse
    lse[:, :, ~seen] = float("-inf")  # the kernel's LSE of a row that sees no key is 0
    out, lse = _with_sinks(out, lse, params)
    return _as(out, out_dtype), lse


def _with_sinks(out: torch.Tensor, lse: torch.Tensor, params: AttentionParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The (out (B, N_Q, H, D), lse (B, H, N_Q)) of the keys alone (lse -inf where a row saw none) with each row's
    sink merged in as one more logit: out fp32, scaled by the keys' share of the mass; lse params.empty_lse where
    a row has neither a key nor a sink."""
    total = torch.logaddexp(lse, params.sinks.view(-1, 1))
    shift = torch.where(torch.isneginf(total), 0.0, total)
    out = out.float() * torch.exp(lse - shift).transpose(1, 2)[..., None]
    return out, torch.where(torch.isneginf(total), params.empty_lse, total)


def _with_lse_grad(q, k, v, out, dout, dlse) -> tuple[torch.Tensor, ...]:
    """The kernel's (B, H, n, D) inputs widened by a head-dim column that carries dLSE into its backward: out gets
    -dLSE there and dout 1, so rowsum(dout * out) = rowsum(dO * O) - dLSE (the delta with the LSE's gradient); q, k
    and v get 0, so the scores and dO V^T are unchanged. The gradients' first D columns are the answer."""

    def widen(x: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, column.to(x.dtype).expand(*x.shape[:-1], 1)], dim=-1)

    zero, one = q.new_zeros(()), q.new_ones(())
    return widen(q, zero), widen(k, zero), widen(v, zero), widen(out, -dlse[..., None]), widen(dout, one)


def _fused_backward(dout, dlse, q, k, v, out, lse, params: AttentionParams):
    """Dense backward, a kernel call per piece as in the forward; dK, dV of a GQA group summed over its heads."""
    batch, n_q, heads, head_dim = q.shape
    n_k, heads_k = k.shape[1], k.shape[2]
    dtype = _fused_dtype(q.dtype, params)
    tensors = [_fused_input(x, dtype, heads) for x in (q, k, v, out, dout)]
    if dlse.any():
        tensors = _with_lse_grad(*tensors, dlse)
    q_t, k_t, v_t, out_t, dout_t = tensors
    pieces = _pieces(n_q, n_k, params, dtype)

    def gradients(p: _Piece) -> tuple[torch.Tensor, ...]:  # (B, N, H, D) views: dq of rows m0:m1, dk, dv of keys n0:n1
        rows, keys = (p.m0, p.m1), (p.n0, p.n1)
        grads = ATEN_BACKWARD(
            _span(dout_t, *rows), _span(q_t, *rows), _span(k_t, *keys), _span(v_t, *keys), _span(out_t, *rows),
            _span(lse, *rows), 0.0, p.causal, attn_mask=p.mask, scale=params.softmax_scale,
        )  # fmt: skip
        return tuple((x if x.shape[-1] == head_dim else x[..., :head_dim]).transpose(1, 2) for x in grads)

    if len(pieces) == 1 and pieces[0].whole(n_q, n_k):
        dq, dk, dv = gradients(pieces[0])
    else:  # added up piece by piece, so that no two pieces' gradients are held at once
        dq, dk, dv = (torch.zeros(batch, n, heads, head_dim) for n in (n_q, n_k, n_k))
        for p in pieces:
            part_dq, part_dk, part_dv = gradients(p)
            dq[:, p.m0 : p.m1] += part_dq
            dk[:, p.n0 : p.n1] += part_dk
            dv[:, p.n0 : p.n1] += part_dv
    if heads_k != heads:
        dk, dv = (x.unflatten(2, (heads_k, heads // heads_k)).sum(3) for x in (dk, dv))
    return tuple(_as(grad, params.result_dtype(x.dtype)) for grad, x in ((dq, q), (dk, k), (dv, v)))
