"""flashtriton bench's timing protocol: providers timed in rounds, the order rotated, their calls taken in turn,
medians reported, a provider that fails reported as unavailable; --resume refuses a run measured another way;
the sweep's choices per device, the progress line and the summary; the users suite's cases, its CPU run, its parts,
host timer and memory ratios; the decode suite's table, skipped cases, inputs, CPU run and parts."""

import argparse
import importlib.util
import io
import itertools
import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from flashtriton import autotune
from flashtriton.bench import cli, decode, decode_calls, progress, summary, timing, users, users_calls
from flashtriton.bench.cases import MODES, OURS, Case, Result, attach_ratios, attention_flops
from flashtriton.bench.results import environment, load_results, resumable, write_json

CASE = Case(1, 8, 2, 16, False, "float32")
CPU = torch.device("cpu")


def _providers(order: list[str], failing: str | None = None, fail_at: int | None = None) -> dict:
    """Providers named a, b, c whose forward notes its name in ``order`` when called; ``failing`` raises on its
    first call (``fail_at`` None: in prepare) or on its fail_at-th timed call."""

    def provider(name):
        def make(q, k, v, causal):
            def fwd():
                if name == failing and fail_at is None:
                    raise RuntimeError(f"{name} does not run this case")
                order.append(name)
                if name == failing and order.count(name) == fail_at:
                    raise torch.cuda.OutOfMemoryError("out of memory")
                return q * 2.0

            return fwd

        return make

    return {name: provider(name) for name in "abc"}


def _scripted_timer(monkeypatch, order: list[str], times: dict[str, list[float]]) -> None:
    """Replaces the bench's timer: calls each of a round's calls once, in the order given (the provider's forward
    notes its name), and pops that provider's next time; a call that raises fails as the real timer's do."""

    def time_all(calls):
        taken = []
        for i in range(len(calls)):
            timing._call(calls, i)
            taken.append(times[order[-1]].pop(0))
        return taken

    monkeypatch.setattr(timing, "device_timer", lambda device: time_all)


def test_rounds_rotate_the_order_and_report_medians(monkeypatch):
    order = []
    monkeypatch.setattr(timing, "PROVIDERS", _providers(order))
    rounds = {"a": [5.0, 1.0, 3.0], "b": [2.0, 2.5, 9.0], "c": [7.0, 6.0, 8.0]}
    _scripted_timer(monkeypatch, order, {p: list(t) for p, t in rounds.items()})

    results = timing.run_case(CASE, ["a", "b", "c"], CPU, modes=("fwd",), rounds=3)

    assert order[3:] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # after each one's first call
    assert [r.provider for r in results] == ["a", "b", "c"]
    for r in results:
        assert r.unavailable is None
        assert r.ms_rounds["fwd"] == rounds[r.provider]
        assert r.ms["fwd"] == sorted(rounds[r.provider])[1]
        flops = attention_flops(1, 2, 8, 8, 16, False, "fwd")
        assert r.tflops["fwd"] == pytest.approx(flops / (r.ms["fwd"] * 1e-3) / 1e12)
        assert r.max_error > 0  # q * 2 is not attention: the error check ran on the provider's output


def test_a_failing_provider_is_reported_and_the_others_still_timed(monkeypatch):
    order = []
    monkeypatch.setattr(timing, "PROVIDERS", _providers(order, failing="b"))
    _scripted_timer(monkeypatch, order, {"a": [1.0, 2.0], "c": [3.0, 4.0]})

    a, b, c = timing.run_case(CASE, ["a", "b", "c"], CPU, modes=("fwd",), rounds=2)

    assert order[2:] == ["a", "c", "c", "a"]
    assert b.unavailable == "RuntimeError: b does not run this case" and not b.ms
    assert a.ms["fwd"] == 1.5 and c.ms["fwd"] == 3.5


def test_a_provider_failing_in_a_later_round_keeps_no_times(monkeypatch):
    """Its round is timed again without it: the others' calls beside the failed one are not kept."""
    order = []
    monkeypatch.setattr(timing, "PROVIDERS", _providers(order, failing="a", fail_at=3))
    _scripted_timer(monkeypatch, order, {"a": [1.0] * 3, "b": [1.0, 9.0, 2.0, 3.0], "c": [1.0, 9.0, 2.0, 3.0]})

    a, b, c = timing.run_case(CASE, ["a", "b", "c"], CPU, modes=("fwd",), rounds=3)

    assert order[3:] == ["a", "b", "c", "b", "c", "a", "b", "c", "c", "b"]
    assert a.unavailable.startswith("OutOfMemoryError") and not a.ms and not a.ms_rounds
    assert b.ms_rounds["fwd"] == [1.0, 2.0, 3.0] and c.ms_rounds["fwd"] == [1.0, 2.0, 3.0]


