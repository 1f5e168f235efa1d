"""Progress of long steps (building the demo, converting, verifying) on stderr."""
from __future__ import annotations

import sys


class Progress:
    """A one-line progress bar on a terminal; a line per update otherwise."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr  # looked up now, not at import (tests swap stderr)
        self.tty = self.stream.isatty()

    def __call__(self, what: str, done: int, total: int) -> None:
        width = 30
        fill = int(width * done / max(total, 1))
        line = f"[{'#' * fill}{'.' * (width - fill)}] {done}/{total} {what}"
        if self.tty:
            self.stream.write("\r\033[K" + line + ("\n" if done >= total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
