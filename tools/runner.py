"""Running commands for tools: own session, timeout, capped output, scrubbed environment.

Commands get stdin from /dev/null, stdout and stderr merged. On Linux each runs under a small
reaper process (tools/reaper.py) that kills every process the command started when it ends, times
out, or when flashmoe dies, including children that left the process group with setsid(): where
the kernel allows, in PID and user namespaces of their own, whose init the command can neither
kill, stop nor see past; elsewhere under a child subreaper, with flashmoe adopting and killing
what is left if the command kills the reaper. Elsewhere than Linux the process group is killed.

The environment is the user's without secrets (see scrub_env), with PATH limited to absolute
directories outside the workspace (a program the model wrote is never found by name), and with
git's configuration from the workspace neutralised (see GIT_GUARD).
"""

from __future__ import annotations

import codecs
import contextvars
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
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


# Variables dropped from a command's environment (is_secret): by the shape of the value (below), or
# by the upper-cased name: any that contains one of
# SECRET_PARTS (`*TOKEN*`, ...), has one of SECRET_WORDS as a `_`-separated word (`*_KEY`, `KEY_*`,
# `*_PAT`; a word, so KEYBOARD stays), starts with a cloud's prefix, or is a known credential.
SECRET_PARTS: tuple[str, ...] = (
    "TOKEN",
    "SECRET",
    "PASSWORD",
    "PASSWD",
    "PASSPHRASE",
    "CREDENTIAL",
    "APIKEY",
    "PRIVATEKEY",
    "WEBHOOK",
)
SECRET_WORDS: frozenset[str] = frozenset(
    {"KEY", "KEYS", "PAT", "PWD", "PASS", "AUTH", "COOKIE", "COOKIES", "SESSION", "DSN", "OTP", "SALT"}
)
SECRET_PREFIXES: tuple[str, ...] = (
    "AWS_",
    "AZURE_",
    "ARM_CLIENT_",
    "GOOGLE_",
    "GCLOUD_",
    "CLOUDSDK_",
    "GCP_",
    "DIGITALOCEAN_",
    "HCLOUD_",
    "OS_PASSWORD",
    "VAULT_",
)
SECRET_NAMES: frozenset[str] = frozenset(
    {
        "DATABASE_URL",
        "REDIS_URL",
        "MONGODB_URI",
        "MONGO_URL",
        "AMQP_URL",
        "SENTRY_DSN",
        "KUBECONFIG",
        "DOCKER_CONFIG",
        "DOCKER_AUTH_CONFIG",
        "NETRC",
        "PGPASSFILE",
        "SSH_AUTH_SOCK",
        "GPG_AGENT_INFO",
        "MYSQL_PWD",
        "TWINE_USERNAME",
        "XAUTHORITY",
        "DBUS_SESSION_BUS_ADDRESS",
    }
)
# Needed by ordinary commands and never secret, whatever the patterns say.
ENV_ALLOW: frozenset[str] = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "LANG",
        "LANGUAGE",
        "TERM",
        "TZ",
        "TMPDIR",
        "PWD",
        "COLUMNS",
        "LINES",
        "TOKENIZERS_PARALLELISM",
        "XDG_SESSION_TYPE",
        "PYTHONHASHSEED",
    }
)


def is_secret_name(name: str) -> bool:
    upper = name.upper()
    if upper in ENV_ALLOW or upper.startswith("LC_"):
        return False
    words = set(re.split(r"[_\d]+", upper))
    return (
        upper in SECRET_NAMES
        or upper.startswith(SECRET_PREFIXES)
        or bool(words & SECRET_WORDS)
        or any(part in upper for part in SECRET_PARTS)
    )


