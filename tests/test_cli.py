"""The command line: ``flashtriton --help`` and ``--version``, each command's options, a bench without matplotlib."""

import json
import sys
from pathlib import Path

import pytest
import torch

import flashtriton
from flashtriton import __main__ as cli


def _exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    return exited.value.code


def test_help_lists_the_commands(capsys):
    assert _exit_code(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("bench", "demo"):
        assert f"\n    {command} " in out


def test_no_command_prints_the_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "commands:" in capsys.readouterr().err


def test_version(capsys):
    assert _exit_code(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"flashtriton {flashtriton.__version__} (torch {torch.__version__}, triton ")


@pytest.mark.parametrize("command", ["bench", "demo"])
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
