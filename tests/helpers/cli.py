"""Running the `flashmoe` command from a test: in this process (the default) or in a process of
its own (`process=True`, for exit codes that signals give, a terminal, or a hang to time out).

A new Python process that imports mlx-lm costs 1.5-3 s of CPU before the command does anything;
most tests only want its one-line error and exit code. In this process, `cli.main(argv)` runs
with file descriptors 0, 1 and 2 pointed at files (so C code's writes are captured as a
subprocess's would be), the environment, working folder and signal handlers it changes put
back afterwards, and an uncaught exception turned into exit code 1 with its traceback on stderr.
pytest's log capture is set aside during the call, so a warning logged with no handler of its own
reaches stderr through logging's last resort, as it does in a process of its own; the log
databases the call opened are closed after it, as a process's exit closes them (one left open
held the session's logs.db for a later call: "database is locked").
"""

from __future__ import annotations

import io
import logging
import os
import signal
import subprocess
import sys
import tempfile
import traceback

from tests.helpers.paths import ROOT

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE)


def run_cli(
    *args, input: str | None = None, timeout: float = 120, env: dict | None = None, process: bool = False
) -> subprocess.CompletedProcess:
    """`flashmoe ARGS` the way a user's shell would run it; (returncode, stdout, stderr) as text."""
    if process:
        e = dict(os.environ, **(env or {}))
        e.pop("FORCE_COLOR", None)
        return subprocess.run(
            [sys.executable, "-m", "flashmoe.cli", *map(str, args)],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=e,
            cwd=ROOT,
        )
    return _in_process([str(a) for a in args], input or "", env or {})


def _in_process(argv: list[str], input: str, env: dict) -> subprocess.CompletedProcess:
    from flashmoe.cli import cli, signals
    from flashmoe.cli.store import Store

    opened, store_init = [], Store.__init__

    def recording_init(self, *args, **kwargs):
        store_init(self, *args, **kwargs)
        opened.append(self)

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    saved_streams = sys.stdin, sys.stdout, sys.stderr
    saved_handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    root = logging.getLogger()
    saved_log = root.handlers[:]
    for f in (sys.stdout, sys.stderr):
        f.flush()
    saved_fds = [os.dup(fd) for fd in (0, 1, 2)]
    files = [tempfile.TemporaryFile() for _ in range(3)]
    files[0].write(input.encode())
    files[0].seek(0)
    code = 1
    try:
        os.environ.update({k: str(v) for k, v in env.items()})
        os.environ.pop("FORCE_COLOR", None)
        os.chdir(ROOT)
        root.handlers.clear()
        Store.__init__ = recording_init
        for fd, f in enumerate(files):
            os.dup2(f.fileno(), fd)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8")
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True
        )
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse's usage errors, and the commands that exit
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else _say(e.code))
        except KeyboardInterrupt:
            code = 130
        except BaseException:  # noqa: BLE001 - what a process would print before dying
            traceback.print_exc()
            code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        sys.stdin, sys.stdout, sys.stderr = saved_streams
        for fd, old in enumerate(saved_fds):
            os.dup2(old, fd)
            os.close(old)
        for s, h in saved_handlers.items():
            signal.signal(s, h)
        signals.received = None
        root.handlers[:] = saved_log
        Store.__init__ = store_init
        for store in opened:
            store.close()
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    out, err = (_read(f) for f in files[1:])
    for f in files:
        f.close()
    return subprocess.CompletedProcess(["flashmoe", *argv], code, out, err)


def _say(message) -> int:
    print(message, file=sys.stderr)
    return 1


def _read(f) -> str:
    f.seek(0)
    return f.read().decode("utf-8", errors="replace")
