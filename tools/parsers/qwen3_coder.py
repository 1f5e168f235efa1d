"""Qwen3.5 / Qwen3-Coder XML calls:

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

Values are bare text; they are coerced by the tool's JSON Schema (integers, numbers, booleans,
JSON objects and arrays, null), so pass `tools` (OpenAI dicts or a ToolRegistry) to get typed
arguments. Without a schema every value stays a string.
"""
from __future__ import annotations

import json
import re
from typing import Any

from tools.calls import ToolCall, ToolsInfo
from tools.parsers._common import blocks, json_calls

name = "qwen3_coder"
tool_call_start = "<tool_call>"
tool_call_end = "</tool_call>"

_FUNC = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|(?=<function=)|\Z)", re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|\Z)", re.DOTALL)
_INT = re.compile(r"^[+-]?\d+$")


def _types(schema: dict[str, Any]) -> list[str]:
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    out: list[str] = []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            if isinstance(sub, dict):
                out.extend(x for x in _types(sub) if x not in out)
    if not out and "enum" in schema:
        for v in schema["enum"]:
            kind = ("boolean" if isinstance(v, bool) else "integer" if isinstance(v, int) else
                    "number" if isinstance(v, float) else "null" if v is None else "string")
            if kind not in out:
                out.append(kind)
    return out


def coerce(value: str, schema: dict[str, Any] | None) -> Any:
    """The typed value a bare parameter string stands for, given its property schema."""
    if not schema:
        return value
    types = _types(schema)
    if not types or "string" in types:
        return value
    s = value.strip()
    if "null" in types and s in ("null", "None", ""):
        return None
    for t in types:
        if t == "integer" and _INT.match(s):
            return int(s)
        if t == "number":
            if _INT.match(s):
                return int(s)
            try:
                f = float(s)
            except ValueError:
                continue
            if f == f and f not in (float("inf"), float("-inf")):
                return f
        if t == "boolean" and s.lower() in ("true", "false"):
            return s.lower() == "true"
        if t in ("object", "array"):
            try:
                v = json.loads(s)
            except json.JSONDecodeError:
                continue
            if isinstance(v, dict if t == "object" else list):
                return v
    return value  # left as text: validation reports the type mismatch


def _value(text: str) -> str:
    # The template writes "\n" after the opening tag and before the closing one.
    if text.startswith("\r\n"):
        text = text[2:]
    elif text.startswith("\n"):
        text = text[1:]
    if text.endswith("\r\n"):
        text = text[:-2]
    elif text.endswith("\n"):
        text = text[:-1]
    return text


def parse_tool_call(text: str, tools: Any = None) -> list[ToolCall]:
    info = ToolsInfo.of(tools)
    calls: list[ToolCall] = []
    for raw, body in blocks(text, tool_call_start, tool_call_end):
        funcs = list(_FUNC.finditer(body))
        if not funcs:
            if body.strip().startswith(("{", "[", "```")):  # the model fell back to Hermes JSON
                calls.extend(json_calls(body, raw))
            else:
                calls.append(ToolCall(None, None, raw, error="no <function=NAME> block in the tool call"))
            continue
        for f in funcs:
            fname = f.group(1).strip()
            call_raw = raw if len(funcs) == 1 else f.group(0)
            if not fname:
                calls.append(ToolCall(None, None, call_raw, error="<function=> has no name"))
                continue
            args: dict[str, Any] = {}
            dup = None
            for p in _PARAM.finditer(f.group(2)):
                pname = p.group(1).strip()
                if pname in args:
                    dup = pname
                args[pname] = coerce(_value(p.group(2)), info.property_schema(fname, pname))
            if dup is not None:
                calls.append(ToolCall(fname, None, call_raw, error=f"parameter '{dup}' is given twice",
                                      arguments_text=None))
                continue
            calls.append(ToolCall(fname, args, call_raw))
    return calls