# Values that are secrets whatever the variable is called (CI systems and wrappers pass tokens
# under names of their own): credentials in a URL, webhook URLs (the URL is the secret), JWTs,
# private keys, the fixed prefixes of common providers' tokens, and query parameters that carry a
# key or signature. From the providers' documented token formats.
SECRET_VALUE = re.compile(
    "|".join(
        (
            r"\b[a-z][a-z0-9+.-]*://[^/\s:@]*:[^/\s@]+@",  # scheme://user:password@host
            r"hooks\.slack\.com/|discord(?:app)?\.com/api/webhooks/|webhook\.office\.com/|outlook\.office\.com/webhook|"
            r"hooks\.zapier\.com/|api\.telegram\.org/bot|maker\.ifttt\.com/trigger/|chat\.googleapis\.com/v1/spaces/",
            r"[?&](?:[a-z_]*key|[a-z_]*token|secret|sig|signature|password|x-amz-signature|x-goog-signature)=[^&\s]{8,}",
            r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.",  # a JWT: two base64url JSON objects
            r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----|AGE-SECRET-KEY-1",
            r"\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_\w{20,}|glpat-[\w-]{20,}|glptt-\w{20,}|xox[abposre]-[\w-]{10,}"
            r"|xapp-[\w-]{10,}|sk-[\w-]{20,}|[sr]k_(?:live|test)_\w{16,}|A[KS]IA[0-9A-Z]{16}|AIza[\w-]{35}|hf_[A-Za-z0-9]{30,}"
            r"|npm_[A-Za-z0-9]{36}|pypi-AgE[\w-]{20,}|SG\.[\w-]{16,}\.[\w-]{16,}|dop_v1_[0-9a-f]{40,}|shp(?:at|ss|ca)_\w{20,}"
            r"|ya29\.[\w-]{20,}|dapi[0-9a-f]{32}|glc_[A-Za-z0-9+/=_-]{20,}|sq0(?:atp|csp)-[\w-]{20,})",
        )
    ),
    re.IGNORECASE,
)
_OPAQUE = re.compile(r"[A-Za-z0-9+/=_.-]{32,}")


def _looks_random(value: str) -> bool:
    """A long opaque word with upper and lower case letters and digits, whose characters vary as a
    generated key's do (a hex digest, a UUID or a path has no upper case or has other characters)."""
    import math
    from collections import Counter

    if not _OPAQUE.fullmatch(value) or value.startswith("/"):
        return False
    if not (re.search(r"[A-Z]", value) and re.search(r"[a-z]", value) and re.search(r"\d", value)):
        return False
    counts = Counter(value)
    entropy = -sum(n / len(value) * math.log2(n / len(value)) for n in counts.values())
    return entropy >= 4.0


def is_secret(name: str, value: str) -> bool:
    """Whether a variable is dropped from commands' environments: by its name (is_secret_name) or
    by the shape of its value, unless its name is on ENV_ALLOW (PATH, HOME, ...)."""
    if name.upper() in ENV_ALLOW:
        return False
    return is_secret_name(name) or bool(SECRET_VALUE.search(value)) or _looks_random(value)


def _safe_path(value: str, workspace: str | os.PathLike[str] | None) -> str:
    """PATH without relative or empty entries and without directories inside the workspace."""
    ws = os.path.realpath(workspace) if workspace is not None else None
    keep = []
    for d in value.split(os.pathsep):
        if not os.path.isabs(d):
            continue
        real = os.path.realpath(d)
        if ws is not None and (real == ws or real.startswith(ws + os.sep)):
            continue
        if d not in keep:
            keep.append(d)
    return os.pathsep.join(keep)


def scrub_env(
    env: Mapping[str, str] | None = None, *, allow: Iterable[str] = (), workspace: str | os.PathLike[str] | None = None
) -> dict[str, str]:
    """A copy of `env` (default os.environ) without variables that look like secrets, except the
    names in `allow` (the user's `pass_env`), and with PATH made safe (see _safe_path)."""
    source = os.environ if env is None else env
    passed = {a.upper() for a in allow}
    out = {k: v for k, v in source.items() if k.upper() in passed or not is_secret(k, v)}
    if "PATH" in out:
        out["PATH"] = _safe_path(out["PATH"], workspace)
    return out


# Configuration git takes from the command line (GIT_CONFIG_COUNT) outranks every config file, so a
# repository config that names a program (fsmonitor, hooks, pager, editor) cannot make an allowed
# `git status` run it, and a planted bare repository (HEAD, config, objects/, refs/ written into the
# workspace) is refused outright: git runs only a repository it was pointed at or a real `.git`.
GIT_GUARD: tuple[tuple[str, str], ...] = (
    ("safe.bareRepository", "explicit"),
    ("core.fsmonitor", "false"),
    ("core.hooksPath", "/dev/null"),
    ("core.pager", "cat"),
    ("core.editor", "false"),
    ("sequence.editor", "false"),
)
# Inherited variables that would point git at another repository, config or program.
_GIT_VARIABLES = (
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_COMMON_DIR",
    "GIT_INDEX_FILE",
    "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_NAMESPACE",
    "GIT_EXEC_PATH",
    "GIT_PAGER",
    "GIT_EDITOR",
    "GIT_SEQUENCE_EDITOR",
    "GIT_EXTERNAL_DIFF",
    "GIT_CEILING_DIRECTORIES",
    "GIT_DISCOVERY_ACROSS_FILESYSTEM",
)


