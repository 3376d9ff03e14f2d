"""``flashtriton bench``: flashtriton against its peers, every provider in the same run.

FLOPs (one formula, the FlashAttention-2 paper's): forward 4 * B * H * N_Q * N_K * D, halved when causal;
backward 2.5x the forward, so forward+backward 3.5x. Each case runs on random inputs in rounds, the
providers' order rotated, and reports the median of the rounds (run_case); within a round the providers'
calls are timed one of each in turn (device_timer), so that all of them see the same clock state. Writes
``results.json`` (rewritten after every case, so a run cut short still leaves what it measured) and
``bench.png`` (with matplotlib: the ``[bench]`` extra), a TFLOP/s-against-seqlen panel per (head dim, causal,
mode). ``--resume`` continues a run that was cut short (a device's time limit) from its results.json.
"""

from .cli import add_arguments, run

__all__ = ["add_arguments", "run"]
