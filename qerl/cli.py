"""The convention of the command-line tools (`python -m qerl.quantize`, `python -m qerl.train`, `python -m eval.gsm8k`
/ `eval.competition_math`, `python -m qerl.models`, llm-compressor/quantize_nvfp4.py): a user's mistake (a UsageError,
qerl/errors.py) is one line on stderr and exit code 2, found before anything heavy loads; an error of the program
itself keeps its traceback. `--debug` (or QERL_DEBUG=1) shows the traceback of user errors too. SIGINT and SIGTERM
end a run in one line too, after the `finally` blocks on the way out.

Also here: the argparse helpers those tools share (one-line parser errors, misspelt flags named, numeric ranges).
The checks of input files are in qerl/input_checks.py. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from qerl.errors import UsageError, nearest, one_line

DEBUG_ENV = "QERL_DEBUG"


def run_cli(main: Callable[[list[str]], object], prog: str, argv: list[str] | None = None) -> int:
    """Run `main(argv)` under the convention above; returns the exit code (sys.exit it): main's own when it returns
    an int, else 0 (a main may return what it made, to callers in Python). SIGINT and SIGTERM unwind the run
    (half-written outputs are removed on the way out) and end it in one line, exit code 128 + the signal's number."""
    if argv is None:  # the process's own command line: the process is this program's
        hide_unused_deepspeed()
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    argv = [arg for arg in argv if arg != "--debug"]
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {signum: signal.signal(signum, _interrupt) for signum in INTERRUPTS}
    try:
        code = main(argv)
        return code if isinstance(code, int) else 0
    except UsageError as err:
        if debug:
            raise
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        if debug:
            raise
        signum = getattr(err, "signum", signal.SIGINT)
        print(f"{prog}: interrupted by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


INTERRUPTS = (signal.SIGINT, signal.SIGTERM)

# deepspeed, where installed (the dev extra), is imported by accelerate and transformers whether a run uses it or not
# (accelerate's unwrap_model, in every save_pretrained and training step): seconds, and on a machine without a GPU a
# "[WARNING] [real_accelerator.py:...] Setting accelerator to CPU" line in every tool. A program's own process not
# launched for DeepSpeed marks it absent: None in sys.modules is Python's "not installed". Never done in a process
# that calls run_cli with its own argv (the tests): transformers decides at import time what it does with deepspeed.
DEEPSPEED_LAUNCH_ENV = "ACCELERATE_USE_DEEPSPEED"  # set by `accelerate launch` with a DeepSpeed config


def hide_unused_deepspeed() -> None:
    if os.environ.get(DEEPSPEED_LAUNCH_ENV, "false").lower() not in ("1", "true"):
        sys.modules.setdefault("deepspeed", None)


def allow_deepspeed() -> None:
    """Undo hide_unused_deepspeed, for a run that asks for DeepSpeed some other way (TrainingArguments' --deepspeed),
    before transformers is imported."""
    if "deepspeed" in sys.modules and sys.modules["deepspeed"] is None:
        del sys.modules["deepspeed"]


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised like Ctrl-C so that every `finally` on the way out runs."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def signals_deferred():
    """SIGINT and SIGTERM wait until the block ends and then take effect: what the block writes (a checkpoint) is
    written whole. Python runs signal handlers in the main thread only, so elsewhere this defers nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {signum: signal.signal(signum, lambda got, frame: caught.append(got)) for signum in INTERRUPTS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)  # now to the handler in force again


# ----------------------------------------------------------------------------------------------------------
# Flags


def reject_unknown_flags(argv: list[str], known: Iterable[str]) -> None:
    known = set(known)
    for arg in argv:
        if arg == "--":
            return
        flag = arg.split("=", 1)[0]
        if flag.startswith("--") and flag not in known:
            raise UsageError(f"unknown flag {flag}{nearest(flag, sorted(k for k in known if k.startswith('--')))}")


def attach_negative_numbers(argv: list[str]) -> list[str]:
    """`--flag -1e-5` -> `--flag=-1e-5`: argparse takes a negative number in scientific notation for a flag."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and arg.startswith("-") and _is_number(arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class ParserErrors:
    """Mixin for argparse parsers: errors become UsageErrors (one line, no usage dump), and a misspelt flag is
    named with the nearest valid one before any other complaint (such as a missing required flag)."""

    def known_flags(self) -> list[str]:
        return list(self._option_string_actions)

    def parse_args(self, args=None, namespace=None):
        args = attach_negative_numbers(list(sys.argv[1:] if args is None else args))
        reject_unknown_flags(args, self.known_flags())
        return super().parse_args(args, namespace)

    def error(self, message):
        raise UsageError(message)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each flag's default after its help, unless the help says it ("(default: ...)" in words, where the value is
    None; "(required)") or the flag has none (required flags, switches); the description keeps its line breaks."""

    def _get_help_string(self, action):
        text = action.help or ""
        said = "(default" in text or "(required)" in text
        if action.option_strings and action.nargs != 0 and not action.required and not said:
            text += " (default: %(default)s)"
        return text


class ArgumentParser(ParserErrors, argparse.ArgumentParser):
    def __init__(self, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(allow_abbrev=False, **kwargs)
        self.add_argument("--debug", action="store_true", help="show the traceback of user errors too")


def comma_list(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of names, each one of `choices`."""
    choices = tuple(choices)

    def parse(text: str) -> list[str]:
        names = [name for name in text.split(",") if name]
        unknown = [name for name in names if name not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown[0]!r}; choose from {', '.join(choices)}")
        return names

    return parse


@dataclass(frozen=True)
class Range:
    """The values a numeric setting accepts, and why where it is not obvious. Also an argparse `type`."""

    kind: type  # int or float
    low: float
    high: float | None = None
    low_open: bool = False  # low itself is refused
    high_open: bool = False
    special: tuple = ()  # values accepted outside [low, high], such as max_steps' -1
    why: str = ""

    def describe(self) -> str:
        what = "an integer" if self.kind is int else "a number"
        low, high = (b if b is None else str(int(b)) if self.kind is int else f"{b:g}" for b in (self.low, self.high))
        if high is None:
            text = f"{what} {'>' if self.low_open else '>='} {low}"
        else:
            text = f"{what} in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        text += "".join(f", or {value}" for value in self.special)
        return f"{text} ({self.why})" if self.why else text

    def problem(self, value) -> str | None:
        """Why `value` is refused ('must be ..., got ...'), or None."""
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if is_number and value in self.special:
            return None
        fits = (
            is_number
            and (self.kind is float or float(value).is_integer())
            and math.isfinite(value)
            and (value > self.low if self.low_open else value >= self.low)
            and (self.high is None or (value < self.high if self.high_open else value <= self.high))
        )
        if fits:
            return None
        return f"must be {self.describe()}, got {f'{value:g}' if isinstance(value, float) else repr(value)}"

    def __call__(self, text: str):
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text!r}") from None
        problem = self.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value


COUNT = Range(int, 1)
COUNT_OR_ZERO = Range(int, 0)
POSITIVE = Range(float, 0, low_open=True)
NON_NEGATIVE = Range(float, 0)
FRACTION = Range(float, 0, 1)
SEED = Range(int, 0, 2**32 - 1)  # numpy's seed range (transformers seeds numpy too)
