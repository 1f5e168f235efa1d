"""The parsed form of one tool call, shared by parsers, validation, policy and the executor."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

# What a tool call's arguments may hold. A model (or a client of the server) can write anything;
# past these limits the call is refused with a message and a repair round, never a traceback in a
# tool, a log writer or the terminal.
MAX_DEPTH = 64
MAX_ARGUMENT_CHARS = 1_000_000
MAX_INT = 2**63


@dataclass(frozen=True)
class ToolCall:
    """One tool call as the model wrote it.

    `raw` is the model's text for this call, verbatim (markers included when the parser saw them),
    so rejected calls can be logged exactly. `arguments` is the decoded object, or None when it could
    not be decoded; then `arguments_text` holds the undecoded argument text (if the format has one) for
    validation to diagnose, and `error` says what the parser could not make sense of.
    """

    name: str | None
    arguments: dict[str, Any] | None
    raw: str
    error: str | None = None
    arguments_text: str | None = None
    id: str | None = None

    @classmethod
    def from_openai(cls, obj: dict[str, Any]) -> ToolCall:
        """Build from an OpenAI-style `{"id", "type": "function", "function": {"name", "arguments"}}`.

        OpenAI sends `arguments` as a JSON string; it is decoded later by validation.
        """
        fn = obj.get("function", obj)
        args = fn.get("arguments")
        raw = json.dumps(obj, ensure_ascii=False)
        if isinstance(args, dict):
            return cls(fn.get("name"), args, raw, id=obj.get("id"))
        if args is None:
            return cls(fn.get("name"), None, raw, arguments_text="", id=obj.get("id"))
        if not isinstance(args, str):
            return cls(
                fn.get("name"), None, raw, error="arguments are neither an object nor a string", id=obj.get("id")
            )
        return cls(fn.get("name"), None, raw, arguments_text=args, id=obj.get("id"))

    def to_openai(self, call_id: str | None = None, *, json_arguments: bool = False) -> dict[str, Any]:
        """The assistant-message form chat templates expect under `tool_calls`.

        Most templates want `arguments` as an object (Qwen iterates it); DeepSeek's concatenates it, so
        pass `json_arguments=True` there to get a JSON string.
        """
        args: Any = self.arguments if self.arguments is not None else {}
        if json_arguments:
            args = json.dumps(args, ensure_ascii=False)
        out: dict[str, Any] = {"type": "function", "function": {"name": self.name or "", "arguments": args}}
        if call_id or self.id:
            out["id"] = call_id or self.id
        return out


@dataclass
class ToolsInfo:
    """Parameter schemas by tool name, from OpenAI tool dicts or a registry (what parsers coerce by)."""

    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def of(cls, tools: Any) -> ToolsInfo:
        if tools is None:
            return cls()
        if isinstance(tools, ToolsInfo):
            return tools
        if hasattr(tools, "definitions"):
            tools = tools.definitions()
        schemas: dict[str, dict[str, Any]] = {}
        for t in tools:
            fn = t.get("function", t) if isinstance(t, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                params = fn.get("parameters")
                schemas[fn["name"]] = params if isinstance(params, dict) else {}
        return cls(schemas)

    def property_schema(self, tool: str | None, arg: str) -> dict[str, Any] | None:
        params = self.schemas.get(tool or "")
        if not params:
            return None
        prop = (params.get("properties") or {}).get(arg)
        return prop if isinstance(prop, dict) else None


def argument_problem(value: Any) -> str | None:
    """Why decoded arguments cannot be used, or None: nesting deeper than MAX_DEPTH, more than
    MAX_ARGUMENT_CHARS of text, integers beyond 64 bits, non-finite numbers, or strings holding an
    unpaired UTF-16 surrogate (JSON allows `\\ud800`; no file, log or terminal can take it)."""
    total = 0
    stack: list[tuple[Any, str, int]] = [(value, "$", 0)]
    while stack:
        v, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            return f"the arguments nest deeper than {MAX_DEPTH} levels (at {path[:80]})"
        if isinstance(v, str):
            total += len(v)
            if total > MAX_ARGUMENT_CHARS:
                return f"the arguments hold more than {MAX_ARGUMENT_CHARS:,} characters of text"
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                return (
                    f"{path} holds an unpaired UTF-16 surrogate ({v[e.start]!r} at character {e.start}); "
                    "write the character itself or leave it out"
                )
        elif isinstance(v, bool) or v is None:
            continue
        elif isinstance(v, int):
            if abs(v) >= MAX_INT:
                return f"{path} is an integer too large for a tool argument (more than 64 bits)"
        elif isinstance(v, float):
            if not math.isfinite(v):
                return f"{path} is not a finite number"
        elif isinstance(v, dict):
            for k, item in v.items():
                if not isinstance(k, str):
                    return f"{path} has a key that is not a string"
                stack.append((k, f"{path} (a key)", depth + 1))
                stack.append((item, f"{path}.{k}", depth + 1))
        elif isinstance(v, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(v))
    return None