def test_the_timer_takes_the_calls_in_turn():
    """Each pass calls every provider once, starting one later each pass; each gets its median."""
    assert timing._in_turn(3, 3, lambda i: i) == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]
    taken = []
    timing._in_turn(3, 3, taken.append)
    assert taken == [0, 1, 2, 1, 2, 0, 2, 0, 1]
    calls = []
    ms = timing.device_timer(CPU)([lambda: calls.append("x"), lambda: calls.append("y")])
    assert calls == ["x", "y", "x", "y", "y", "x", "x", "y"] and len(ms) == 2 and min(ms) >= 0


def test_every_mode_is_timed_on_the_cpu():
    """The real timer on real providers: forward, backward through a kept graph, and both."""
    results = timing.run_case(CASE, ["flashtriton", "standard"], CPU, modes=MODES, rounds=2)
    for r in results:
        assert r.unavailable is None
        assert all(len(r.ms_rounds[mode]) == 2 and r.ms[mode] > 0 for mode in MODES)


def test_an_error_the_timer_cannot_pin_on_a_call_fails_the_round(monkeypatch):
    order = []
    monkeypatch.setattr(timing, "PROVIDERS", _providers(order))

    def time_all(calls):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(timing, "device_timer", lambda device: time_all)
    results = timing.run_case(CASE, ["a", "b"], CPU, modes=("fwd",), rounds=2)
    assert all(r.unavailable == "RuntimeError: CUDA error: an illegal memory access was encountered" for r in results)
    assert not any(r.ms for r in results)


def test_the_timer_names_the_call_that_failed():
    def fails():
        raise ValueError("no")

    with pytest.raises(timing._CallFailed) as failed:
        timing.device_timer(CPU)([lambda: None, fails])
    assert failed.value.index == 1 and isinstance(failed.value.error, ValueError)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_gpu_timer_times_each_call():
    """Interleaved on the GPU, a call with 8x the work takes several times as long as the other."""
    x = torch.randn(2048, 2048, device="cuda")
    small, large = timing.device_timer(torch.device("cuda"))([lambda: x @ x, lambda: [x @ x for _ in range(8)]])
    assert small > 0 and large > 4 * small


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_gpu_timer_kept_ahead_times_the_device_alone():
    """A call whose host takes 1 ms to launch a short kernel: the plain timer reads the host's wait between its
    events, the timer kept ahead of the host (the decode suite's) the kernel alone. Up to three tries: on a GPU that
    other processes share (the suite's workers), their kernels may delay the plain timer's start past the wait."""
    x = torch.randn(1024, 1024, device="cuda")

    def slow_host():
        time.sleep(1e-3)
        return x @ x

    for _ in range(3):
        (plain,) = timing.device_timer(torch.device("cuda"))([slow_host])
        (ahead,) = timing.device_timer(torch.device("cuda"), ahead=True)([slow_host])
        if plain > 0.8 and ahead < 0.5:
            break
    assert plain > 0.8 and ahead < 0.5


def test_gpu_providers_are_unavailable_on_cpu():
    (flex,) = timing.run_case(CASE, ["flex"], CPU, modes=("fwd",), rounds=2)
    assert flex.unavailable == "needs a CUDA GPU" and not flex.ms


