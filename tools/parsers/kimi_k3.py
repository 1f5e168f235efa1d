"""Kimi K3 (XTML):

    <|open|>tools<|sep|>
    <|open|>call tool="NAME" index="1"<|sep|>
    <|open|>argument key="KEY" type="string"<|sep|>VALUE<|close|>argument<|sep|>
    <|close|>call<|sep|>
    <|close|>tools<|sep|>

or the arguments as one `<|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>` block.
A typed argument whose type is not "string" is JSON."""

from __future__ import annotations

import json
import re
from typing import Any

from flashmoe.tools.calls import ToolCall
from flashmoe.tools.parsers._common import blocks

name = "kimi_k3"
tool_call_start = "<|open|>tools<|sep|>"
tool_call_end = "<|close|>tools<|sep|>"

_CALL = re.compile(r"<\|open\|>call((?:(?!<\|sep\|>).)*)<\|sep\|>(.*?)(?:<\|close\|>call<\|sep\|>|\Z)", re.DOTALL)
_ARG = re.compile(r"<\|open\|>argument((?:(?!<\|sep\|>).)*)<\|sep\|>(.*?)<\|close\|>argument<\|sep\|>", re.DOTALL)
_JSON = re.compile(r"<\|open\|>json(?:(?!<\|sep\|>).)*<\|sep\|>(.*?)<\|close\|>json<\|sep\|>", re.DOTALL)
_ATTR = re.compile(r'(\w+)="([^"]*)"')


def _attrs(s: str) -> dict[str, str]:
    return {k: v.replace("&quot;", '"').replace("&amp;", "&") for k, v in _ATTR.findall(s)}


def _one(attrs: str, body: str, raw: str) -> ToolCall:
    fname = _attrs(attrs).get("tool")
    if not fname:
        return ToolCall(None, None, raw, error='the call has no tool="NAME"')
    j = _JSON.search(body)
    if j:
        return ToolCall(fname, None, raw, arguments_text=j.group(1))  # validation decodes it
    args: dict[str, Any] = {}
    for m in _ARG.finditer(body):
        a = _attrs(m.group(1))
        key, value = a.get("key"), m.group(2)
        if key is None:
            return ToolCall(fname, None, raw, error="an argument has no key")
        if a.get("type", "string") != "string":
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass  # left as text: validation names the type mismatch
        args[key] = value
    return ToolCall(fname, args, raw)


def parse_tool_call(text: str, tools: Any = None) -> list[ToolCall]:
    calls: list[ToolCall] = []
    for outer_raw, body in blocks(text, tool_call_start, tool_call_end):
        found = list(_CALL.finditer(body))
        if not found:
            calls.append(ToolCall(None, None, outer_raw, error="no <|open|>call in the tool call"))
        for m in found:
            calls.append(_one(m.group(1), m.group(2), outer_raw if len(found) == 1 else m.group(0)))
    return calls
