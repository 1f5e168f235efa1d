"""GLM-4.5 / 4.6 / 4.7 (glm4_moe), also Poolside Laguna:

    <tool_call>NAME
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    </tool_call>

(4.7 writes it without the newlines.) The template writes string values bare and everything else
as JSON, so values are typed by the tool's schema, or decoded as JSON when there is none; a
string value keeps its spaces and newlines as written (indented code, a diff). Also
read, as GLM models sometimes write them: a JSON call object, `NAME {json}` and `NAME k=v ...`.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

from flashmoe.tools.calls import ToolCall, ToolsInfo
from flashmoe.tools.parsers._common import blocks, call_from_object, coerce

name = "glm47"
tool_call_start = "<tool_call>"
tool_call_end = "</tool_call>"
KEY, VALUE = "arg_key", "arg_value"
_TOOL_NAME = re.compile(r"^[\w.\-]{1,64}$")


def kv_call(body: str, raw: str, info: ToolsInfo, key: str = KEY, value: str = VALUE) -> ToolCall:
    """One NAME<key>k</key><value>v</value>... call (GLM, LongCat)."""
    pairs = re.compile(rf"<{key}>(.*?)</{key}>\s*<{value}>(.*?)(?:</{value}>|\Z)", re.DOTALL)
    head, sep, _ = body.partition(f"<{key}>")
    fname = head.strip()
    if not sep:
        return _other_shapes(fname, raw, info)
    if not _TOOL_NAME.match(fname):
        return ToolCall(None, None, raw, error=f"no tool name before <{key}>")
    args: dict[str, Any] = {}
    for m in pairs.finditer(body):
        k = m.group(1).strip()
        if k in args:
            return ToolCall(fname, None, raw, error=f"argument '{k}' is given twice")
        # a string value as written, spaces included (vLLM keeps them: indented code, diffs)
        args[k] = coerce(m.group(2), info.property_schema(fname, k), untyped="guess")
    return ToolCall(fname, args, raw)


def _other_shapes(s: str, raw: str, info: ToolsInfo) -> ToolCall:
    if not s:
        return ToolCall(None, None, raw, error="empty tool call")
    if s.startswith("{"):
        try:
            return call_from_object(json.loads(s), raw)
        except json.JSONDecodeError as e:
            return ToolCall(None, None, raw, error=f"invalid JSON: {e}")
    parts = s.split(None, 1)
    fname, rest = parts[0], (parts[1].strip() if len(parts) > 1 else "")
    if not _TOOL_NAME.match(fname):
        return ToolCall(None, None, raw, error=f"no <{KEY}> and no tool name in the tool call")
    if not rest:
        return ToolCall(fname, {}, raw)
    if rest.startswith("{"):
        return call_from_object({"name": fname, "arguments": rest}, raw)
    try:
        tokens = shlex.split(rest)
    except ValueError:
        tokens = []
    if tokens and all("=" in t and not t.startswith("=") for t in tokens):
        args = {}
        for t in tokens:
            k, _, v = t.partition("=")
            args[k] = coerce(v, info.property_schema(fname, k), untyped="guess")
        return ToolCall(fname, args, raw)
    return ToolCall(
        fname,
        None,
        raw,
        error=f"expected <{KEY}>...</{KEY}><{VALUE}>...</{VALUE}> pairs after the tool name",
        arguments_text=None,
    )


def parse_tool_call(text: str, tools: Any = None) -> list[ToolCall]:
    info = ToolsInfo.of(tools)
    return [kv_call(body, raw, info) for raw, body in blocks(text, tool_call_start, tool_call_end)]
