"""Every command-line program of the tree reads its flags before it imports the heavy libraries, so that `--help` and
a flag mistake take no seconds on a small machine: each program found (a module with a `__main__` block, a package's
__main__.py, the llm-compressor script) runs as a user runs it, and `python -X importtime` says what it imported. No
wall times are asserted (the CI machine is shared); the import budget is what keeps them short. Also here: the
example commands each --help shows parse with the program's own parser, as written (the checkout's files they name
exist), and no deepspeed warning reaches the user where nothing uses deepspeed."""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from clis import quantize_nvfp4
from fakes import train_argv

from benchmarks.launch import REPO, child_env

HEAVY = ("torch", "transformers", "peft", "datasets", "trl", "vllm", "deepspeed", "scipy", "matplotlib", "accelerate")
SCRIPTS = ("llm-compressor/quantize_nvfp4.py",)
DEEPSPEED_NOISE = "real_accelerator.py"  # deepspeed's "[WARNING] ... Setting accelerator to CPU" on import


def programs() -> list[str]:
    """Module names (python -m) and script paths."""
    found = []
    for root in ("qerl", "eval", "benchmarks", "experiments"):
        for path in sorted((REPO / root).rglob("*.py")):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            if path.name == "__main__.py":
                found.append(module.removesuffix(".__main__"))
            elif 'if __name__ == "__main__":' in path.read_text():
                found.append(module)
    return found + list(SCRIPTS)


def command(program: str) -> list[str]:
    return [program] if program in SCRIPTS else ["-m", program]


