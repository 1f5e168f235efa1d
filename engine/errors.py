"""Errors the engine raises for problems a user can fix (bad paths, bad files).

Front ends turn these into one line on stderr and an exit code; anything else is a bug.
"""

from __future__ import annotations


class FlashMoEError(Exception):
    """Base class: a problem with input the user gave us."""

    exit_code = 1  # what a front end exits with (docs/usage.md: exit codes)


class ModelLoadError(FlashMoEError):
    """A model folder or file is missing, unreadable or inconsistent (exit code 3)."""

    exit_code = 3

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class ConvertError(ModelLoadError):
    """A conversion source cannot be converted."""


class OptionError(FlashMoEError, ValueError):
    """An option the model cannot take (--experts-per-token past its experts): a usage error."""

    exit_code = 2


class ContextLengthError(FlashMoEError, ValueError):
    """The prompt does not fit in the model's context and truncation was not asked for (exit code 2:
    the user's input is what has to change)."""

    exit_code = 2
