"""benchmarks/probes/gemm.py's command line, on CPU: one subcommand per probe, a mistyped one refused (it used to run
the default probe)."""

import re

import pytest

from benchmarks.probes import gemm as probe_gemm


def test_the_docstrings_modes_are_the_subcommands():
    assert re.findall(r"python -m benchmarks\.probes\.gemm (\S+)", probe_gemm.__doc__) == list(probe_gemm.MODES)


def test_help_lists_every_mode_with_what_it_measures(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # argparse would break a narrow terminal's lines at hyphens too
    with pytest.raises(SystemExit) as exit_:
        probe_gemm.main(["--help"])
    assert exit_.value.code == 0
    listing = " ".join(capsys.readouterr().out.split())  # a long mode name puts its help on the next line
    for mode, (_, measures) in probe_gemm.MODES.items():
        assert f"{mode} {' '.join(measures.split())}" in listing


def test_an_unknown_mode_is_refused_in_one_line_naming_the_modes(capsys):
    with pytest.raises(SystemExit) as exit_:
        probe_gemm.main(["strem"])
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "invalid choice: 'strem'" in errors[0]
    assert all(f"'{mode}'" in errors[0] for mode in probe_gemm.MODES)