def test_resume_refuses_a_run_timed_another_way(tmp_path):
    env = environment()
    sweep = {"modes": ["fwd"], "providers": ["a"], "dtype": "float32", "rounds": 1, "timing": timing.TIMING}
    path = str(tmp_path / "results.json")
    write_json(path, {"environment": env, "sweep": sweep}, [Result(CASE, "a", ms={"fwd": 1.0})], False)

    _, kept = resumable(path, env, sweep, [CASE])
    assert [r.provider for r in kept] == ["a"]
    with pytest.raises(SystemExit, match="rounds is 1, this run's 3"):
        resumable(path, env, {**sweep, "rounds": 3}, [CASE])
    with pytest.raises(SystemExit, match="autotune is False, this run's True"):
        resumable(path, {**env, "autotune": True}, sweep, [CASE])
    blocks = {k: v for k, v in sweep.items() if k != "timing"}  # a run from before providers were timed in turn
    write_json(path, {"environment": env, "sweep": blocks}, [Result(CASE, "a", ms={"fwd": 1.0})], False)
    with pytest.raises(SystemExit, match="timing is 'blocks', this run's 'in turn'"):
        resumable(path, env, sweep, [CASE])


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
    assert report.package_digest(head.decode().strip()) == autotune.source_digest()


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


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _clock_reads(monkeypatch, reads: list[float]) -> None:
    """progress's time.perf_counter returns these, one per call."""
    it = iter(reads)
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(it))


def test_progress_in_a_log_is_a_line_per_case_with_the_time_left(monkeypatch):
    """The estimate is the time per weight so far times the weight left: after a case of weight 1 took 10 s, the
    3 of weight left take about 30 s."""
    cases = [Case(1, n, 2, 16, False) for n in (16, 32, 64)]
    _clock_reads(monkeypatch, [0.0, 0.0, 10.0, 70.0, 80.0])
    log = io.StringIO()
    assert list(progress.progress(cases, [1.0, 2.0, 1.0], log)) == cases
    assert log.getvalue().splitlines() == [
        "0/3 cases, 0:00 elapsed, ~? left: running d16-n16",
        "1/3 cases, 0:10 elapsed, ~0:30 left: running d16-n32",
        "2/3 cases, 1:10 elapsed, ~0:23 left: running d16-n64",
        "3/3 cases in 1:20",
    ]


