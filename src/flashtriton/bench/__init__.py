"""``flashtriton bench``: flashtriton against its peers, every provider in the same run.

Four suites (--suite). paper, the default: the FlashAttention-2 paper's sweep (batch * seqlen = 16k tokens, heads *
head_dim = 2048), fwd / bwd / fwd+bwd against SDPA's backends, FlexAttention, standard attention and flash_attn.
users: what users bring (bench/users.py lists it): a model's (B, H, N, D) storage seen as (B, N, H, D) beside
contiguous inputs, lengths ending inside a tile beside their whole-tile neighbours, ragged documents (varlen against
FlexAttention's document mask), short N, GQA, host time per call and peak memory, against cuDNN SDPA and
FlexAttention; fwd and fwd+bwd with fresh gradients. On a GPU it is about 80 cases, estimated at 10 minutes, most
of them FlexAttention's compiles: --part 1/2, then --part 2/2 --resume, splits it; on a CPU, a tiny case of each
group. decode: flash_attn_with_kvcache reading a whole KV cache (bench/decode.py lists the cases: B 1-64, L 1k-128k,
GQA 32/8, D 128 and 64, seqlen_q 1 and 4 causal, contiguous and paged caches) against cuDNN SDPA, SDPA's
FlashAttention-2 and FlexAttention on dense copies: bandwidth (bytes of K and V / device time), device and host time
per call; on a GPU 138 cases in --part 1/5 to 5/5 (with --resume), on a CPU a tiny case per layout. ring: context
parallelism across the GPUs of one host, one process per GPU under torchrun (bench/ring.py).

FLOPs (one formula, the FlashAttention-2 paper's): forward 4 * B * H * N_Q * N_K * D, halved when causal;
backward 2.5x the forward, so forward+backward 3.5x. Each case runs on random inputs in rounds, the
providers' order rotated, and reports the median of the rounds (run_case); within a round the providers'
calls are timed one of each in turn (device_timer), so that all of them see the same clock state. Writes
``results.json`` (rewritten after every case, so a run cut short still leaves what it measured) and, for the paper
sweep, ``bench.png`` (with matplotlib: the ``[bench]`` extra), a TFLOP/s-against-seqlen panel per (head dim, causal,
mode). ``--resume`` continues a run that was cut short (a device's time limit) from its results.json.
"""

from .cli import add_arguments, run

__all__ = ["add_arguments", "run"]