def guarded_env(env: dict[str, str]) -> dict[str, str]:
    """env plus the git guard."""
    out = {k: v for k, v in env.items() if k not in _GIT_VARIABLES and not k.startswith("GIT_CONFIG")}
    out.update({"GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0", "GIT_CONFIG_COUNT": str(len(GIT_GUARD))})
    for i, (key, value) in enumerate(GIT_GUARD):
        out[f"GIT_CONFIG_KEY_{i}"] = key
        out[f"GIT_CONFIG_VALUE_{i}"] = value
    return out


_SEALED = False


def seal_environment() -> list[str]:
    """Drop secrets from this process's own environment, where a tool command could read them
    through /proc/<flashmoe's pid>/environ. That file shows the environment block the process was
    started with, which unsetenv() does not change, so the secret entries are also overwritten
    there with NUL bytes. Returns the names removed. flashmoe itself needs none of them."""
    global _SEALED
    names = [k for k, v in os.environ.items() if is_secret(k, v)]
    for k in names:
        del os.environ[k]
    if sys.platform.startswith("linux") and not _SEALED:
        _wipe_initial_environ()
    _SEALED = True
    return names


def _wipe_initial_environ() -> None:
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end (proc(5) fields 50, 51)
        if not 0 < start < end or end - start > 1 << 24:
            return
        block = ctypes.string_at(start, end - start)
    except (OSError, ValueError, IndexError):
        return
    pos = 0
    for entry in block.split(b"\0"):
        name, eq, value = entry.decode("utf-8", "replace").partition("=")
        if eq and is_secret(name, value):
            ctypes.memset(start + pos, 0, len(entry))
        pos += len(entry) + 1


def clip_note(omitted: int) -> str:
    return (
        f"\n<response clipped: {omitted} characters omitted from the middle; "
        "narrow the command (grep, head, tail) to see the part you need>\n"
    )


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
            self.tail = (self.tail + s)[-(self.limit - half) :]

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


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the command (the reaper passes it on, then kills what is left; SIGCONT wakes a
    reaper the command stopped); SIGKILL to the group if it does not end in time."""
    target = proc.pid if _USE_REAPER else -proc.pid
    for sig in (signal.SIGTERM, signal.SIGCONT):
        try:
            os.kill(target, sig)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=3.0 if _USE_REAPER else 0.5)
    except subprocess.TimeoutExpired:
        pass


def _kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


REAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reaper.py")
_USE_REAPER = sys.platform.startswith("linux")
ISOLATE = True  # commands in namespaces of their own where the kernel allows it (tools/reaper.py)
_namespaces: bool | None = None  # whether it does, tried once
_adopting = False  # this process is a child subreaper (the fallback's orphans come to it)


def isolated() -> bool:
    """Whether commands run in namespaces of their own: ISOLATE, on a kernel that lets this user
    make them (unprivileged user namespaces may be off, or refused by seccomp in a container)."""
    global _namespaces
    if not (_USE_REAPER and ISOLATE):
        return False
    if _namespaces is None:
        from flashmoe.tools.reaper import namespaces_work

        _namespaces = namespaces_work()
    return _namespaces


def _adopt_orphans() -> None:
    """Without namespaces a command may kill its reaper; its orphans then come to this process
    (a child subreaper) instead of init, and _sweep finds them."""
    global _adopting
    if not _adopting:
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
        _adopting = True


def _start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])  # proc(5) field 22, starttime
    except (OSError, ValueError, IndexError):
        return None


def _sweep(reaper: int, since: int | None) -> None:
    """Kill (and reap) what a command left when it killed its reaper: children of this process
    started after the reaper, which only orphans re-parented here can be, and their trees."""
    from flashmoe.tools.reaper import descendants

    me = os.getpid()
    for _ in range(20):
        orphans = []
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) not in (me, reaper):
                try:
                    with open(f"/proc/{name}/stat", "rb") as f:
                        fields = f.read().rsplit(b")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[1]) == me and since is not None and int(fields[19]) >= since:
                    orphans.append(int(name))
        if not orphans:
            return
        for pid in orphans:
            for victim in (*descendants(pid), pid):
                try:
                    os.kill(victim, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for pid in orphans:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


# The monotonic time by which the whole run must end (`run --timeout`), set by the executor around
# a tool call: a command's own timeout is cut to what is left.
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("flashmoe_run_deadline", default=None)


@contextmanager
def run_deadline(when: float | None) -> Iterator[None]:
    """Commands started inside end by `when` (time.monotonic()), whatever their own timeout."""
    token = _DEADLINE.set(when)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def _cut(timeout: float | None) -> tuple[float | None, bool]:
    """The timeout, cut to the run's deadline; and whether the deadline is what limits it."""
    end = _DEADLINE.get()
    if end is None:
        return timeout, False
    left = max(0.0, end - time.monotonic())
    return (left, True) if timeout is None or left < timeout else (timeout, False)


