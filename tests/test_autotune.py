"""Opt-in autotuning (FLASHTRITON_AUTOTUNE=1): the tuner's choice and cache, then through the kernels."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from flashtriton import autotune, flash_attn_func, route, triton_backend
from flashtriton.params import AttentionParams
from helpers import TARGETS, Shape, assert_close_to_reference, random_qkv, reference_outputs


@pytest.fixture
def tuning(monkeypatch, tmp_path):
    """Tuning on, with a cache of its own."""
    monkeypatch.setenv(autotune.AUTOTUNE_ENV, "1")
    monkeypatch.setenv(autotune.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(autotune, "_CACHES", {})
    monkeypatch.setattr(triton_backend, "_PLANS", {})
    monkeypatch.setattr(route, "_ROUTES", {})  # routes hold the table configs too
    return tmp_path / autotune.CACHE_FILE


@dataclass(frozen=True)
class Tiles:
    size: int


def _timed(monkeypatch, ms_by_size: dict[int, float]) -> tuple[list[int], list[int]]:
    """_time_ms gives each config the time of its size: (the sizes timed, the sizes run), both in order."""
    timed, seen = [], []

    def time_ms(fn, device):
        fn()
        timed.append(seen[-1])
        return ms_by_size[seen[-1]]

    monkeypatch.setattr(autotune, "_time_ms", time_ms)
    return timed, seen


def _runner(seen: list[int], wrong=(), unwritten=(), failing=()):
    """run(cfg) for Tiles: writes 1..4 into a tensor, except for the sizes told to go wrong."""
    out = torch.empty(4)

    def run(cfg: Tiles):
        seen.append(cfg.size)
        if cfg.size in failing:
            raise RuntimeError("out of shared memory")
        if cfg.size not in unwritten:
            out.copy_(torch.arange(1.0, 5.0) + (0.5 if cfg.size in wrong else 0.0))
        return (out,)

    return run


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv(autotune.AUTOTUNE_ENV, raising=False)
    assert not autotune.enabled()
    monkeypatch.setenv(autotune.AUTOTUNE_ENV, "yes")
    with pytest.raises(ValueError, match="set it to 1"):
        autotune.enabled()


def test_fastest_matching_candidate_wins_and_is_cached(tuning, monkeypatch):
    timed, seen = _timed(monkeypatch, {64: 1.0, 32: 0.5, 16: 0.8, 8: 0.1, 4: 0.2})
    run = _runner(seen, wrong={8}, unwritten={4}, failing={128})
    candidates = [Tiles(32), Tiles(16), Tiles(8), Tiles(4), Tiles(128), Tiles(64)]
    assert autotune.choose("forward", ("key",), Tiles(64), candidates, run, torch.device("cpu")) == Tiles(32)
    assert timed == [64, 32, 16]  # wrong, unwritten and failing candidates are not timed; the table is not again
    entry = json.loads(tuning.read_text())
    (key,) = entry
    assert key.startswith("cpu|") and key.endswith("|forward|key")
    assert entry[key]["config"] == {"size": 32}
    assert set(entry[key]["rejected"]) == {"Tiles(size=8)", "Tiles(size=4)", "Tiles(size=128)"}
    assert "differs" in entry[key]["rejected"]["Tiles(size=8)"]
    assert "not finite" in entry[key]["rejected"]["Tiles(size=4)"]
    assert "out of shared memory" in entry[key]["rejected"]["Tiles(size=128)"]

    # a new process reads the choice from disk and runs nothing to make it
    monkeypatch.setattr(autotune, "_CACHES", {})
    seen.clear()
    assert autotune.choose("forward", ("key",), Tiles(64), candidates, run, torch.device("cpu")) == Tiles(32)
    assert seen == []
    # another key is tuned on its own, and the file keeps both
    autotune.choose("forward", ("other",), Tiles(64), [Tiles(16)], run, torch.device("cpu"))
    assert len(json.loads(tuning.read_text())) == 2


def test_table_kept_within_the_margin(tuning, monkeypatch):
    _, seen = _timed(monkeypatch, {64: 1.0, 32: 0.99})
    run = _runner(seen)
    assert autotune.choose("forward", ("key",), Tiles(64), [Tiles(32)], run, torch.device("cpu")) == Tiles(64)


def test_an_unwritable_cache_warns_and_keeps_the_choice(tuning, monkeypatch):
    blocker = tuning.parent / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv(autotune.CACHE_DIR_ENV, str(blocker))
    _, seen = _timed(monkeypatch, {64: 1.0, 32: 0.5})
    run = _runner(seen)
    with pytest.warns(UserWarning, match="could not be written"):
        assert autotune.choose("forward", ("key",), Tiles(64), [Tiles(32)], run, torch.device("cpu")) == Tiles(32)
    seen.clear()
    assert autotune.choose("forward", ("key",), Tiles(64), [Tiles(32)], run, torch.device("cpu")) == Tiles(32)
    assert seen == []


def test_a_cache_that_is_not_one_says_what_to_do(tuning):
    tuning.write_text("{not json")
    with pytest.raises(ValueError, match="delete it"):
        autotune.choose("forward", ("key",), Tiles(64), [], _runner([]), torch.device("cpu"))


def test_span_buckets():
    assert [autotune.span_bucket(n) for n in (1, 2, 3, 512, 513, 16384)] == [1, 2, 4, 512, 1024, 16384]


_SHAPES = {
    "cpu": [],  # the PyTorch path has nothing to tune
    "tiny": [Shape(1, 70, 70, 2, 1, 32)],
    "gpu": [Shape(2, 1024, 1024, 4, 4, 128), Shape(1, 1000, 1000, 4, 2, 64)],
}


def _hopper_forward_runs(target, shape: Shape) -> bool:
    """The Gluon forward takes a causal call of these shapes (test_backend has the scope)."""
    hopper = target.device == "cuda" and torch.cuda.get_device_capability()[0] == 9
    return hopper and shape.head_dim in (64, 128, 256) and shape.n_q == shape.n_k


@pytest.mark.parametrize("target, shape", [pytest.param(t, s, id=f"{t}-{s}") for t in TARGETS for s in _SHAPES[t.size]])
def test_tuned_calls_match_the_reference(target, shape, tuning, monkeypatch):
    """Through flash_attn_func, forward and backward: right with the tuned forward, which is tuned once (a new
    process, whose tuning timer is broken here, takes the cached choice), and the same bits both times."""
    monkeypatch.setenv("FLASHTRITON_BACKEND", target.backend)
    dtype = torch.float16 if target.device == "cuda" else torch.float32
    q, k, v = random_qkv(shape, dtype, target.device)
    dout = torch.randn_like(q)
    out = flash_attn_func(q, k, v, causal=True)
    out.backward(dout)
    results = [out.detach(), *(x.grad for x in (q, k, v))]
    kinds = sorted(key.split("|")[4] for key in json.loads(tuning.read_text()))
    # later calls of the layout replay the tuned call's launches
    assert all(key[0] in ("forward", "backward") for key in triton_backend._PLANS)
    assert ("forward" in {key[0] for key in triton_backend._PLANS}) == _hopper_forward_runs(target, shape)
    assert kinds == (["gluon forward"] if _hopper_forward_runs(target, shape) else ["forward"])

    dlse = torch.zeros(shape.batch, shape.heads, shape.n_q, device=target.device)
    exact = reference_outputs(q, k, v, dout, dlse, causal=True)
    plain = reference_outputs(q, k, v, dout, dlse, causal=True, compute_dtype=dtype)
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        j = i + (i > 0)  # reference_outputs: out, lse, dq, dk, dv
        assert_close_to_reference(name, results[i], exact[j], plain[j])

    def no_timing(fn, device):
        raise AssertionError("tuned again")

    monkeypatch.setattr(autotune, "_time_ms", no_timing)
    monkeypatch.setattr(autotune, "_CACHES", {})
    monkeypatch.setattr(triton_backend, "_PLANS", {})
    monkeypatch.setattr(route, "_ROUTES", {})  # routes hold the table configs too
    for x in (q, k, v):
        x.grad = None
    again = flash_attn_func(q, k, v, causal=True)
    again.backward(dout)
    for name, first, second in zip(("out", "dq", "dk", "dv"), results, (again, q.grad, k.grad, v.grad), strict=True):
        assert torch.equal(first, second), f"{name} changed with the cached choice"


@pytest.mark.parametrize("target, shape", [pytest.param(t, s, id=f"{t}-{s}") for t in TARGETS for s in _SHAPES[t.size]])
def test_an_inference_call_tunes_without_the_lse(target, shape, tuning, monkeypatch):
    """A call that needs neither a gradient nor the LSE tunes its forward too (the kernels write out alone), under
    its own key (a training call's choice, timed with the LSE written, is not taken for it), and is right with the
    choice."""
    monkeypatch.setenv("FLASHTRITON_BACKEND", target.backend)
    dtype = torch.float16 if target.device == "cuda" else torch.float32
    q, k, v = random_qkv(shape, dtype, target.device, requires_grad=False)
    out = flash_attn_func(q, k, v, causal=True)
    inference = json.loads(tuning.read_text())
    assert len(inference) == 1 and all(key.endswith("|no lse") for key in inference)
    flash_attn_func(q, k, v, causal=True, return_attn_probs=True)  # returns the LSE: tuned again, writing it
    keys = set(json.loads(tuning.read_text()))
    assert len(keys) == 2 and set(inference) < keys
    dout = torch.zeros_like(q)
    dlse = torch.zeros(shape.batch, shape.heads, shape.n_q, device=target.device)
    exact = reference_outputs(q, k, v, dout, dlse, causal=True)
    plain = reference_outputs(q, k, v, dout, dlse, causal=True, compute_dtype=dtype)
    assert_close_to_reference("out", out, exact[0], plain[0])


def test_tuning_keys_tell_softcap_levels_apart():
    """A cap's tanh series (config.softcap_mode: fp32, or caps above SOFTCAP_SERIES_ABOVE) is another kernel: its
    tuned config is not reused for a cap without it, nor a capped call's for an uncapped one."""
    keys = {
        cap: triton_backend._tuning_key(AttentionParams(0.125, softcap=cap), 64, torch.bfloat16, 1024, True)
        for cap in (0.0, 30.0, 1000.0)
    }
    assert len(set(keys.values())) == 3, keys
    assert keys[30.0] == triton_backend._tuning_key(
        AttentionParams(0.125, softcap=50.0), 64, torch.bfloat16, 1024, True
    )
