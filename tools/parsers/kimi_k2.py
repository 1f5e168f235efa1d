"""Kimi K2:

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|>
    <|tool_calls_section_end|>

The id (`functions.NAME:0`) is kept as the call's id; the arguments are JSON (a Python literal is
accepted too, as mlx-lm and vLLM do)."""

from __future__ import annotations

import json
import re
from typing import Any

from flashmoe.tools.calls import ToolCall
from flashmoe.tools.parsers._common import blocks, literal

name = "kimi_k2"
tool_call_start = "<|tool_calls_section_begin|>"
tool_call_end = "<|tool_calls_section_end|>"
CALL_BEGIN, CALL_END, ARGS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
_ID = re.compile(r"^\s*((?:functions\.)?([\w.\-]+?)(?::\d+)?)\s*$")


def _one(body: str, raw: str) -> ToolCall:
    head, sep, args = body.partition(ARGS)
    m = _ID.match(head)
    if not m:
        return ToolCall(None, None, raw, error="expected functions.NAME:N before the arguments")
    call_id, fname = m.group(1), m.group(2)
    a = args.strip()
    if not sep or not a:
        return ToolCall(fname, None, raw, arguments_text="", id=call_id)
    try:
        value = json.loads(a)
    except json.JSONDecodeError as e:
        try:
            value = literal(a)
        except ValueError:
            return ToolCall(fname, None, raw, error=f"invalid JSON: {e}", arguments_text=a, id=call_id)
    if not isinstance(value, dict):
        return ToolCall(fname, None, raw, error="the arguments are not a JSON object", arguments_text=a, id=call_id)
    return ToolCall(fname, value, raw, id=call_id)


def parse_tool_call(text: str, tools: Any = None) -> list[ToolCall]:
    calls: list[ToolCall] = []
    for outer_raw, body in blocks(text, tool_call_start, tool_call_end):
        inner = [(r, b) for r, b in blocks(body, CALL_BEGIN, CALL_END) if b.strip()]
        if not inner:
            calls.append(ToolCall(None, None, outer_raw, error="empty tool call"))
        for raw, call_body in inner:
            calls.append(_one(call_body, outer_raw if len(inner) == 1 else raw))
    return calls