def run_command(
    argv: Sequence[str],
    *,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    max_output: int = DEFAULT_MAX_OUTPUT,
    env: Mapping[str, str] | None = None,
    scrub: bool = True,
    pass_env: Iterable[str] = (),
) -> ToolResult:
    """Run argv (no shell unless argv asks for one) and return its merged, capped output.

    On timeout the command gets SIGTERM, and everything it started SIGKILL half a second later.
    Inside run_deadline() the timeout is cut to what is left of the run.
    """
    argv = [str(a) for a in argv]
    timeout, by_deadline = _cut(timeout)
    if by_deadline and timeout <= 0:
        msg = "[not run: the run's time limit (--timeout) is reached]"
        return ToolResult(False, msg, error="the run's time limit is reached", status="timeout")
    base = scrub_env(env, allow=pass_env, workspace=cwd) if scrub else dict(os.environ if env is None else env)
    full_env = guarded_env(base)
    start = time.monotonic()
    isolate = isolated()
    if _USE_REAPER and not isolate:
        _adopt_orphans()
    launch = (
        [sys.executable, "-I", "-S", REAPER, str(os.getpid()), "1" if isolate else "0", *argv] if _USE_REAPER else argv
    )
    try:
        proc = subprocess.Popen(
            launch,
            cwd=cwd,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as e:
        msg = f"cannot run {argv[0]!r}: {e.strerror or e}"
        return ToolResult(False, msg, exit_code=None, duration_s=time.monotonic() - start, error=msg, status="error")
    since = _start_ticks(proc.pid) if _USE_REAPER else None
    collector = _Collector(proc.stdout, max_output)
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _stop(proc)
    except BaseException:  # KeyboardInterrupt: take the children down with us
        _stop(proc)
        _kill_group(proc.pid)
        proc.wait()
        if _adopting:
            _sweep(proc.pid, since)
        raise
    # Whatever is left in the group (background jobs, or stragglers after SIGTERM) goes now;
    # it would otherwise hold the pipe open and outlive the call.
    _kill_group(proc.pid)
    proc.wait()
    if _adopting:
        _sweep(proc.pid, since)
    collector.thread.join(timeout=2.0)
    if proc.stdout is not None:
        proc.stdout.close()
    duration = time.monotonic() - start
    text, truncated = collector.text()
    code = proc.returncode
    if timed_out:
        note = (
            f"[timed out after {timeout:g} s; the command and its child processes were killed]"
            if not by_deadline
            else f"[stopped after {timeout:g} s at the run's time limit (--timeout); the command and its child "
            "processes were killed]"
        )
        content = (text.rstrip("\n") + "\n" + note) if text else note
        return ToolResult(
            False,
            content,
            exit_code=code,
            truncated=truncated,
            duration_s=duration,
            error=f"timed out after {timeout:g} s",
            status="timeout",
        )
    if code != 0:
        note = f"[exit code {code}]" if code >= 0 else f"[killed by signal {-code}]"
        content = (text.rstrip("\n") + "\n" + note) if text else note
        return ToolResult(
            False,
            content,
            exit_code=code,
            truncated=truncated,
            duration_s=duration,
            error=note.strip("[]"),
            status="error",
        )
    return ToolResult(True, text if text else "(no output)", exit_code=0, truncated=truncated, duration_s=duration)


@dataclass
class CommandRunner:
    """run_command with the workspace as working directory and fixed limits."""

    cwd: str | os.PathLike[str] = "."
    timeout: float | None = DEFAULT_TIMEOUT_S
    max_output: int = DEFAULT_MAX_OUTPUT
    env: Mapping[str, str] | None = None
    pass_env: tuple[str, ...] = ()  # secret-looking variables the user lets commands see

    def run(self, argv: Sequence[str], *, timeout: float | None = None) -> ToolResult:
        return run_command(
            argv,
            cwd=Path(self.cwd),
            timeout=self.timeout if timeout is None else timeout,
            max_output=self.max_output,
            env=self.env,
            pass_env=self.pass_env,
        )

    def shell(self, command: str, *, timeout: float | None = None) -> ToolResult:
        return self.run(["/bin/sh", "-c", command], timeout=timeout)
