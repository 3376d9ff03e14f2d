"""The progress of a run on stderr: cases done, time so far and time left."""

from __future__ import annotations

import shutil
import sys
import time

import torch

from .cases import Case


def case_weights(cases: list[Case], device: torch.device) -> list[float]:
    """Each case's expected share of the run's time, for the progress estimate: on a GPU the timing passes are
    time-boxed, so cases cost about alike; on a CPU a case's time follows its FLOPs."""
    if device.type == "cuda":
        return [1.0] * len(cases)
    return [c.flops("fwd") for c in cases]


def _clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


PROGRESS_BAR = 24  # characters between the brackets


def progress(cases: list[Case], weights: list[float], stream=None):
    """Yields the cases, showing on ``stream`` (stderr) the cases done, the time so far and the time left, estimated
    as the time per weight so far times the weight left: a bar redrawn in place on a terminal, a line per case in a
    log (a stream that is not a terminal)."""
    stream = stream or sys.stderr
    tty = stream.isatty()
    columns = shutil.get_terminal_size().columns - 1
    total, total_weight, done_weight = len(cases), sum(weights), 0.0
    start, drawn = time.perf_counter(), 0

    def show(text: str, last: bool = False) -> None:
        nonlocal drawn
        if tty:
            text = text[:columns]
            stream.write("\r" + text.ljust(drawn) + ("\n" if last else ""))
            drawn = len(text)
        else:
            stream.write(text + "\n")
        stream.flush()

    def bar(done: int) -> str:
        filled = PROGRESS_BAR * done // max(total, 1)
        return f"[{'#' * filled}{'.' * (PROGRESS_BAR - filled)}] " if tty else ""

    for i, (case, weight) in enumerate(zip(cases, weights, strict=True)):
        elapsed = time.perf_counter() - start
        left = _clock(elapsed * (total_weight - done_weight) / done_weight) if done_weight else "?"
        show(f"{bar(i)}{i}/{total} cases, {_clock(elapsed)} elapsed, ~{left} left: running {case.name}")
        yield case
        done_weight += weight
    show(f"{bar(total)}{total}/{total} cases in {_clock(time.perf_counter() - start)}", last=True)
