"""The command line: ``flashtriton --help`` and ``--version``, each command's options, a bench without matplotlib,
and ``flashtriton warmup`` where there is no GPU to compile for."""

import json
import sys
from pathlib import Path

import pytest
import torch

import flashtriton
from flashtriton import __main__ as cli
from flashtriton import warmup


def _exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    return exited.value.code


def test_help_lists_the_commands(capsys):
    assert _exit_code(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("bench", "demo", "warmup"):
        assert f"\n    {command} " in out


def test_no_command_prints_the_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "commands:" in capsys.readouterr().err


def test_version(capsys):
    assert _exit_code(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"flashtriton {flashtriton.__version__} (torch {torch.__version__}, triton ")


@pytest.mark.parametrize("command", ["bench", "demo", "warmup"])
def test_each_command_has_its_help(command, capsys):
    assert _exit_code([command, "--help"]) == 0
    assert capsys.readouterr().out.startswith(f"usage: flashtriton {command} ")


def test_demo_is_a_quick_bench_without_the_plot():
    args = cli.build_parser().parse_args(["demo", "--rounds", "1"])
    assert (args.quick, args.no_plots, args.out, args.rounds) == (True, True, "out/demo", 1)
    assert args.providers == cli.DEMO_PROVIDERS and args.run is cli.bench.run


def test_bench_without_matplotlib_still_writes_the_table_and_json(tmp_path, monkeypatch, capsys):
    """And runs the head dim and dtype asked for on the CPU, and says where the results are."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: find_spec finds nothing
    argv = ["--head-dims", "32", "--dtype", "bfloat16", "--seqlens", "16", "--causal", "no", "--modes", "fwd"]
    argv += ["--providers", "flashtriton", "standard", "--rounds", "1", "--out", str(tmp_path / "run")]
    assert cli.main(["bench", *argv]) == 0

    out, err = capsys.readouterr()
    assert "the plot will be skipped (matplotlib is not installed: pip install 'flashtriton[bench]'" in err
    assert "a CPU run" not in err  # every CPU default was overridden: nothing to note
    lines = out.splitlines()
    assert lines[0].startswith("case") and "x standard" in lines[0]
    assert lines[1].split()[:2] == ["d32-n16", "fwd"]
    json_path = tmp_path / "run" / "results.json"
    assert f"results: {json_path}" in lines
    assert "plot: skipped (matplotlib is not installed: pip install 'flashtriton[bench]' adds it)" in lines
    assert not (tmp_path / "run" / "bench.png").exists()
    assert any(line.startswith("first fwd+bwd call, JIT compile included") for line in lines)
    payload = json.loads(json_path.read_text())
    assert payload["complete"] and payload["sweep"]["dtype"] == "bfloat16"
    assert [(r["provider"], r["case"]["head_dim"], r["case"]["dtype"]) for r in payload["results"]] == [
        ("flashtriton", 32, "bfloat16"),
        ("standard", 32, "bfloat16"),
    ]


def test_results_are_written_under_the_absolute_path(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    argv = ["bench", "--head-dims", "16", "--seqlens", "16", "--causal", "yes", "--modes", "fwd", "--rounds", "1"]
    assert cli.main([*argv, "--providers", "flashtriton", "--out", "rel", "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert f"results: {tmp_path / 'rel' / 'results.json'}" in out and "plot: skipped (--no-plots)" in out
    assert Path(tmp_path / "rel" / "results.json").is_file()


def test_a_bench_whose_providers_cannot_run_here_still_reports(tmp_path, monkeypatch, capsys):
    """cuDNN alone on a CPU: every case unavailable, the plot drawn without a legend (it raised with none to show),
    the table and the results' path printed."""
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["bench", "--head-dims", "16", "--seqlens", "16", "--causal", "no", "--modes", "fwd", "--rounds", "1"]
    assert cli.main([*argv, "--providers", "sdpa-cudnn", "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "unavailable: sdpa-cudnn" in out and f"results: {tmp_path / 'run' / 'results.json'}" in out
    assert (tmp_path / "run" / "bench.png").is_file()


def test_warmup_without_a_gpu_has_nothing_to_compile(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["warmup"]) == 0
    assert capsys.readouterr().out.startswith("no CUDA GPU here: nothing to compile")


def test_warmup_options_narrow_the_variants():
    args = cli.build_parser().parse_args(["warmup"])
    todo = warmup.variants(args.head_dims, [False, True], args.dtypes, args.seqlens)
    assert len(todo) == 3 * 2 * 2 * 3 and todo[0].name == "d64-bfloat16-n512"
    args = cli.build_parser().parse_args(["warmup", "--head-dims", "128", "--causal", "yes", "--dtypes", "float16"])
    assert (args.head_dims, args.causal, args.dtypes, args.seqlens) == ([128], "yes", ["float16"], [512, 2048, 8192])
    assert warmup.variants([128], [True], ["float16"], [512])[0].name == "d128-causal-float16-n512"


@pytest.mark.parametrize("argv", [["--head-dims", "0"], ["--seqlens", "0"]])
def test_bench_refuses_empty_shapes(argv, capsys):
    """A length or head dim of 0 is refused before anything runs (it ran no case and crashed in the plot)."""
    assert _exit_code(["bench", *argv]) == 2
    assert "flashtriton bench: error: argument" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--head-dims", "300"], ["--head-dims", "12"], ["--seqlens", "0"]])
def test_warmup_refuses_what_cannot_run(argv, capsys):
    assert _exit_code(["warmup", *argv]) == 2
    assert "flashtriton warmup: error: argument" in capsys.readouterr().err


def test_a_warmup_variant_runs_forward_and_backward(monkeypatch):
    """The GPU's calls, on the CPU's PyTorch path: a forward without grad, then a forward and a backward."""
    calls, real = [], warmup.flash_attn_func

    def spy(q, k, v, **options):
        calls.append((torch.is_grad_enabled(), q, options))
        return real(q, k, v, **options)

    monkeypatch.setattr(warmup, "flash_attn_func", spy)
    forward_s, both_s = warmup.warm(warmup.Variant(64, True, "bfloat16", 16), torch.device("cpu"))
    assert forward_s > 0 and both_s > 0
    (no_grad, q0, options0), (grad, q1, options1) = calls
    assert (no_grad, q0.requires_grad, grad, q1.requires_grad) == (False, False, True, True)
    assert options0 == options1 == {"causal": True}
    assert q1.shape == (1, 16, warmup.HIDDEN // 64, 64) and q1.dtype == torch.bfloat16
    assert q1.grad is not None and torch.isfinite(q1.grad).all() and q1.grad.abs().sum() > 0