def test_progress_on_a_terminal_is_one_bar_redrawn(monkeypatch):
    cases = [Case(1, n, 2, 16, False) for n in (16, 32)]
    monkeypatch.setenv("COLUMNS", "200")
    _clock_reads(monkeypatch, [0.0, 0.0, 4.0, 8.0])
    terminal = _Terminal()
    list(progress.progress(cases, [1.0, 1.0], terminal))
    text = terminal.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    draws = text.rstrip("\n").split("\r")[1:]
    assert [d.split("]")[0].count("#") for d in draws] == [0, progress.PROGRESS_BAR // 2, progress.PROGRESS_BAR]
    assert "~0:04 left: running d16-n32" in draws[1] and draws[2].startswith(f"[{'#' * progress.PROGRESS_BAR}] 2/2")


def test_clock():
    assert [progress._clock(s) for s in (0, 59.6, 61, 3600 + 62)] == ["0:00", "1:00", "1:01", "1:01:02"]


def _options(*argv: str):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cpu_defaults_are_named_and_flags_given_are_honoured():
    head_dims, seqlens, dtype, notes = cli.sweep_choices(_options(), CPU)
    assert (head_dims, seqlens, dtype) == ([64], list(cli.CPU_SEQLENS), "float32")
    assert "head dim 64 (--head-dims), float32 (--dtype), lengths 512 1024 2048 (--seqlens)" in notes[0]
    assert notes[1].endswith(": sdpa-cudnn, sdpa-flash, sdpa-efficient, flex, flash_attn will be reported unavailable")

    options = _options("--head-dims", "128", "--dtype", "bfloat16", "--seqlens", "4096", "--providers", "standard")
    head_dims, seqlens, dtype, notes = cli.sweep_choices(options, CPU)
    assert (head_dims, seqlens, dtype, notes) == ([128], [4096], "bfloat16", [])
    (case,) = cli.default_cases(CPU, head_dims, seqlens, [True], dtype)
    assert (case.head_dim, case.seqlen, case.dtype, case.causal) == (128, 4096, "bfloat16", True)


def test_quick_takes_one_case_per_causal_flag_unless_flags_are_given():
    assert cli.sweep_choices(_options("--quick"), CPU)[:3] == ([64], [1024], "float32")
    assert cli.sweep_choices(_options("--quick", "--head-dims", "32"), CPU)[:2] == ([32], [1024])
    cuda = torch.device("cuda")
    assert cli.sweep_choices(_options("--quick"), cuda) == ([128], [4096], "bfloat16", [])
    assert cli.sweep_choices(_options(), cuda)[:2] == (list(cli.CUDA_HEAD_DIMS), list(cli.CUDA_SEQLENS))


def test_rounds_below_one_are_refused():
    with pytest.raises(SystemExit):
        _options("--rounds", "0")


def test_the_summary_drops_peers_that_never_ran_and_groups_what_was_unavailable():
    other = Case(1, 32, 2, 16, False, "float32")
    results = [
        Result(CASE, "flashtriton", ms={"fwd": 1.0}, tflops={"fwd": 0.5}, max_error=1e-6, first_call_s=3.0),
        Result(CASE, "standard", ms={"fwd": 2.0}, first_call_s=0.5),
        Result(CASE, "flex", unavailable="needs a CUDA GPU"),
        Result(other, "flashtriton", ms={"fwd": 2.0}, tflops={"fwd": 0.5}, max_error=1e-6, first_call_s=4.0),
        Result(other, "standard", unavailable="N x N scores too large"),
        Result(other, "flex", unavailable="needs a CUDA GPU"),
    ]
    attach_ratios(results)
    table = summary.format_table(results, ["fwd"]).splitlines()
    assert "x standard" in table[0] and "x flex" not in table[0]
    assert table[1].split()[-2:] == ["3.00", "2.00"] and table[2].split()[-2:] == ["4.00", "-"]
    assert summary._tflops(512.34) == "512.3" and summary._tflops(1.2e-4) == "0.00012"  # a CPU's keep their digits
    assert summary.unavailable_lines(results) == [
        "unavailable: flex on all 2 cases: needs a CUDA GPU",
        "unavailable: standard on d16-n32: N x N scores too large",
    ]
    assert summary.first_calls(results).endswith("flashtriton 4.00 s (d16-n32), standard 0.50 s (d16-n8)")


def _group(cases, group):
    return [c for c in cases if c.group == group]


def test_the_users_suite_lists_every_item():
    """Each item of the suite is in the GPU list with its shapes, modes and peers: dropping one fails here."""
    cases = users.gpu_cases()
    both, peers = {"fwd", "fwd_bwd"}, lambda c: set(c.providers)
    assert len({c.name for c in cases}) == len(cases)

    layout = _group(cases, "layout")
    assert {(c.batch, c.seqlen, c.layout) for c in layout} == {
        (b, n, layout) for b, n in ((1, 8192), (4, 2048)) for layout in ("model", "contiguous")
    }
    for c in layout:
        assert (c.heads, c.heads_k, c.head_dim, c.causal) == (16, 4, 128, True) and set(c.modes) == both
        assert peers(c) == {OURS, "sdpa-cudnn", "sdpa-cudnn-view"}

    lengths = _group(cases, "lengths")
    ragged, whole = (1000, 3000, 4000, 8000, 15000), (1024, 3072, 4096, 8192, 16384)
    assert sorted((c.seqlen, c.head_dim, c.causal) for c in lengths) == sorted(
        itertools.product(ragged + whole, (64, 128, 256), (False, True))
    )
    for c in lengths:
        assert abs(c.batch * c.seqlen - 16384) < c.seqlen and c.heads * c.head_dim == 2048 and c.heads == c.heads_k
        assert set(c.modes) == both and peers(c) == {OURS, "sdpa-cudnn", "flex"}
    for inside, tiles in zip(ragged, whole, strict=True):  # neighbours in the table
        i = [c.seqlen for c in lengths].index(inside)
        assert lengths[i + 1].seqlen == tiles and lengths[i + 1].head_dim == lengths[i].head_dim

    (documents,) = _group(cases, "documents")
    assert len(documents.documents) == 8 and sum(documents.documents) == documents.seqlen == 16384
    assert len(set(documents.documents)) == 8 and any(n % 128 for n in documents.documents)  # ragged
    assert (documents.heads, documents.head_dim, documents.causal) == (16, 128, True)
    assert set(documents.modes) == both and peers(documents) == {OURS, "flex"}

    for n, d, causal in itertools.product((512, 1024), (64, 128, 256), (False, True)):
        assert any(
            (c.seqlen, c.head_dim, c.causal, c.batch * c.seqlen, c.measure) == (n, d, causal, 16384, "time")
            and "fwd_bwd" in c.modes
            and "sdpa-cudnn" in c.providers
            for c in cases
        ), (n, d, causal)

    (gqa,) = _group(cases, "gqa")
    assert (gqa.heads, gqa.heads_k, gqa.head_dim, gqa.seqlen, gqa.causal) == (32, 8, 128, 4096, True)
    assert set(gqa.modes) == both

    host = _group(cases, "host")
    assert all(c.measure == "host" and set(c.modes) == both and peers(c) == {OURS, "sdpa-cudnn"} for c in host)
    shapes = {(c.batch, c.seqlen, c.heads, c.head_dim) for c in host}
    assert (1, 128, 1, 64) in shapes and any(n <= 1024 and b * n == 16384 for b, n, _, _ in shapes)

    memory = _group(cases, "memory")
    assert sorted(c.batch * c.seqlen for c in memory) == [16384, 131072]
    for c in memory:
        assert (c.measure, c.batch, c.heads, c.head_dim, c.causal, c.modes) == (
            "memory",
            1,
            16,
            128,
            True,
            ("fwd_bwd",),
        )
        assert peers(c) == {OURS, "sdpa-cudnn"}

    assert [c.group for c in users.first_of_each_group(cases)] == list(users.GROUPS)
    assert {c.group for c in users.cpu_cases()} == set(users.GROUPS)


def _suite_run(tmp_path, monkeypatch, suite: str, *argv) -> dict:
    """A suite's CPU run into tmp_path / suite: its results.json."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / suite
    assert cli.run(_options("--suite", suite, "--rounds", "1", "--out", str(out), *argv)) == 0
    return json.loads((out / "results.json").read_text())


def test_the_users_suite_on_a_cpu_writes_results_and_a_table(tmp_path, monkeypatch, capsys):
    payload = _suite_run(tmp_path, monkeypatch, "users")
    out, err = capsys.readouterr()
    assert "no CUDA GPU: a tiny case of each users group, float32" in err
    assert payload["complete"] and payload["device"] == "cpu" and payload["sweep"]["suite"] == "users"
    assert payload["environment"]["torch"] == torch.__version__ and "ratios" in payload["definitions"]
    _, results = load_results(str(tmp_path / "users" / "results.json"))
    cases = users.cpu_cases()
    assert [r.case for r in results if r.provider == OURS] == cases  # read back as the suite's records
    by = {(r.case, r.provider): r for r in results}
    for r in results:
        if r.provider in users_calls.USERS_GPU_ONLY:
            assert r.unavailable == "needs a CUDA GPU" and not r.ms
            continue
        assert r.unavailable is None and r.max_error < 1e-4, r  # each layout's output read back as (B, N, H, D)
        timed = () if r.case.measure == "memory" else r.case.modes
        assert set(r.ms) == set(timed) and all(ms > 0 for ms in r.ms.values())
        assert set(r.tflops) == (set(timed) if r.case.measure == "time" else set())
        if r.provider == OURS and (r.case, "sdpa") in by and timed:
            sdpa = by[r.case, "sdpa"]
            assert r.ratios["sdpa"] == pytest.approx({m: sdpa.ms[m] / r.ms[m] for m in timed})

    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("group"))
    assert lines[start].split()[-1] == "sdpa" and "flex" not in lines[start]  # no column for a peer that never ran
    expected = [(c.group, c.name, m) for c in cases for m in c.modes]
    rows = [line.split() for line in lines[start + 1 : start + 1 + len(expected)]]
    assert [tuple(row[:3]) for row in rows] == expected
    units = {"time": "ms", "host": "us", "memory": "MiB"}
    assert [row[4] for row in rows] == [units[c.measure] for c in cases for _ in c.modes]
    assert any(line.startswith("unavailable: flex on ") for line in lines)


def test_users_parts_resume_into_one_results_json(tmp_path, monkeypatch):
    first = _suite_run(tmp_path, monkeypatch, "users", "--part", "1/2")
    assert not first["complete"] and first["part"] == "1/2" and first["results"]
    path = str(tmp_path / "users" / "results.json")
    second = _suite_run(tmp_path, monkeypatch, "users", "--part", "2/2", "--resume", path)
    assert second["complete"]
    ours = [r["case"] for r in second["results"] if r["provider"] == OURS]
    assert ours == [json.loads(json.dumps(c.__dict__)) for c in users.cpu_cases()]
    assert all(r in second["results"] for r in first["results"])  # the first part's rows kept as measured


def test_parts_cover_the_suite_once_and_keep_a_length_beside_its_neighbour():
    cases = users.gpu_cases()
    assert cli.part_of(cases, None) == cases
    for n in (1, 2, 3):
        parts = [cli.part_of(cases, (k, n)) for k in range(1, n + 1)]
        assert [c for part in parts for c in part] == cases and all(parts)
        for part in parts:
            lengths = [(c.head_dim, c.causal, c.seqlen) for c in _group(part, "lengths")]
            for d, causal, (inside, tiles) in itertools.product((64, 128, 256), (False, True), users.LENGTHS):
                assert ((d, causal, inside) in lengths) == ((d, causal, tiles) in lengths)
    assert _options("--part", "2/3").part == (2, 3)
    for bad in ("0/2", "3/2", "1", "a/b"):
        with pytest.raises(SystemExit):
            _options("--part", bad)


def test_the_users_suite_refuses_the_paper_sweeps_shape_flags(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for flags in (["--seqlens", "128"], ["--causal", "yes"], ["--modes", "fwd"], ["--head-dims", "64"]):
        with pytest.raises(SystemExit, match=f"chooses its own shapes and modes .*: drop {flags[0]}"):
            cli.run(_options("--suite", "users", "--out", str(tmp_path), *flags))
    with pytest.raises(SystemExit, match="--providers sdpa-cudnn-view: only in --suite users"):
        cli.run(_options("--providers", "sdpa-cudnn-view", "--out", str(tmp_path)))
    suite = cli.users_suite(_options("--suite", "users", "--providers", OURS, "standard"), CPU)
    assert suite.notes[0] == "not in the users suite, so not run: standard"
    assert all(suite.providers_of(c) == [OURS] for c in suite.cases)


def test_the_host_timer_times_blocks_of_calls_in_turn(monkeypatch):
    """A block of calls then one synchronize, per-call milliseconds, the calls' blocks taken in turn."""
    monkeypatch.setattr(timing, "CPU_HOST_CALLS", 4)
    clock, taken = [0.0], []
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])

    def call(name, seconds):
        def run():
            taken.append(name)
            clock[0] += seconds

        return run

    ms = timing.host_timer(CPU)([call("a", 1e-3), call("b", 3e-3)])
    assert ms == pytest.approx([1.0, 3.0])
    blocks = ["a", "b", "b", "a", "a", "b"][: 2 * timing.HOST_PASSES]
    assert taken == ["a", "b"] + [name for name in blocks for _ in range(4)]


