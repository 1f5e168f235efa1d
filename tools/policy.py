"""What tools may do: modes, deny > ask > allow rules, the workspace sandbox, and approvers.

Modes:
  read-only        only tools with risk "read" run; everything else is refused.
  ask (default)    reads run; writes and commands ask the approver.
  workspace-write  reads and writes inside the workspace run; commands still ask.
  yolo             everything the sandbox and the rules permit runs without asking
                   (needs dangerously_skip_approvals=True).

Rules are checked deny first, then ask, then allow (a broad deny cannot be undone by an allow).
The sandbox and its deny list apply in every mode, yolo included.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from flashmoe.tools import shellwords
from flashmoe.tools.calls import ToolCall
from flashmoe.tools.errors import PathRefused, PolicyError
from flashmoe.tools.gitguard import git_metadata_write, program_keys
from flashmoe.tools.globmatch import Glob
from flashmoe.tools.registry import Tool
from flashmoe.tools.sensitive_paths import CREDENTIAL_STORES, START_UP_FILES
from flashmoe.tools.side_effects import side_effect_option

Mode = Literal["read-only", "ask", "workspace-write", "yolo"]
MODES: tuple[str, ...] = ("read-only", "ask", "workspace-write", "yolo")
Action = Literal["allow", "ask", "deny"]
Answer = Literal["yes", "no", "always"]

# Never readable or writable through tools, whatever the mode or rules say: repository metadata,
# environment files, and (tools/sensitive_paths.py, data) the credential stores and start-up files
# under $HOME, which matter when the workspace is $HOME or contains it.
DEFAULT_DENY_PATHS: tuple[str, ...] = (".git/**", "**/.git/**", "**/.env*", *CREDENTIAL_STORES, *START_UP_FILES)


def literal_glob(path: str) -> str:
    """A glob that matches `path` itself: its glob characters put in classes of one."""
    return "".join(f"[{c}]" if c in "*?[]" else c for c in path)


# An allow rule for a command never covers text that chains, substitutes or redirects:
# `run_shell(git status*)` must not allow `git status; rm -rf ~`.
_SHELL_META = re.compile(r"[;&|`<>\n\r()]|\$\(")

EXIT_APPROVAL_NEEDED = 5  # headless runs exit with this when a call needed approval nobody could give


def glob_regex(pattern: str, *, ignore_case: bool = False) -> Glob:
    """A glob (tools/globmatch.py: `*` matches slashes too, `**/` also no directory, a trailing
    `/**` the directory itself), matched in linear time; `.match(text)` is true for the whole text.
    Named for the regex it used to compile to, which backtracked on patterns the model wrote."""
    return Glob(pattern, ignore_case=ignore_case)


class Sandbox:
    """Keeps path arguments inside the workspace and off the deny list.

    Paths are relative to the workspace root (absolute ones are accepted when they land inside it).
    They are resolved with symlinks followed, so a link pointing out of the workspace is refused, and
    both the path as written and the resolved path are checked against the deny list.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        extra_roots: Iterable[str | os.PathLike[str]] = (),
        deny: Iterable[str] = DEFAULT_DENY_PATHS,
    ) -> None:
        self.root = Path(root).expanduser().resolve(strict=False)
        self.roots = [self.root, *(Path(r).expanduser().resolve(strict=False) for r in extra_roots)]
        # Case-insensitive: on macOS `.ENV` opens `.env`.
        self.deny = [(p, glob_regex(os.path.expanduser(p), ignore_case=True)) for p in deny]

    def relative(self, path: Path) -> str:
        """Workspace-relative POSIX form ('.' for the root), or the absolute path if outside."""
        try:
            rel = path.relative_to(self.root).as_posix()
            return rel if rel else "."
        except ValueError:
            return path.as_posix()

    def _inside(self, path: Path) -> bool:
        return any(path == r or path.is_relative_to(r) for r in self.roots)

    def forms(self, path: Path) -> list[str]:
        """The strings deny patterns and rules match a path by: absolute, and workspace-relative."""
        forms = [path.as_posix()]
        if path.is_relative_to(self.root):
            forms.append(self.relative(path))
        return forms

    def denied_by(self, *paths: Path) -> str | None:
        """The deny pattern one of the paths matches, if any."""
        for path in paths:
            forms = self.forms(path)
            for text, rx in self.deny:
                if any(rx.match(f) for f in forms):
                    return text
        return None

    def resolve(self, path: str | os.PathLike[str], *, write: bool = False) -> Path:
        """The resolved absolute path, or PathRefused with a message fit for the model."""
        text = os.fspath(path)
        if not isinstance(text, str) or not text.strip():
            raise PathRefused("empty path")
        if "\x00" in text:
            raise PathRefused(f"path {text!r} contains a NUL byte")
        candidate = self.root / os.path.expanduser(text)
        lexical = Path(os.path.normpath(candidate))
        try:
            resolved = candidate.resolve(strict=False)
        except (OSError, RuntimeError) as e:  # symlink loops
            raise PathRefused(f"path '{text}' cannot be resolved: {e}") from None
        if not self._inside(resolved):
            if self._inside(lexical):
                raise PathRefused(
                    f"path '{text}' resolves through a symlink to {resolved}, outside the workspace {self.root}"
                )
            raise PathRefused(f"path '{text}' is outside the workspace {self.root}")
        pattern = self.denied_by(lexical, resolved)
        if pattern is not None:
            raise PathRefused(
                f"path '{text}' is on the deny list ({pattern}); tools may never {'write' if write else 'read'} it"
            )
        if write:
            gitdir = git_metadata_write(self.root_of(resolved), resolved)
            if gitdir is not None:
                raise PathRefused(
                    f"path '{text}' would make {self.relative(gitdir)} look like a git repository "
                    "(HEAD with objects/ or refs/); tools never write repository metadata, "
                    "since git would run what its config says"
                )
        return resolved

    def root_of(self, path: Path) -> Path:
        """The workspace root (or extra root) a resolved path lies in."""
        return max(
            (r for r in self.roots if path == r or path.is_relative_to(r)),
            key=lambda r: len(r.parts),
            default=self.root,
        )

    def argument_escapes(self, arg: str) -> bool:
        """Whether a command argument, read as a path from the workspace root, leaves the workspace
        or reaches the deny list (`cat ../x`, `--output=/tmp/x`, `cat .env`)."""
        if arg.startswith("-"):  # an option: only its value, if it has one, can be a path
            if "=" not in arg:
                return False
            arg = arg.split("=", 1)[1]
        value = arg
        if not value:
            return False
        candidate = self.root / value
        lexical = Path(os.path.normpath(candidate))
        try:
            resolved = candidate.resolve(strict=False)
        except (OSError, RuntimeError):
            return True
        return not (self._inside(lexical) and self._inside(resolved)) or self.denied_by(lexical, resolved) is not None

    def check(self, path: str | os.PathLike[str], *, write: bool = False) -> str | None:
        """None if allowed, else the refusal message."""
        try:
            self.resolve(path, write=write)
        except PathRefused as e:
            return str(e)
        return None


