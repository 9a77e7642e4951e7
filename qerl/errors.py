"""A user's mistake, and how it is worded: one line that names the culprit, with the nearest valid name where
one was misspelt. Every layer that can refuse an input raises UsageError from here; qerl/cli.py turns it into
that line on stderr and exit code 2.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UsageError(ValueError):
    """A mistake in the flags or the input files. Its message names the culprit (and the fix, where known)."""


def one_line(message: object) -> str:
    return " ".join(str(message).split())


def nearest(word: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for the closest choice, or ''."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""