def test_memory_cases_report_peak_ratios():
    case = _group(users.gpu_cases(), "memory")[0]
    ours = Result(case, OURS, peak_extra_mib=100.0, max_error=1e-3, first_call_s=1.0)
    peer = Result(case, "sdpa-cudnn", peak_extra_mib=250.0, max_error=1e-3, first_call_s=0.1)
    users_calls.attach_users_ratios([ours, peer])
    assert ours.ratios == {"sdpa-cudnn": {"peak_extra_mib": 2.5}}
    table = summary.format_users_table([ours, peer]).splitlines()
    assert table[1].split() == ["memory", case.name, "fwd_bwd", "100.0", "MiB", "1.0e-03", "2.50"]


def test_users_inputs_reach_flashtriton_in_the_cases_layout(monkeypatch):
    """A model's layout: (B, N, H, D) views of (B, H, N, D) storage; documents: packed, with their offsets; fwd_bwd:
    fresh gradients of the leaves, none accumulated."""
    seen = []
    for name in ("flash_attn_func", "flash_attn_varlen_func"):
        real = getattr(users_calls, name)
        monkeypatch.setattr(users_calls, name, lambda *a, real=real, **kw: seen.append(a) or real(*a, **kw))
    model, contiguous = _group(users.cpu_cases(), "layout")
    for case in (model, contiguous):
        trial = users_calls.UserTrial(Result(case, OURS), CPU)
        assert trial.prepare(case.modes)
        q, k, _ = seen[-1]
        assert q.shape == (case.batch, case.seqlen, case.heads, case.head_dim) and k.shape[2] == case.heads_k
        assert q.transpose(1, 2).is_contiguous() == (case is model) and q.is_contiguous() == (case is contiguous)
        grads = trial.call("fwd_bwd")()
        assert [g.shape for g in grads] == [x.shape for x in trial.leaves] and all(x.grad is None for x in trial.leaves)
    (documents,) = _group(users.cpu_cases(), "documents")
    assert users_calls.UserTrial(Result(documents, OURS), CPU).prepare(documents.modes)
    q, _, _, cu_seqlens_q, _, longest, _ = seen[-1]
    assert q.shape == (documents.seqlen, documents.heads, documents.head_dim)
    assert cu_seqlens_q.tolist() == [0, *itertools.accumulate(documents.documents)]
    assert longest == max(documents.documents)


