"""Running commands for tools: own process group, timeout, capped output, scrubbed environment.

Commands get stdin from /dev/null, stdout and stderr merged, and are killed with their whole process
group when they time out or when the main process exits (no background processes survive a call).
"""
from __future__ import annotations

import codecs
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_MAX_OUTPUT = 16_000

Status = Literal["ok", "error", "timeout", "invalid", "denied", "declined", "approval-needed", "chain-limit"]


@dataclass
class ToolResult:
    """The outcome of one tool call; `content` is what the model is sent back.

    `status` says why a call did not run ("invalid", "denied", "declined", "approval-needed",
    "chain-limit") or how it ended ("ok", "error", "timeout"); `stop` tells the agent loop to stop
    calling tools this turn (repair or chain limit reached).
    """

    ok: bool
    content: str
    exit_code: int | None = None
    truncated: bool = False
    duration_s: float = 0.0
    error: str | None = None
    status: Status = "ok"
    stop: bool = False
    name: str | None = None


# Variables whose names end like this are dropped from a command's environment.
SECRET_SUFFIXES: tuple[str, ...] = ("_TOKEN", "_KEY", "_SECRET", "_PASSWORD", "_PASSWD", "_CREDENTIALS",
                                    "_ACCESS_KEY_ID")
SECRET_NAMES: frozenset[str] = frozenset({
    "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN", "GITHUB_TOKEN", "GH_TOKEN",
    "GITLAB_TOKEN", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "OPENAI_API_KEY", "ANTHROPIC_API_KEY",
    "PGPASSWORD", "MYSQL_PWD", "SSH_AUTH_SOCK", "GOOGLE_APPLICATION_CREDENTIALS", "DOCKER_AUTH_CONFIG",
    "NPM_TOKEN", "VAULT_TOKEN",
})


def is_secret_name(name: str) -> bool:
    upper = name.upper()
    return upper in SECRET_NAMES or upper.endswith(SECRET_SUFFIXES)


def scrub_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of `env` (default os.environ) without variables that look like secrets."""
    source = os.environ if env is None else env
    return {k: v for k, v in source.items() if not is_secret_name(k)}


def clip_note(omitted: int) -> str:
    return (f"\n<response clipped: {omitted} characters omitted from the middle; "
            "narrow the command (grep, head, tail) to see the part you need>\n")


def cap_text(text: str, limit: int = DEFAULT_MAX_OUTPUT) -> tuple[str, bool]:
    """Keep the first and last halves of `limit` characters, with a note in between."""
    if limit <= 0 or len(text) <= limit:
        return text, False
    head = limit // 2
    tail = limit - head
    return text[:head] + clip_note(len(text) - limit) + text[-tail:], True


class _Collector:
    """Reads a pipe to EOF keeping only the first and last `limit // 2` characters."""

    def __init__(self, stream: Any, limit: int) -> None:
        self.limit = limit
        self.head: list[str] = []
        self.head_len = 0
        self.tail = ""
        self.total = 0
        self._stream = stream
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _take(self, s: str) -> None:
        if not s:
            return
        self.total += len(s)
        half = self.limit // 2
        if self.head_len < half:
            room = half - self.head_len
            self.head.append(s[:room])
            self.head_len += min(room, len(s))
            s = s[room:]
        if s:
            self.tail = (self.tail + s)[-(self.limit - half):]

    def _run(self) -> None:
        fd = self._stream.fileno()
        try:
            while True:
                data = os.read(fd, 65536)
                if not data:
                    break
                self._take(self._decoder.decode(data))
            self._take(self._decoder.decode(b"", final=True))
        except OSError:
            pass

    def text(self) -> tuple[str, bool]:
        head = "".join(self.head)
        if self.total <= self.limit or self.limit <= 0:
            return head + self.tail, False
        return head + clip_note(self.total - self.limit) + self.tail, True


def _kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_command(argv: Sequence[str], *, cwd: str | os.PathLike[str] | None = None,
                timeout: float | None = DEFAULT_TIMEOUT_S, max_output: int = DEFAULT_MAX_OUTPUT,
                env: Mapping[str, str] | None = None, scrub: bool = True) -> ToolResult:
    """Run argv (no shell unless argv asks for one) and return its merged, capped output.

    On timeout the whole process group gets SIGTERM, then SIGKILL half a second later.
    """
    argv = [str(a) for a in argv]
    full_env = scrub_env(env) if scrub else dict(os.environ if env is None else env)
    start = time.monotonic()
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=full_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as e:
        msg = f"cannot run {argv[0]!r}: {e.strerror or e}"
        return ToolResult(False, msg, exit_code=None, duration_s=time.monotonic() - start, error=msg,
                          status="error")
    collector = _Collector(proc.stdout, max_output)
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
    except BaseException:  # KeyboardInterrupt: take the children down with us
        _kill_group(proc.pid)
        proc.wait()
        raise
    # Whatever is left in the group (background jobs, or stragglers after SIGTERM) goes now;
    # it would otherwise hold the pipe open and outlive the call.
    _kill_group(proc.pid)
    proc.wait()
    collector.thread.join(timeout=2.0)
    if proc.stdout is not None:
        proc.stdout.close()
    duration = time.monotonic() - start
    text, truncated = collector.text()
    code = proc.returncode
    if timed_out:
        note = f"[timed out after {timeout:g} s; the command and its child processes were killed]"
        content = (text.rstrip("\n") + "\n" + note) if text else note
        return ToolResult(False, content, exit_code=code, truncated=truncated, duration_s=duration,
                          error=f"timed out after {timeout:g} s", status="timeout")
    if code != 0:
        note = f"[exit code {code}]" if code >= 0 else f"[killed by signal {-code}]"
        content = (text.rstrip("\n") + "\n" + note) if text else note
        return ToolResult(False, content, exit_code=code, truncated=truncated, duration_s=duration,
                          error=note.strip("[]"), status="error")
    return ToolResult(True, text if text else "(no output)", exit_code=0, truncated=truncated,
                      duration_s=duration)


@dataclass
class CommandRunner:
    """run_command with the workspace as working directory and fixed limits."""

    cwd: str | os.PathLike[str] = "."
    timeout: float | None = DEFAULT_TIMEOUT_S
    max_output: int = DEFAULT_MAX_OUTPUT
    env: Mapping[str, str] | None = None

    def run(self, argv: Sequence[str], *, timeout: float | None = None) -> ToolResult:
        return run_command(argv, cwd=Path(self.cwd), timeout=self.timeout if timeout is None else timeout,
                           max_output=self.max_output, env=self.env)

    def shell(self, command: str, *, timeout: float | None = None) -> ToolResult:
        return self.run(["/bin/sh", "-c", command], timeout=timeout)

