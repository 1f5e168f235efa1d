"""Tool definitions and the registry the agent loop, validation and policy look tools up in.

A tool is an OpenAI-style function definition (name, description, JSON Schema parameters) plus the
Python callable that runs it and a declared risk, which decides how the policy treats it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from flashmoe.tools.errors import ToolDefinitionError
from flashmoe.tools.safe_schema import SchemaProblem, check_schema

Risk = Literal["read", "write", "exec"]
RISKS: tuple[str, ...] = ("read", "write", "exec")

# OpenAI allows [A-Za-z0-9_-]{1,64}; dots are accepted too since some templates use dotted names.
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True, eq=False)
class Tool:
    """One callable tool.

    `fn` is called with the validated arguments as keyword arguments. It returns a string (the tool
    result for the model), any JSON-serialisable value, or a `ToolResult`; it raises `ToolError` for
    failures the model should hear about.

    `primary` names the argument that policy rules match on (`run_shell(git status*)` matches
    `command`); by default the first required parameter. `path_args` lists the arguments that are
    workspace paths: the policy sandbox checks them before the tool runs.

    `check` (optional) looks at validated arguments before the policy rules and returns a refusal
    message, or None (command tools refuse values their program would read as options).
    `self_limited` says the tool enforces its own time limit (commands: the runner kills them);
    every other tool runs under the executor's wall-clock limit. `resolved_paths` hands `fn` the
    path arguments as the sandbox resolved them, so what runs is exactly what was checked.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]
    risk: Risk = "read"
    primary: str | None = None
    path_args: tuple[str, ...] = ()
    source: str = field(default="", compare=False)  # where it came from, for messages ("builtin", a file)
    check: Callable[[dict[str, Any]], str | None] | None = field(default=None, compare=False)
    self_limited: bool = False
    resolved_paths: bool = False

    def __post_init__(self) -> None:
        where = f" ({self.source})" if self.source else ""
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ToolDefinitionError(f"invalid tool name {self.name!r}{where}: use letters, digits, _ . - (max 64)")
        if self.risk not in RISKS:
            raise ToolDefinitionError(
                f"tool '{self.name}'{where}: risk must be one of {', '.join(RISKS)}, not {self.risk!r}"
            )
        if not callable(self.fn):
            raise ToolDefinitionError(f"tool '{self.name}'{where}: fn is not callable")
        params = self.parameters if self.parameters else {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ToolDefinitionError(f"tool '{self.name}'{where}: parameters must be a JSON Schema object")
        if params.get("type", "object") != "object":
            raise ToolDefinitionError(f'tool \'{self.name}\'{where}: parameters must have "type": "object"')
        try:
            check_schema(params)  # the metaschema, its patterns, its references (safe_schema.py)
        except SchemaProblem as e:
            raise ToolDefinitionError(
                f"tool '{self.name}'{where}: invalid parameters schema{(' at ' + e.path) if e.path else ''}: "
                f"{e.message}"
            ) from None
        props = params.get("properties") or {}
        for arg in (self.primary, *self.path_args):
            if arg is not None and arg not in props:
                raise ToolDefinitionError(f"tool '{self.name}'{where}: {arg!r} is not one of its parameters")
        object.__setattr__(self, "parameters", params)
        object.__setattr__(self, "description", str(self.description or "").strip())
        object.__setattr__(self, "path_args", tuple(self.path_args))

    @property
    def primary_arg(self) -> str | None:
        """The argument policy rules match on."""
        if self.primary:
            return self.primary
        required = self.parameters.get("required") or []
        if required:
            return str(required[0])
        props = list((self.parameters.get("properties") or {}).keys())
        return props[0] if props else None

    def definition(self) -> dict[str, Any]:
        """The OpenAI tool dict passed to chat templates as `tools=`."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


class ToolRegistry:
    """Tools by name, in registration order (the order the model sees them in)."""

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        self.extend(tools)

    def add(self, tool: Tool, *, replace: bool = False) -> Tool:
        if not isinstance(tool, Tool):
            raise ToolDefinitionError(f"not a Tool: {tool!r}")
        if tool.name in self._tools and not replace:
            old = self._tools[tool.name]
            where = f" (already defined by {old.source})" if old.source else ""
            raise ToolDefinitionError(f"duplicate tool name '{tool.name}'{where}")
        self._tools[tool.name] = tool
        return tool

    def extend(self, tools: Iterable[Tool], *, replace: bool = False) -> None:
        for t in tools:
            self.add(t, replace=replace)

    def remove(self, name: str) -> None:
        self._tools.pop(name, None)

    def get(self, name: str | None) -> Tool | None:
        return self._tools.get(name) if name is not None else None

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(list(self._tools.values()))

    def __len__(self) -> int:
        return len(self._tools)

    def names(self) -> list[str]:
        return list(self._tools)

    def definitions(self, names: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """OpenAI-style `[{"type": "function", "function": {name, description, parameters}}]`."""
        wanted = self.names() if names is None else list(names)
        return [self._tools[n].definition() for n in wanted if n in self._tools]

    def subset(self, names: Iterable[str]) -> ToolRegistry:
        """A registry with only the named tools (unknown names raise, so typos in flags are caught)."""
        names = list(names)
        unknown = [n for n in names if n not in self._tools]
        if unknown:
            raise ToolDefinitionError(
                f"unknown tool {', '.join(map(repr, unknown))}; available: {', '.join(self.names()) or '(none)'}"
            )
        return ToolRegistry(self._tools[n] for n in names)