def test_the_decode_suite_lists_every_item():
    """Every combination of the table's axes is run or named as skipped; only the caches over the budget are
    skipped; seqlen_q 4 is causal; each case has its peers."""
    cases, skipped = decode.gpu_cases()
    table = decode.all_gpu_cases()
    assert len({c.name for c in table}) == len(table) == 3 * 4 * 2 * 2 * 3
    assert {(c.batch, c.cache_len, c.head_dim, c.seqlen_q, c.page_size) for c in table} == set(
        itertools.product((1, 8, 64), (1024, 4096, 32768, 131072), (128, 64), (1, 4), (0, 16, 256))
    )
    assert cases == [c for c in table if c.name not in skipped] and len(cases) == 138
    assert {(c.batch, c.cache_len, c.head_dim) for c in table if c.name in skipped} == {(64, 131072, 128)}
    assert all(decode.held_bytes(c) <= decode.MEMORY_BUDGET for c in cases)
    for c in table:
        assert (c.heads, c.heads_k, c.dtype, c.causal) == (32, 8, "bfloat16", c.seqlen_q == 4)
        assert c.providers == (OURS, "sdpa-cudnn", "sdpa-flash", "flex")
    big = next(c for c in table if c.name in skipped)
    assert big.kv_bytes == 2 * 64 * 131072 * 8 * 128 * 2
    assert skipped[big.name] == "K and V held 68.7 GB, over the 40 GB budget"
    assert {(c.seqlen_q, c.page_size) for c in decode.quick(cases)} == set(itertools.product((1, 4), (0, 16, 256)))
    assert {(c.seqlen_q, c.page_size) for c in decode.cpu_cases()} == set(itertools.product((1, 4), (0, 16, 256)))