@dataclass(frozen=True)
class Rule:
    """`tool` or `tool(pattern)`: the tool name and the pattern are fnmatch-style globs; the
    pattern is matched against the tool's primary argument (a workspace-relative path for path
    arguments, the command text for commands)."""

    action: Action
    tool: str
    pattern: str | None
    text: str

    _RE = re.compile(r"^\s*([A-Za-z0-9_.*?\[\]!-]+)\s*(?:\((.*)\))?\s*$", re.DOTALL)

    @classmethod
    def parse(cls, text: str, action: Action) -> Rule:
        if action not in ("allow", "ask", "deny"):
            raise PolicyError(f"rule action must be allow, ask or deny, not {action!r}")
        m = cls._RE.match(text) if isinstance(text, str) else None
        if not m:
            raise PolicyError(
                f"bad {action} rule {text!r}: expected tool or tool(pattern), "
                "e.g. run_shell(git status*) or write_file(src/**)"
            )
        return cls(action, m.group(1), m.group(2), text.strip())

    def matches_tool(self, name: str) -> bool:
        return bool(glob_regex(self.tool).match(name))

    def matches_value(self, forms: Sequence[str], *, command: bool = False) -> bool:
        if self.pattern is None:
            return True
        rx = command_regex(self.pattern) if command else glob_regex(os.path.expanduser(self.pattern.strip()))
        return any(rx.match(f) for f in forms)


