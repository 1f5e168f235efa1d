"""The built-in tools: read_file, list_dir, search_files, write_file, edit_file, run_shell.

They are bound to one workspace: every path argument is relative to its root and goes through the
sandbox (the policy also checks it before the call is approved; this is the second line).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from tools.errors import ToolRunError
from tools.policy import Policy, Sandbox, glob_regex
from tools.registry import Tool, ToolRegistry
from tools.runner import DEFAULT_MAX_OUTPUT, CommandRunner, ToolResult

MAX_SEARCH_FILE_BYTES = 4 * 1024 * 1024
MAX_DIR_ENTRIES = 1000


def _is_binary(data: bytes) -> bool:
    return b"\x00" in data[:8192]


class Builtins:
    """Holds the workspace sandbox and runner the built-in tools use."""

    def __init__(self, sandbox: Sandbox, runner: CommandRunner | None = None,
                 max_output: int = DEFAULT_MAX_OUTPUT) -> None:
        self.sandbox = sandbox
        self.runner = runner or CommandRunner(cwd=sandbox.root)
        self.max_output = max_output

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

    def read_file(self, path: str, offset: int = 1, limit: int | None = None) -> str:
        p = self._existing_file(path)
        data = p.read_bytes()
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
            text += (f"\n[showing lines {offset}-{last} of {len(lines)}; call read_file with offset={last + 1} "
                     "to read on]")
        elif offset > 1 or last < len(lines):
            text += f"\n[lines {offset}-{last} of {len(lines)}]"
        return text

    def list_dir(self, path: str = ".") -> str:
        p = self.sandbox.resolve(path)
        if not p.exists():
            raise ToolRunError(f"no such directory: {path}")
        if not p.is_dir():
            raise ToolRunError(f"{path} is a file, not a directory; use read_file")
        entries = sorted(p.iterdir(), key=lambda e: e.name)
        names = [e.name + ("/" if e.is_dir() else "") for e in entries[:MAX_DIR_ENTRIES]]
        if not names:
            return f"({path} is empty)"
        text = "\n".join(names)
        if len(entries) > MAX_DIR_ENTRIES:
            text += f"\n[{len(entries) - MAX_DIR_ENTRIES} more entries not shown]"
        return text

    def search_files(self, pattern: str, path: str = ".", glob: str | None = None, max_results: int = 50) -> str:
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise ToolRunError(f"invalid regular expression {pattern!r}: {e}") from None
        base = self.sandbox.resolve(path)
        if not base.is_dir():
            raise ToolRunError(f"no such directory: {path}")
        name_rx = glob_regex(glob) if glob else None
        hits: list[str] = []
        for dirpath, dirnames, filenames in os.walk(base):
            d = Path(dirpath)
            dirnames[:] = sorted(n for n in dirnames if self.sandbox.denied_by(d / n) is None)
            for fname in sorted(filenames):
                f = d / fname
                rel = self._rel(f)
                if name_rx is not None and not (name_rx.match(rel) or name_rx.match(fname)):
                    continue
                if self.sandbox.check(rel) is not None:  # deny list, or a symlink leading out
                    continue
                try:
                    if f.stat().st_size > MAX_SEARCH_FILE_BYTES:
                        continue
                    data = f.read_bytes()
                except OSError:
                    continue
                if _is_binary(data):
                    continue
                for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
                    if rx.search(line):
                        shown = line if len(line) <= 300 else line[:300] + "…"
                        hits.append(f"{rel}:{n}: {shown}")
                        if len(hits) >= max_results:
                            return "\n".join(hits) + (f"\n[stopped at {max_results} matches; narrow the "
                                                      "pattern, path or glob]")
        if not hits:
            return f"no matches for {pattern!r}"
        return "\n".join(hits)

    def write_file(self, path: str, content: str) -> str:
        p = self.sandbox.resolve(path, write=True)
        if p.is_dir():
            raise ToolRunError(f"{path} is a directory")
        existed = p.exists()
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "w", encoding="utf-8", newline="") as f:
            f.write(content)
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
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise ToolRunError(f"{path} is not UTF-8 text; edit_file cannot change it safely") from None
        count = text.count(old_string)
        if count == 0:
            raise ToolRunError(f"old_string was not found in {path}; read the file and copy the exact text, "
                               "whitespace included")
        if count > 1 and not replace_all:
            raise ToolRunError(f"old_string occurs {count} times in {path}; include more surrounding text to "
                               "make it unique, or set replace_all to true")
        text = text.replace(old_string, new_string) if replace_all else text.replace(old_string, new_string, 1)
        with open(p, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        n = count if replace_all else 1
        return f"replaced {n} occurrence{'s' if n != 1 else ''} in {self._rel(p)}"

    def run_shell(self, command: str, timeout: int | None = None) -> ToolResult:
        return self.runner.shell(command, timeout=timeout)

    def tools(self) -> list[Tool]:
        s: dict[str, Any] = {"type": "string"}
        path = {"type": "string", "description": "Path relative to the workspace root."}
        return [
            Tool("read_file", "Read a text file from the workspace. Long files come in pieces: use offset "
                 "and limit (line numbers, 1-based) to read further.",
                 {"type": "object", "properties": {
                     "path": path,
                     "offset": {"type": "integer", "minimum": 1, "description": "First line to read (1-based)."},
                     "limit": {"type": "integer", "minimum": 1, "description": "How many lines to read."}},
                  "required": ["path"], "additionalProperties": False},
                 self.read_file, "read", path_args=("path",), source="builtin"),
            Tool("list_dir", "List the entries of a workspace directory (directories end with /).",
                 {"type": "object", "properties": {
                     "path": {"type": "string", "description": "Directory relative to the workspace root.",
                              "default": "."}},
                  "additionalProperties": False},
                 self.list_dir, "read", primary="path", path_args=("path",), source="builtin"),
            Tool("search_files", "Search the text files under a workspace directory for lines matching a "
                 "regular expression (Python syntax); prints path:line: text.",
                 {"type": "object", "properties": {
                     "pattern": {"type": "string", "description": "Regular expression to look for."},
                     "path": {"type": "string", "description": "Directory to search, relative to the workspace "
                              "root.", "default": "."},
                     "glob": {"type": "string", "description": "Only files whose path matches this glob, "
                              "e.g. *.py or src/**/*.ts."},
                     "max_results": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 50}},
                  "required": ["pattern"], "additionalProperties": False},
                 self.search_files, "read", path_args=("path",), source="builtin"),
            Tool("write_file", "Create or overwrite a text file in the workspace with the given content.",
                 {"type": "object", "properties": {"path": path, "content": s},
                  "required": ["path", "content"], "additionalProperties": False},
                 self.write_file, "write", path_args=("path",), source="builtin"),
            Tool("edit_file", "Replace an exact piece of text in a workspace file. old_string must occur "
                 "exactly once unless replace_all is true; copy it from the file, whitespace included.",
                 {"type": "object", "properties": {
                     "path": path, "old_string": s, "new_string": s,
                     "replace_all": {"type": "boolean", "default": False}},
                  "required": ["path", "old_string", "new_string"], "additionalProperties": False},
                 self.edit_file, "write", path_args=("path",), source="builtin"),
            Tool("run_shell", "Run a shell command (/bin/sh -c) in the workspace root and return its "
                 "output and exit code. Commands time out; background processes are killed at the end.",
                 {"type": "object", "properties": {
                     "command": {"type": "string", "description": "The command line."},
                     "timeout": {"type": "integer", "minimum": 1, "maximum": 3600,
                                 "description": "Seconds before the command is killed."}},
                  "required": ["command"], "additionalProperties": False},
                 self.run_shell, "exec", source="builtin"),
        ]


def builtin_tools(workspace: Sandbox | Policy, runner: CommandRunner | None = None, *,
                  max_output: int = DEFAULT_MAX_OUTPUT) -> list[Tool]:
    """The built-in tools bound to a workspace (a Sandbox, or a Policy's sandbox)."""
    sandbox = workspace.sandbox if isinstance(workspace, Policy) else workspace
    return Builtins(sandbox, runner, max_output).tools()


def register_builtins(registry: ToolRegistry, workspace: Sandbox | Policy, runner: CommandRunner | None = None,
                      *, only: list[str] | None = None) -> ToolRegistry:
    for t in builtin_tools(workspace, runner):
        if only is None or t.name in only:
            registry.add(t)
    return registry
