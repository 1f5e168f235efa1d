"""Finding the processes a tool command left behind: a marker no other process has, written into
the command line of what a test starts, and the live processes that carry it."""

from __future__ import annotations

import os
import subprocess
import time


def alive(pid: int) -> bool:
    """Running and not a zombie (a container's init may be slow to reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS)
        out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
        return bool(out) and not out.startswith("Z")


def marker() -> str:
    """A `sleep` duration (or an argument) no other process has: what survivors() looks for."""
    import random

    return f"{300 + random.randrange(600)}.{random.randrange(10**6):06d}"


def survivors(mark: str, limit: float = 3.0) -> list[int]:
    """Host PIDs of live processes with `mark` as a word of their command line. Tool commands may
    run in a PID namespace of their own, where the PIDs they print mean nothing out here."""

    def find():
        out = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/cmdline", "rb") as f:
                        if mark.encode() in f.read().split(b"\0") and alive(int(d)):
                            out.append(int(d))
                except OSError:
                    pass
        return out

    end = time.monotonic() + limit
    while (found := find()) and time.monotonic() < end:
        time.sleep(0.05)
    return found
