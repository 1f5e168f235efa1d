"""Fallback for templates without a tool-call format: the whole reply is a JSON object
`{"name": ..., "arguments": {...}}` (optionally in a ```json fence), or a list of them.

There are no markers; `whole_reply` tells the text state machine to hold back a reply that might
be such an object until it is complete. A reply that is not a call gives no calls: the object
must have an "arguments" (or "parameters") key, and when `tools` is given its name must be one of
them, so a plain JSON answer such as {"name": "Ada"} stays an answer.
"""
from __future__ import annotations

from typing import Any

from flashmoe.tools.calls import ToolCall, ToolsInfo
from flashmoe.tools.parsers._common import _ARGS_KEY, _NAME_KEY, json_calls, strip_fence

name = "plain_json"
tool_call_start = ""
tool_call_end = ""
whole_reply = True


def parse_tool_call(text: str, tools: Any = None) -> list[ToolCall]:
    s = strip_fence(text.strip()).strip()
    if not s.startswith(("{", "[")) or not _NAME_KEY.search(s) or not _ARGS_KEY.search(s):
        return []
    known = ToolsInfo.of(tools).schemas if tools is not None else None
    calls = json_calls(s, text)
    if any(c.name is None or (known is not None and c.name not in known) for c in calls):
        return []
    return calls