def command_regex(pattern: str) -> Glob:
    """A rule pattern for a command line: a glob whose trailing `*` (or ` *`) means "and any further
    arguments", at a word boundary, so `git status*` covers `git status -s` but not `git statusx`."""
    pat = " ".join(pattern.split())
    head = pat.rstrip("*").rstrip()
    if pat.endswith("*") and head:
        return Glob(head, word_tail=True)
    return Glob(pat)


@dataclass(frozen=True)
class Decision:
    """What the policy says about one call. `explicit` marks asks that a blanket "yes to
    everything" setting must not answer (commands)."""

    action: Action
    reason: str
    rule: str | None = None
    explicit: bool = False


def _clip(s: str, n: int = 200) -> str:
    s = s.replace("\n", "\\n")
    return s if len(s) <= n else s[: n - 1] + "…"


class Policy:
    """Decides allow / ask / deny for a tool call. See the module docstring for the modes."""

    def __init__(
        self,
        workspace: str | os.PathLike[str],
        mode: str = "ask",
        *,
        allow: Iterable[str | Rule] = (),
        ask: Iterable[str | Rule] = (),
        deny: Iterable[str | Rule] = (),
        dangerously_skip_approvals: bool = False,
        deny_paths: Iterable[str] = DEFAULT_DENY_PATHS,
        extra_roots: Iterable[str | os.PathLike[str]] = (),
    ) -> None:
        if mode not in MODES:
            raise PolicyError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
        if mode == "yolo" and not dangerously_skip_approvals:
            raise PolicyError(
                "yolo mode runs every tool call without asking; it needs "
                "dangerously_skip_approvals=True (--dangerously-skip-approvals)"
            )
        self.mode: str = mode
        self.sandbox = Sandbox(workspace, extra_roots=extra_roots, deny=deny_paths)
        self.rules: list[Rule] = []
        for action, items in (("deny", deny), ("ask", ask), ("allow", allow)):
            for r in items:
                self.rules.append(r if isinstance(r, Rule) else Rule.parse(r, action))  # type: ignore[arg-type]

    @property
    def workspace(self) -> Path:
        return self.sandbox.root

    def add_rule(self, text: str | Rule, action: Action = "allow") -> Rule:
        rule = text if isinstance(text, Rule) else Rule.parse(text, action)
        self.rules.append(rule)
        return rule

    def _forms(self, tool: Tool, value: Any) -> tuple[list[str], list[str]]:
        """(forms for deny/ask, forms for allow) of the primary argument."""
        if value is None:
            return [], []
        if not isinstance(value, str):
            import json

            value = json.dumps(value, ensure_ascii=False)
        if tool.primary_arg in tool.path_args:
            # Deny and ask match the path as written, normalised and resolved; allow only the
            # resolved path, so `write_file(src/**)` does not cover `src/../setup.py`.
            candidate = self.sandbox.root / os.path.expanduser(value)
            lexical = Path(os.path.normpath(candidate))
            try:
                resolved = candidate.resolve(strict=False)
            except (OSError, RuntimeError):
                return [value], []
            allow_forms = self.sandbox.forms(resolved)
            return [value, *self.sandbox.forms(lexical), *allow_forms], allow_forms
        return [value], [value]

    def _command_allow_form(self, line: str) -> str | None:
        """The one form of a command line an allow rule may cover, or None when no allow rule may:
        a single simple command, no shell syntax or expansion, the program found on PATH (not a
        file the model wrote), no wrapper in front, no option that writes files or runs programs,
        no argument that leaves the workspace or reaches the deny list, and for git no repository
        config that names a program (gitguard.program_keys)."""
        if _SHELL_META.search(line) or shellwords.has_expansion(line):
            return None
        cmds = shellwords.commands(line)
        if not cmds or len(cmds) != 1:
            return None
        cmd = cmds[0]
        if cmd.wrapped or cmd.program != cmd.argv[0] or side_effect_option(cmd.argv) is not None:
            return None
        if any(self.sandbox.argument_escapes(a) for a in cmd.argv[1:]):
            return None
        if cmd.program == "git" and program_keys(self.sandbox.root):
            return None  # the repository's own config would choose a program git runs
        return cmd.normalized

    def _command_rule_hits(self, rule: Rule, line: str) -> tuple[bool, str]:
        """Whether a deny or ask rule covers a command line, matched on every simple command it
        runs (program by basename, wrappers dropped). A line whose program is only known at run
        time counts as covered: the rule is never skipped because the line was hard to read."""
        if rule.pattern is None:
            return True, ""
        cmds = shellwords.commands(line)
        if cmds is None:
            return True, " (the command line cannot be parsed: an unclosed quote)"
        forms = [line.strip(), *(c.normalized for c in cmds), *(" ".join(c.argv) for c in cmds)]
        if rule.matches_value(forms, command=True):
            return True, ""
        if any(not c.program and not c.guess for c in cmds):
            return True, " (what it runs is only known at run time, so it cannot be checked against the rule)"
        return False, ""

    def decide(self, tool: Tool, arguments: dict[str, Any]) -> Decision:
        for arg in tool.path_args:
            value = arguments.get(arg)
            if value is None:
                continue
            refusal = self.sandbox.check(str(value), write=tool.risk == "write")
            if refusal:
                return Decision("deny", refusal)
        if tool.check is not None:
            refusal = tool.check(arguments)
            if refusal:
                return Decision("deny", refusal)
        value = arguments.get(tool.primary_arg) if tool.primary_arg else None
        summary = f"{tool.name}({_clip(str(value))})" if value is not None else tool.name
        rules = [r for r in self.rules if r.matches_tool(tool.name)]
        command = tool.risk == "exec" and isinstance(value, str)

        def hits(r: Rule) -> tuple[bool, str]:
            if command:
                return self._command_rule_hits(r, value)
            return r.matches_value(deny_forms or [""]), ""

        deny_forms, allow_forms = ([], []) if command else self._forms(tool, value)
        for r in rules:
            hit, why = hits(r) if r.action == "deny" else (False, "")
            if hit:
                return Decision("deny", f"{summary} is refused by the rule deny {r.text}{why}", r.text)
        if self.mode == "read-only" and tool.risk != "read":
            return Decision(
                "deny",
                f"{summary} is refused: read-only mode allows only tools that read "
                f"({tool.name} has risk '{tool.risk}')",
            )
        explicit = tool.risk == "exec"
        for r in rules:
            hit, why = hits(r) if r.action == "ask" else (False, "")
            if hit:
                return Decision("ask", f"{summary} needs approval (rule ask {r.text}){why}", r.text, explicit)
        if command:
            form = self._command_allow_form(value)
            allow_forms = [form] if form is not None else []
        for r in rules:
            if r.action == "allow" and (r.pattern is None or r.matches_value(allow_forms, command=command)):
                return Decision("allow", f"allowed by the rule allow {r.text}", r.text)
        if self.mode == "yolo":
            return Decision("allow", "yolo mode")
        if tool.risk == "read":
            return Decision("allow", "reads are allowed")
        if tool.risk == "write":
            if self.mode == "workspace-write":
                return Decision("allow", "workspace-write mode allows writes inside the workspace")
            return Decision("ask", f"{summary} changes files in the workspace")
        return Decision("ask", f"{summary} runs a command and needs an explicit yes", explicit=True)