def test_decode_parts_cover_the_suite_once_and_keep_a_shapes_layouts_together():
    cases, _ = decode.gpu_cases()
    for n in range(1, decode.PARTS + 1):
        parts = [cli.part_of(cases, (k, n), decode.unit) for k in range(1, n + 1)]
        assert [c for part in parts for c in part] == cases and all(parts)
        shapes = [{decode.unit(c) for c in part} for part in parts]
        assert sum(len(s) for s in shapes) == len(set().union(*shapes))  # no shape in two parts


def test_the_decode_suite_on_a_gpu_names_what_it_skips():
    suite = cli.decode_suite(_options("--suite", "decode"), torch.device("cuda"))
    assert len(suite.cases) == 138 and len(suite.sweep["skipped"]) == 6
    assert suite.sweep["modes"] == ["fwd", "host"] and suite.sweep["host_calls"] == decode_calls.HOST_CALLS
    (line,) = [n for n in suite.notes if n.startswith("skipped: ")]
    assert line.endswith(": K and V held 68.7 GB, over the 40 GB budget") and line.count("b64-l131072") == 6
    with pytest.raises(SystemExit, match=r"--suite decode chooses its own shapes and modes .*: drop --seqlens"):
        cli.decode_suite(_options("--suite", "decode", "--seqlens", "128"), CPU)