@functools.cache
def run(program: str, *args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-X", "importtime", *command(program), *args]
    return subprocess.run(argv, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)


def heavy_imports(stderr: str) -> list[str]:
    """The heavy top-level packages among what -X importtime listed ("import time: self | cumulative | name")."""
    names = {
        line.split("|")[2].strip().split(".")[0] for line in stderr.splitlines() if line.startswith("import time:")
    }
    return sorted(names.intersection(HEAVY))


def test_the_search_finds_the_programs():
    found = programs()
    for program in ("qerl.train", "qerl.quantize", "qerl.models", "eval.gsm8k", "benchmarks.step",
                    "benchmarks.probes.gemm", "experiments.arms", "llm-compressor/quantize_nvfp4.py"):  # fmt: skip
        assert program in found


@pytest.mark.parametrize("program", programs())
def test_help_and_a_flag_mistake_import_nothing_heavy(program):
    shown = run(program, "--help")
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert heavy_imports(shown.stderr) == []
    assert DEEPSPEED_NOISE not in shown.stdout + shown.stderr
    wrong = run(program, "--no-such-flag")
    assert wrong.returncode == 2, wrong.stderr[-3000:]
    assert heavy_imports(wrong.stderr) == []


@pytest.mark.parametrize("program", ["qerl.train", "qerl.quantize", "qerl.models", "eval.gsm8k", *SCRIPTS])
def test_the_users_programs_say_what_an_unset_flag_does(program):
    """A flag whose default is None says in words what happens without it (qerl.cli.HelpFormatter shows the value
    of every other default, once)."""
    assert "(default: None)" not in run(program, "--help").stdout


@pytest.mark.slow
def test_a_training_run_says_nothing_of_deepspeed(checkpoints, tmp_path):
    """accelerate imports deepspeed wherever it is installed, on every save_pretrained and training step; a run that
    does not use it does not import it (qerl.cli.hide_unused_deepspeed), so its warning never shows."""
    argv = [sys.executable, "-m", "qerl.train", *train_argv(checkpoints[1], str(tmp_path / "run"), 1)]
    done = subprocess.run(argv, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run" / "adapter_config.json").is_file()
    assert DEEPSPEED_NOISE not in done.stdout + done.stderr  # deepspeed's logger writes to stdout


# ----------------------------------------------------------------------------------------------------------
# The example commands of each --help


class Parsed(Exception):
    """Raised instead of running the program once its flags are parsed."""


def examples(program: str, text: str) -> list[list[str]]:
    """The argument lists of the example commands `text` shows for `program`: indented lines that run it, perhaps
    under another command (ncu), not inside a sentence's parentheses or quotes; shell continuations joined,
    `# comments` dropped."""
    invocation = re.escape(f"python {program}" if program in SCRIPTS else f"python -m {program}")
    found = []
    for line in text.replace("\\\n", " ").splitlines():
        match = re.fullmatch(rf"\s+([^(`]*\s)?{invocation}(\s.*)?", line)
        if match:
            found.append(shlex.split(match.group(2) or "", comments=True))
    return found


def tracked_folders() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return {line.split("/")[0] for line in out.stdout.splitlines() if "/" in line}


def check_paths(argv: list[str], folders: set[str]) -> None:
    """A relative path into the checkout names a file a clone has; none reaches outside it."""
    for value in (arg.split("=", 1)[-1] for arg in argv):
        parts = Path(value).parts
        if "/" not in value or value.startswith("/") or not parts:
            continue
        assert parts[0] != "..", f"{value}: outside a clone"
        if parts[0] in folders:
            assert (REPO / value).exists(), f"{value}: not in a clone"


def main_of(program: str):
    if program in SCRIPTS:
        return quantize_nvfp4.main
    module = importlib.import_module(program)
    return getattr(module, "main", None) or importlib.import_module(f"{program}.__main__").main


@pytest.mark.parametrize("program", programs())
def test_the_examples_in_help_parse_as_written(program, monkeypatch):
    text = run(program, "--help").stdout
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    folders = tracked_folders()
    for argv in examples(program, text):
        check_paths(argv, folders)
        with pytest.raises(Parsed):
            main_of(program)(argv)


def test_examples_are_read_as_a_user_copies_them():
    text = """usage: x
    python -m eval.gsm8k --data a.jsonl --protocol greedy \\
        --limit 3    # a comment
  --model MODEL   a fetchable model (python -m qerl.models list)
ncu -k regex:_gemm python -m benchmarks.probes.gemm ncu
    ncu -k regex:_gemm python -m benchmarks.probes.gemm ncu
"""
    assert examples("eval.gsm8k", text) == [["--data", "a.jsonl", "--protocol", "greedy", "--limit", "3"]]
    assert examples("qerl.models", text) == []  # an option's help names the program, but runs it with nothing
    assert examples("benchmarks.probes.gemm", text) == [["ncu"]]


def test_no_docstring_swallows_a_shell_line_continuation():
    """A backslash that ends a line of an example in a plain docstring joins the two lines in --help (Python reads it
    as its own continuation): such a docstring is raw."""
    joined = []
    for path in sorted(
        p for root in ("qerl", "eval", "benchmarks", "experiments") for p in (REPO / root).rglob("*.py")
    ):
        tree = ast.parse(path.read_text())
        source = ast.get_source_segment(path.read_text(), tree.body[0]) if ast.get_docstring(tree) else ""
        if "\\\n" in source and "\\\n" not in ast.get_docstring(tree, clean=False):
            joined.append(str(path.relative_to(REPO)))
    assert joined == []


DOCS = ("README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")))


def doc_examples(program: str) -> list[tuple[str, list[str]]]:
    """(page, argument list) of every command that runs `program` in the README's and docs/' code: fenced blocks and
    blocks indented by four spaces after a blank line."""
    found = []
    for page in DOCS:
        text = (REPO / page).read_text()
        blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
        blocks += re.findall(r"(?:^|\n)\n((?: {4}.*\n)+)", re.sub(r"```.*?```", "", text, flags=re.S))
        for block in blocks:
            # A block's shell variables (R7="..."), joined over continuations, stand in where they are used.
            block = block.replace("\\\n", " ")
            for name, value in re.findall(r'^\s*(\w+)="([^"]*)"', block, flags=re.M):
                block = block.replace(f"${name}", value)
            indented = "".join(f"    {line}\n" for line in block.splitlines())
            found += [(page, argv) for argv in examples(program, indented)]
    return found


@pytest.mark.parametrize("program", programs())
def test_the_examples_in_the_docs_parse_as_written(program, monkeypatch):
    """What a reader copies from the README and docs/ parses with the program's own parser, and the checkout files
    it names exist in a clone."""
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    folders = tracked_folders()
    for page, argv in doc_examples(program):
        check_paths(argv, folders)
        try:
            main_of(program)(argv)
        except Parsed:
            continue
        except SystemExit:
            pass
        pytest.fail(f"{page}: python -m {program} {shlex.join(argv)}: does not parse")