@runtime_checkable
class Approver(Protocol):
    """Asks someone whether a call may run: "yes" (this call), "no", or "always" (this session).

    It lives here, beside the Policy and executor that consume it, so that tools never import a
    front end; the front ends' approvers (flashmoe.cli.approvers, the TUI's) implement it.
    `interactive` False means nobody can answer: the executor then refuses with a message that
    says so, without asking."""

    interactive: bool

    def ask(self, call: ToolCall, reason: str) -> Answer: ...


@dataclass
class NonInteractiveApprover:
    """Headless runs: nobody can answer, so every ask is a "no" (fail closed). The calls that needed
    approval are kept so the run can report them and exit with EXIT_APPROVAL_NEEDED."""

    interactive: bool = field(default=False, init=False)
    needed: list[tuple[ToolCall, str]] = field(default_factory=list)

    def ask(self, call: ToolCall, reason: str) -> Answer:
        self.needed.append((call, reason))
        return "no"

    @property
    def approval_needed(self) -> bool:
        return bool(self.needed)


@dataclass
class ScriptedApprover:
    """Answers from a fixed list (tests, scripted sessions); fails closed when the list runs out."""

    answers: list[Answer]
    asked: list[tuple[ToolCall, str]] = field(default_factory=list)
    interactive: bool = field(default=True, init=False)

    def ask(self, call: ToolCall, reason: str) -> Answer:
        self.asked.append((call, reason))
        return self.answers.pop(0) if self.answers else "no"