def test_decode_inputs_reach_flashtriton_as_a_cache_and_the_peers_as_its_dense_copy(monkeypatch):
    """A paged cache: a shuffled block table over every page, read whole (cache_seqlens = L); the peers' dense
    copy holds each sequence's rows in order; seqlen_q 4 is causal, aligned bottom-right."""
    seen = []
    real = decode_calls.flash_attn_with_kvcache
    monkeypatch.setattr(
        decode_calls, "flash_attn_with_kvcache", lambda *a, **kw: seen.append((a, kw)) or real(*a, **kw)
    )
    case = next(c for c in decode.cpu_cases() if c.page_size == 16 and c.seqlen_q == 4)
    inputs = decode_calls.DecodeInputs(case, CPU)
    trial = decode_calls.DecodeTrial(Result(case, OURS), CPU, inputs)
    assert trial.prepare(decode_calls.MODES) and trial.result.max_error < 1e-5
    (q, k_cache, v_cache), options = seen[-1]
    pages = case.batch * case.cache_len // 16
    assert k_cache.shape == (pages, 16, case.heads_k, case.head_dim) and q.shape == (2, 4, 4, 16)
    assert sorted(options["block_table"].flatten().tolist()) == list(range(pages))
    assert options["block_table"].flatten().tolist() != list(range(pages))  # shuffled
    assert options["cache_seqlens"].tolist() == [case.cache_len] * case.batch and options["causal"]
    _, k, v = inputs.dense
    for b in range(case.batch):
        pages_b = options["block_table"][b].long()
        for cache, dense in ((k_cache, k), (v_cache, v)):
            assert torch.equal(dense[b], cache[pages_b].flatten(0, 1).transpose(0, 1)) and dense.is_contiguous()
    mask = decode_calls._bottom_right_mask(case, q)
    assert mask.shape == (1, 1, 4, case.cache_len)
    assert [int((row == 0).sum()) for row in mask[0, 0]] == [case.cache_len - 3 + i for i in range(4)]
    assert torch.isinf(mask).sum() == 3 + 2 + 1


def test_the_decode_suite_on_a_cpu_writes_results_and_a_table(tmp_path, monkeypatch, capsys):
    payload = _suite_run(tmp_path, monkeypatch, "decode")
    out, err = capsys.readouterr()
    assert "no CUDA GPU: a tiny case per seqlen_q and cache layout, float32" in err
    assert payload["complete"] and payload["sweep"]["suite"] == "decode" and payload["sweep"]["skipped"] == {}
    assert {"tb_per_s", "case", "ms", "sweep.skipped"} <= set(payload["definitions"])
    _, results = load_results(str(tmp_path / "decode" / "results.json"))
    cases = decode.cpu_cases()
    assert [r.case for r in results if r.provider == OURS] == cases  # read back as the suite's records
    by = {(r.case, r.provider): r for r in results}
    for r in results:
        if r.provider in decode_calls.DECODE_GPU_ONLY:
            assert r.unavailable == "needs a CUDA GPU" and not r.ms
            continue
        assert r.unavailable is None and r.max_error < 1e-5, r
        assert set(r.ms) == {"fwd", "host"} and all(ms > 0 for ms in r.ms.values()) and not r.tflops
        assert r.tb_per_s == {"fwd": pytest.approx(r.case.kv_bytes / (r.ms["fwd"] * 1e-3) / 1e12)}
        if r.provider == OURS:
            sdpa = by[r.case, "sdpa"]
            assert r.ratios == {"sdpa": pytest.approx({m: sdpa.ms[m] / r.ms[m] for m in ("fwd", "host")})}

    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("case"))
    rows = [line.split() for line in lines[start + 1 : start + 1 + 2 * len(cases)]]
    assert [tuple(row[:2]) for row in rows] == [(c.name, p) for c in cases for p in (OURS, "sdpa")]
    for row, r in zip(rows, (by[c, p] for c in cases for p in (OURS, "sdpa")), strict=True):
        assert float(row[2]) == pytest.approx(r.ms["fwd"], abs=1e-4) and float(row[4]) == pytest.approx(
            r.ms["host"] * 1e3, abs=0.1
        )
        x = by[r.case, OURS].ratios.get(r.provider, {})
        assert row[5:7] == ([f"{x['fwd']:.2f}", f"{x['host']:.2f}"] if x else ["-", "-"])
    assert any(line.startswith("unavailable: flex on all 6 cases") for line in lines)
    assert any(line.startswith("first call, JIT compile included") for line in lines)


def test_decode_parts_resume_into_one_results_json(tmp_path, monkeypatch):
    first = _suite_run(tmp_path, monkeypatch, "decode", "--part", "1/2", "--providers", OURS, "sdpa")
    assert not first["complete"] and first["part"] == "1/2" and first["results"]
    path = str(tmp_path / "decode" / "results.json")
    second = _suite_run(tmp_path, monkeypatch, "decode", "--part", "2/2", "--providers", OURS, "sdpa", "--resume", path)
    assert second["complete"] and second["sweep"]["providers"] == [OURS, "sdpa"]
    ours = [r["case"] for r in second["results"] if r["provider"] == OURS]
    assert ours == [json.loads(json.dumps(c.__dict__)) for c in decode.cpu_cases()]
    assert all(r in second["results"] for r in first["results"])  # the first part's rows kept as measured
