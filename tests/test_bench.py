"""flashtriton bench's timing protocol: providers timed in rounds, the order rotated, medians reported, a
provider that fails reported as unavailable; --resume refuses a run measured another way."""

import importlib.util
import shutil
import subprocess
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


def test_resume_refuses_a_run_timed_another_way(tmp_path):
    env = bench.environment()
    sweep = {"modes": ["fwd"], "providers": ["a"], "dtype": "float32", "rounds": 1}
    path = str(tmp_path / "results.json")
    bench._write_json(path, {"environment": env, "sweep": sweep}, [bench.Result(CASE, "a", ms={"fwd": 1.0})], False)

    _, kept = bench._resumable(path, env, sweep, [CASE])
    assert [r.provider for r in kept] == ["a"]
    with pytest.raises(SystemExit, match="rounds is 1, this run's 3"):
        bench._resumable(path, env, {**sweep, "rounds": 3}, [CASE])
    with pytest.raises(SystemExit, match="autotune is False, this run's True"):
        bench._resumable(path, {**env, "autotune": True}, sweep, [CASE])


def _report():
    path = Path(__file__).parents[1] / "benchmarks" / "report.py"
    spec = importlib.util.spec_from_file_location("report", path)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    return report


def test_the_reports_digest_is_the_benchs():
    """benchmarks/report.py's digest of a commit's package is flashtriton.bench's of the same source."""
    report = _report()
    head = report._git("rev-parse", "HEAD")
    if head is None or report._git("status", "--porcelain", "--", report.PACKAGE):
        pytest.skip("the package here is not a commit's (CI's clean clone is)")
    assert report.package_digest(head.decode().strip()) == bench.autotune.source_digest()


def _commit(repo: Path, message: str, files: dict[str, str]) -> str:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git = ["git", "-C", str(repo), "-c", "user.name=test", "-c", "user.email=test@example.invalid"]
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", message], check=True)
    return subprocess.check_output([*git, "rev-parse", "HEAD"], text=True).strip()


def test_the_report_names_the_commit_that_introduced_a_runs_source(tmp_path, monkeypatch):
    """A run is named by the commit that introduced its package source (a device's copy of the checkout can carry
    stale git metadata), not by a later commit that changed only other files; a run whose checkout named another
    source says so."""
    report = _report()
    if shutil.which("git") is None:
        pytest.skip("no git")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    monkeypatch.setattr(report, "REPO", tmp_path)
    first = _commit(tmp_path, "v1", {"src/flashtriton/a.py": "x = 1\n", "src/flashtriton/sub/b.py": "y = 2\n"})
    docs = _commit(tmp_path, "docs", {"README.md": "docs\n", "src/flashtriton/notes.txt": "not source\n"})
    second = _commit(tmp_path, "v2", {"src/flashtriton/a.py": "x = 3\n"})
    v1, v2 = report.package_digest(first), report.package_digest(second)
    assert v1 != v2 and report.package_digest(docs) == v1
    assert report.commit_of(v1) == (first, "v1")
    assert report.commit_of(v2) == (second, "v2")
    assert report.commit_of("no such digest") is None
    stale = report._source_line({"source_digest": v1, "commit": second, "commit_subject": "v2"})
    assert stale.startswith(f"commit `{first[:10]}` (v1), found by the source digest") and second[:10] in stale
    assert "found by" not in report._source_line({"source_digest": v1, "commit": docs, "commit_subject": "docs"})
