"""The built-in tools: read_file, list_dir, search_files, write_file, edit_file, run_shell.

They are bound to one workspace: every path argument is relative to its root and goes through the
sandbox (the policy also checks it before the call is approved; this is the second line).
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Any

# `regex` rather than `re`: its matching takes a timeout, so a catastrophic pattern such as
# (a+)+$ written by the model stops at the tool's time limit instead of hanging the agent.
import regex

from flashmoe.tools import safe_fs
from flashmoe.tools.errors import PathRefused, ToolRunError
from flashmoe.tools.globmatch import GlobError
from flashmoe.tools.policy import Policy, Sandbox, glob_regex
from flashmoe.tools.registry import Tool, ToolRegistry
from flashmoe.tools.runner import DEFAULT_MAX_OUTPUT, CommandRunner, ToolResult

MAX_SEARCH_FILE_BYTES = 4 * 1024 * 1024
MAX_READ_FILE_BYTES = 64 * 1024 * 1024
MAX_DIR_ENTRIES = 1000
DEFAULT_TIME_LIMIT_S = 60.0  # a built-in tool's wall-clock limit (search stops there)


def _is_binary(data: bytes) -> bool:
    return b"\x00" in data[:8192]


class Builtins:
    """Holds the workspace sandbox and runner the built-in tools use."""

    def __init__(
        self,
        sandbox: Sandbox,
        runner: CommandRunner | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
        time_limit: float = DEFAULT_TIME_LIMIT_S,
    ) -> None:
        self.sandbox = sandbox
        self.runner = runner or CommandRunner(cwd=sandbox.root)
        self.max_output = max_output
        self.time_limit = time_limit

    def _rel(self, p: Path) -> str:
        return self.sandbox.relative(p)

    def _existing_file(self, path: str) -> Path:
        p = self.sandbox.resolve(path)
        if not p.exists():
            raise ToolRunError(f"no such file: {path}")
        if p.is_dir():
            raise ToolRunError(f"{path} is a directory; use list_dir to see what it contains")
        if not p.is_file():  # a FIFO or device would block or never end
            raise ToolRunError(f"{path} is not a regular file")
        return p

    def _read(self, path: str, p: Path, limit: int | None = MAX_READ_FILE_BYTES) -> bytes:
        """The file's bytes, opened beneath its root without following a symlink (safe_fs)."""
        try:
            return safe_fs.read_bytes(self.sandbox.root_of(p), p, path, limit)
        except PathRefused as e:
            if "not a regular file" in str(e) or "bytes, more than" in str(e):
                raise ToolRunError(str(e)) from None
            raise
        except OSError as e:
            raise ToolRunError(f"cannot read {path}: {e.strerror or e}") from None

    def read_file(self, path: str, offset: int = 1, limit: int | None = None) -> str:
        p = self._existing_file(path)
        data = self._read(path, p)
        if _is_binary(data):
            raise ToolRunError(f"{path} is a binary file ({len(data)} bytes); not shown")
        if not data:
            return f"({path} is empty)"
        lines = data.decode("utf-8", errors="replace").splitlines(keepends=True)
        if offset > len(lines):
            raise ToolRunError(f"offset {offset} is past the end of {path} ({len(lines)} lines)")
        end = len(lines) if limit is None else min(len(lines), offset - 1 + limit)
        out: list[str] = []
        size = 0
        last = offset - 1
        for i in range(offset - 1, end):
            if size + len(lines[i]) > self.max_output and out:
                break
            out.append(lines[i])
            size += len(lines[i])
            last = i + 1
        text = "".join(out)
        if last < len(lines) and (limit is None or last < end):
            text += (
                f"\n[showing lines {offset}-{last} of {len(lines)}; call read_file with offset={last + 1} to read on]"
            )
        elif offset > 1 or last < len(lines):
            text += f"\n[lines {offset}-{last} of {len(lines)}]"
        return text

    def _open_dir(self, path: str, p: Path) -> int:
        try:
            return safe_fs.open_beneath(self.sandbox.root_of(p), p, os.O_RDONLY | os.O_DIRECTORY, shown=path)
        except OSError as e:
            raise ToolRunError(f"cannot open {path}: {e.strerror or e}") from None

    def list_dir(self, path: str = ".") -> str:
        p = self.sandbox.resolve(path)
        if not p.exists():
            raise ToolRunError(f"no such directory: {path}")
        if not p.is_dir():
            raise ToolRunError(f"{path} is a file, not a directory; use read_file")
        fd = self._open_dir(path, p)
        try:
            with os.scandir(fd) as it:
                entries = sorted(it, key=lambda e: e.name)
            names = [e.name + ("/" if e.is_dir() else "") for e in entries[:MAX_DIR_ENTRIES]]
        finally:
            os.close(fd)
        if not names:
            return f"({path} is empty)"
        text = "\n".join(names)
        if len(entries) > MAX_DIR_ENTRIES:
            text += f"\n[{len(entries) - MAX_DIR_ENTRIES} more entries not shown]"
        return text

    def search_files(self, pattern: str, path: str = ".", glob: str | None = None, max_results: int = 50) -> str:
        try:
            rx = regex.compile(pattern)
        except (regex.error, OverflowError, RecursionError) as e:
            raise ToolRunError(f"invalid regular expression {pattern!r}: {e}") from None
        base = self.sandbox.resolve(path)
        if not base.is_dir():
            raise ToolRunError(f"no such directory: {path}")
        try:
            name_rx = glob_regex(glob) if glob else None
        except GlobError as e:
            raise ToolRunError(f"invalid glob: {e}") from None
        deadline = time.monotonic() + self.time_limit
        hits: list[str] = []

        def finish(note: str = "") -> str:
            if not hits and not note:
                return f"no matches for {pattern!r}"
            return "\n".join(hits) + (("\n" if hits else "") + note if note else "")

        top = self._open_dir(path, base)
        try:
            # fwalk: directories by descriptor, symlinked directories not entered.
            for dirpath, dirnames, filenames, dfd in os.fwalk(".", dir_fd=top):
                d = base / dirpath
                dirnames[:] = sorted(n for n in dirnames if self.sandbox.denied_by(d / n) is None)
                for fname in sorted(filenames):
                    if time.monotonic() > deadline:
                        return finish(
                            f"[stopped at the time limit of {self.time_limit:g} s; narrow the pattern, path or glob]"
                        )
                    f = Path(os.path.normpath(d / fname))
                    rel = self._rel(f)
                    if name_rx is not None and not (name_rx.match(rel) or name_rx.match(fname)):
                        continue
                    data = self._search_bytes(fname, dfd, rel)
                    if data is None:
                        continue
                    for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
                        try:
                            # concurrent: the GIL is let go while matching, so a signal is handled
                            found = rx.search(line, timeout=max(0.001, deadline - time.monotonic()), concurrent=True)
                        except TimeoutError:
                            return finish(
                                f"[stopped at the time limit of {self.time_limit:g} s in {rel}:{n}; the "
                                "pattern backtracks too much (nested repetition such as (a+)+); simplify it]"
                            )
                        if found:
                            shown = line if len(line) <= 300 else line[:300] + "…"
                            hits.append(f"{rel}:{n}: {shown}")
                            if len(hits) >= max_results:
                                return finish(f"[stopped at {max_results} matches; narrow the pattern, path or glob]")
        finally:
            os.close(top)
        return finish()

    def _search_bytes(self, name: str, dir_fd: int, rel: str) -> bytes | None:
        """A searchable file's bytes, or None: only regular files, never through a symlink that
        leaves the workspace or reaches the deny list, never a FIFO or device (opened
        non-blocking, checked by fstat)."""
        if self.sandbox.check(rel) is not None:
            return None
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:
            try:  # a symlink inside the workspace: open what it resolves to, beneath the root
                p = self.sandbox.resolve(rel)
                fd = safe_fs.open_beneath(self.sandbox.root_of(p), p, os.O_RDONLY, shown=rel)
            except (OSError, PathRefused):
                return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SEARCH_FILE_BYTES:
                return None
            data = safe_fs.read_fd(fd)
        except OSError:
            return None
        finally:
            os.close(fd)
        return None if _is_binary(data) else data

    def _writer(self, path: str, p: Path, create: bool):
        try:
            return safe_fs.open_for_write(self.sandbox.roots, self.sandbox.root_of(p), p, path, create=create)
        except OSError as e:
            raise ToolRunError(f"cannot write {path}: {e.strerror or e}") from None

    def write_file(self, path: str, content: str) -> str:
        p = self.sandbox.resolve(path, write=True)
        if p.is_dir():
            raise ToolRunError(f"{path} is a directory")
        existed = p.exists()
        try:
            with self._writer(path, p, create=True) as fd:
                safe_fs.write_text(fd, content)
        except OSError as e:
            raise ToolRunError(f"cannot write {path}: {e.strerror or e}") from None
        lines = content.count("\n") + (1 if content and not content.endswith("\n") else 0)
        verb = "overwrote" if existed else "created"
        return f"{verb} {self._rel(p)} ({len(content)} characters, {lines} lines)"

    def edit_file(self, path: str, old_string: str, new_string: str, replace_all: bool = False) -> str:
        p = self.sandbox.resolve(path, write=True)
        if not p.exists():
            raise ToolRunError(f"no such file: {path}; use write_file to create it")
        if p.is_dir():
            raise ToolRunError(f"{path} is a directory")
        if old_string == "":
            raise ToolRunError("old_string is empty; use write_file to create or overwrite a whole file")
        if old_string == new_string:
            raise ToolRunError("old_string and new_string are the same; nothing to change")
        try:
            with self._writer(path, p, create=False) as fd:
                before = safe_fs.read_fd(fd)
                try:
                    text = before.decode("utf-8")
                except UnicodeDecodeError:
                    raise ToolRunError(f"{path} is not UTF-8 text; edit_file cannot change it safely") from None
                count = text.count(old_string)
                if count == 0:
                    raise ToolRunError(
                        f"old_string was not found in {path}; read the file and copy the exact "
                        "text, whitespace included"
                    )
                if count > 1 and not replace_all:
                    raise ToolRunError(
                        f"old_string occurs {count} times in {path}; include more surrounding "
                        "text to make it unique, or set replace_all to true"
                    )
                text = text.replace(old_string, new_string) if replace_all else text.replace(old_string, new_string, 1)
                if safe_fs.read_fd(fd) != before:  # another program saved it meanwhile: its write would be lost
                    raise ToolRunError(
                        f"{path} changed while it was being edited (another program wrote it); read "
                        "it again and repeat the edit"
                    )
                safe_fs.write_text(fd, text)
        except OSError as e:
            raise ToolRunError(f"cannot write {path}: {e.strerror or e}") from None
        n = count if replace_all else 1
        return f"replaced {n} occurrence{'s' if n != 1 else ''} in {self._rel(p)}"

    def _max_timeout(self) -> int:
        """The longest a command may ask for: the runner's own limit (120 s by default)."""
        return max(1, int(self.runner.timeout)) if self.runner.timeout else 3600

    def run_shell(self, command: str, timeout: int | None = None) -> ToolResult:
        return self.runner.shell(command, timeout=timeout)

    def tools(self) -> list[Tool]:
        s: dict[str, Any] = {"type": "string"}
        path = {"type": "string", "description": "Path relative to the workspace root."}
        return [
            Tool(
                "read_file",
                "Read a text file from the workspace. Long files come in pieces: use offset "
                "and limit (line numbers, 1-based) to read further.",
                {
                    "type": "object",
                    "properties": {
                        "path": path,
                        "offset": {"type": "integer", "minimum": 1, "description": "First line to read (1-based)."},
                        "limit": {"type": "integer", "minimum": 1, "description": "How many lines to read."},
                    },
                    "required": ["path"],
                    "additionalProperties": False,
                },
                self.read_file,
                "read",
                path_args=("path",),
                source="builtin",
            ),
            Tool(
                "list_dir",
                "List the entries of a workspace directory (directories end with /).",
                {
                    "type": "object",
                    "properties": {
                        "path": {
                            "type": "string",
                            "description": "Directory relative to the workspace root.",
                            "default": ".",
                        }
                    },
                    "additionalProperties": False,
                },
                self.list_dir,
                "read",
                primary="path",
                path_args=("path",),
                source="builtin",
            ),
            Tool(
                "search_files",
                "Search the text files under a workspace directory for lines matching a "
                "regular expression (Python syntax); prints path:line: text.",
                {
                    "type": "object",
                    "properties": {
                        "pattern": {"type": "string", "description": "Regular expression to look for."},
                        "path": {
                            "type": "string",
                            "description": "Directory to search, relative to the workspace root.",
                            "default": ".",
                        },
                        "glob": {
                            "type": "string",
                            "description": "Only files whose path matches this glob, e.g. *.py or src/**/*.ts.",
                        },
                        "max_results": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 50},
                    },
                    "required": ["pattern"],
                    "additionalProperties": False,
                },
                self.search_files,
                "read",
                path_args=("path",),
                source="builtin",
            ),
            Tool(
                "write_file",
                "Create or overwrite a text file in the workspace with the given content.",
                {
                    "type": "object",
                    "properties": {"path": path, "content": s},
                    "required": ["path", "content"],
                    "additionalProperties": False,
                },
                self.write_file,
                "write",
                path_args=("path",),
                source="builtin",
            ),
            Tool(
                "edit_file",
                "Replace an exact piece of text in a workspace file. old_string must occur "
                "exactly once unless replace_all is true; copy it from the file, whitespace included.",
                {
                    "type": "object",
                    "properties": {
                        "path": path,
                        "old_string": s,
                        "new_string": s,
                        "replace_all": {"type": "boolean", "default": False},
                    },
                    "required": ["path", "old_string", "new_string"],
                    "additionalProperties": False,
                },
                self.edit_file,
                "write",
                path_args=("path",),
                source="builtin",
            ),
            Tool(
                "run_shell",
                "Run a shell command (/bin/sh -c) in the workspace root and return its "
                "output and exit code. Commands time out; background processes are killed at the end.",
                {
                    "type": "object",
                    "properties": {
                        "command": {"type": "string", "description": "The command line."},
                        "timeout": {
                            "type": "integer",
                            "minimum": 1,
                            "maximum": self._max_timeout(),
                            "description": "Seconds before the command is killed.",
                        },
                    },
                    "required": ["command"],
                    "additionalProperties": False,
                },
                self.run_shell,
                "exec",
                source="builtin",
                self_limited=True,
            ),
        ]


def builtin_tools(
    workspace: Sandbox | Policy,
    runner: CommandRunner | None = None,
    *,
    max_output: int = DEFAULT_MAX_OUTPUT,
    time_limit: float = DEFAULT_TIME_LIMIT_S,
) -> list[Tool]:
    """The built-in tools bound to a workspace (a Sandbox, or a Policy's sandbox)."""
    sandbox = workspace.sandbox if isinstance(workspace, Policy) else workspace
    return Builtins(sandbox, runner, max_output, time_limit).tools()


def register_builtins(
    registry: ToolRegistry,
    workspace: Sandbox | Policy,
    runner: CommandRunner | None = None,
    *,
    only: list[str] | None = None,
) -> ToolRegistry:
    for t in builtin_tools(workspace, runner):
        if only is None or t.name in only:
            registry.add(t)
    return registry
