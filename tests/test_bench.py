"""flashtriton bench's timing protocol: providers timed in rounds, the order rotated, medians reported, a
provider that fails reported as unavailable; --resume refuses a run measured another way."""

import importlib.util
from pathlib import Path

import pytest
import torch

from flashtriton import bench

CASE = bench.Case(1, 8, 2, 16, False, "float32")
CPU = torch.device("cpu")


def _providers(failing: str | None = None) -> dict:
    """Providers named a, b, c whose forward is tagged with its name (a timer sees which one it times)."""

    def provider(name):
        def make(q, k, v, causal):
            def fwd():
                if name == failing:
                    raise RuntimeError(f"{name} does not run this case")
                return q * 2.0

            fwd.provider = name
            return fwd

        return make

    return {name: provider(name) for name in "abc"}


def _scripted_timer(monkeypatch, times: dict[str, list[float]], fail_at: tuple[str, int] | None = None) -> list:
    """Replaces the bench's timer: each call pops the next time of the provider it times; returns the calls' order."""
    order = []

    def timer(device):
        def time_ms(fn):
            order.append(fn.provider)
            if fail_at == (fn.provider, sum(p == fn.provider for p in order)):
                raise torch.cuda.OutOfMemoryError("out of memory")
            return times[fn.provider].pop(0)

        return time_ms

    monkeypatch.setattr(bench, "_timer", timer)
    return order


def test_rounds_rotate_the_order_and_report_medians(monkeypatch):
    monkeypatch.setattr(bench, "PROVIDERS", _providers())
    rounds = {"a": [5.0, 1.0, 3.0], "b": [2.0, 2.5, 9.0], "c": [7.0, 6.0, 8.0]}
    order = _scripted_timer(monkeypatch, {p: list(t) for p, t in rounds.items()})

    results = bench.run_case(CASE, ["a", "b", "c"], CPU, modes=("fwd",), rounds=3)

    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [r.provider for r in results] == ["a", "b", "c"]
    for r in results:
        assert r.unavailable is None
        assert r.ms_rounds["fwd"] == rounds[r.provider]
        assert r.ms["fwd"] == sorted(rounds[r.provider])[1]
        flops = bench.attention_flops(1, 2, 8, 8, 16, False, "fwd")
        assert r.tflops["fwd"] == pytest.approx(flops / (r.ms["fwd"] * 1e-3) / 1e12)
        assert r.max_error > 0  # q * 2 is not attention: the error check ran on the provider's output


def test_a_failing_provider_is_reported_and_the_others_still_timed(monkeypatch):
    monkeypatch.setattr(bench, "PROVIDERS", _providers(failing="b"))
    order = _scripted_timer(monkeypatch, {"a": [1.0, 2.0], "c": [3.0, 4.0]})

    a, b, c = bench.run_case(CASE, ["a", "b", "c"], CPU, modes=("fwd",), rounds=2)

    assert order == ["a", "c", "c", "a"]
    assert b.unavailable == "RuntimeError: b does not run this case" and not b.ms
    assert a.ms["fwd"] == 1.5 and c.ms["fwd"] == 3.5


def test_a_provider_failing_in_a_later_round_keeps_no_times(monkeypatch):
    monkeypatch.setattr(bench, "PROVIDERS", _providers())
    order = _scripted_timer(monkeypatch, {p: [1.0, 1.0, 1.0] for p in "abc"}, fail_at=("a", 2))

    a, b, c = bench.run_case(CASE, ["a", "b", "c"], CPU, modes=("fwd",), rounds=3)

    assert order.count("a") == 2  # not timed again after it failed
    assert a.unavailable.startswith("OutOfMemoryError") and not a.ms and not a.ms_rounds
    assert b.ms_rounds["fwd"] == c.ms_rounds["fwd"] == [1.0, 1.0, 1.0]


def test_gpu_providers_are_unavailable_on_cpu():
    (flex,) = bench.run_case(CASE, ["flex"], CPU, modes=("fwd",), rounds=2)
    assert flex.unavailable == "needs a CUDA GPU" and not flex.ms


def test_resume_refuses_a_run_timed_in_other_rounds(tmp_path):
    env = bench.environment()
    sweep = {"modes": ["fwd"], "providers": ["a"], "dtype": "float32", "rounds": 1}
    path = str(tmp_path / "results.json")
    bench._write_json(path, {"environment": env, "sweep": sweep}, [bench.Result(CASE, "a", ms={"fwd": 1.0})], False)

    _, kept = bench._resumable(path, env, sweep, [CASE])
    assert [r.provider for r in kept] == ["a"]
    with pytest.raises(SystemExit, match="rounds is 1, this run's 3"):
        bench._resumable(path, env, {**sweep, "rounds": 3}, [CASE])


def _report():
    path = Path(__file__).parents[1] / "benchmarks" / "report.py"
    spec = importlib.util.spec_from_file_location("report", path)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    return report


def test_the_report_names_the_commit_that_holds_a_runs_source():
    """benchmarks/report.py finds a run's commit by its source digest (a device's copy of the checkout can carry
    stale git metadata); its digest of a commit is the bench's own of that source."""
    report = _report()
    head = report._git("rev-parse", "HEAD")
    if head is None:
        pytest.skip("not a git checkout")
    digest = report.package_digest(head.decode().strip())
    if not report._git("status", "--porcelain", "--", report.PACKAGE):  # the package is HEAD's, as in CI's clone
        assert digest == bench._source_digest()
    found = report.commit_of(digest)
    assert found is not None and report.package_digest(found[0]) == digest
    assert report.commit_of("no such digest") is None
