"""Progress of long steps (building the demo, converting, verifying, a long prompt's prefill) on stderr."""

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


class PrefillMeter:
    """A long prompt's prefill on a terminal: one line, redrawn per chunk, "prefill 1024/3636 tokens
    | 210 tok/s | 12 s left", erased when the reply starts. Nothing when the stream is not a
    terminal (a pipe or a log gets the summary line only) or the prompt takes one chunk."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.shown = False

    def __call__(self, ev) -> None:
        """A PrefillProgress event."""
        if not self.tty:
            return
        if ev.done >= ev.total or ev.done == 0:
            self.clear()
            return
        rate = ev.done / ev.elapsed_s if ev.elapsed_s > 0 else 0.0
        left = f" | {(ev.total - ev.done) / rate:.0f} s left" if rate else ""
        self.stream.write(f"\r\033[Kprefill {ev.done}/{ev.total} tokens | {rate:.0f} tok/s{left}")
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False
