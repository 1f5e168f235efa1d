"""SIGTERM and SIGHUP (the terminal closed) stop a reply the way Ctrl-C does: the reply so far is
saved, marked interrupted, and flashmoe exits with 128 + the signal's number (143, 129).

The handler raises Terminated, a KeyboardInterrupt, so every place that already stops cleanly on
Ctrl-C stops cleanly on these too. A second signal of the same kind kills at once (the default).
SIGKILL cannot be caught: the reply's throttled saves (chat.py) are what keep it.

Inside `deferred()` (the AgentLoop hands each piece of a reply to the face and to the session
there) these signals and Ctrl-C wait for the end of the block: a piece is shown and saved whole,
or neither, so what was shown is what is saved.
"""

from __future__ import annotations

import os
import signal
import stat
import threading

CAUGHT = (signal.SIGTERM, signal.SIGHUP)
received: int | None = None  # the signal that is stopping flashmoe
_held: list[int] = []  # signals that came inside deferred(), raised at its end
_depth = 0  # deferred() blocks open on the main thread


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
    if signum != signal.SIGINT:
        note(signum)
    if _depth:
        _held.append(signum)
        return
    _stop(signum)


def _stop(signum: int):
    raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)


def install() -> None:
    """SIGTERM and SIGHUP as above; SIGINT raises KeyboardInterrupt as Python's own handler does,
    but waits for the end of a deferred() block too."""
    for sig in CAUGHT + (signal.SIGINT,):
        signal.signal(sig, _raise)


class deferred:
    """`with deferred():` the signals install() catches wait for the end of the block, then
    raise. Only the main thread receives signals; elsewhere the block defers nothing."""

    __slots__ = ("main",)

    def __enter__(self):
        global _depth
        self.main = threading.current_thread() is threading.main_thread()
        if self.main:
            _depth += 1
        return self

    def __exit__(self, *exc):
        global _depth
        if self.main:
            _depth -= 1
            if not _depth and _held:
                signum = _held[0]
                _held.clear()
                _stop(signum)
        return False


def exit_code(code: int) -> int:
    """The exit code to return: 128 + the signal when one stopped flashmoe."""
    return 128 + received if received is not None else code
