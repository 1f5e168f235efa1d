"""User mistakes and how a failure is told: one line on stderr, never a traceback."""

from __future__ import annotations

import os
import sys


class UsageError(Exception):
    """Bad arguments: exit code 2."""


class ConfigError(Exception):
    """A bad config file or FLASHMOE_* variable (exit code 2)."""


def error(message: str) -> None:
    from .term_safe import safe

    print(f"flashmoe: error: {safe(message)}", file=sys.stderr)  # it may quote the model or a file name


def quiet_broken_pipe() -> None:
    # The reader went away (`| head`): point stdout at /dev/null so the final flush is silent.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
