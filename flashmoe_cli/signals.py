"""SIGTERM and SIGHUP (the terminal closed) stop a reply the way Ctrl-C does: the reply so far is
saved, marked interrupted, and flashmoe exits with 128 + the signal's number (143, 129).

The handler raises Terminated, a KeyboardInterrupt, so every place that already stops cleanly on
Ctrl-C stops cleanly on these too. A second signal of the same kind kills at once (the default).
SIGKILL cannot be caught: the reply's throttled saves (chat.py) are what keep it.
"""
from __future__ import annotations

import os
import signal
import stat

CAUGHT = (signal.SIGTERM, signal.SIGHUP)
received: int | None = None  # the signal that is stopping flashmoe


class Terminated(KeyboardInterrupt):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def note(signum: int) -> None:
    """Remember the signal, restore its default, and after a hangup stop writing to the terminal
    that is gone (a write would fail, and so would Python's last flush)."""
    global received
    received = signum
    signal.signal(signum, signal.SIG_DFL)
    if signum == signal.SIGHUP:
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            try:
                if stat.S_ISCHR(os.fstat(fd).st_mode):  # a terminal (pipes and files still work)
                    os.dup2(devnull, fd)
            except OSError:
                pass
        os.close(devnull)


def _raise(signum, frame):
    note(signum)
    raise Terminated(signum)


def install() -> None:
    for sig in CAUGHT:
        signal.signal(sig, _raise)


def exit_code(code: int) -> int:
    """The exit code to return: 128 + the signal when one stopped flashmoe."""
    return 128 + received if received is not None else code
