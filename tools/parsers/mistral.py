"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (older models) or
`[TOOL_CALLS]NAME[ARGS]{...}` repeated once per call (newer ones; `[CALL_ID]id` may sit before
`[ARGS]`), or `[TOOL_CALLS]NAME{...}` where the tokenizer drops the `[ARGS]` control token as it
detokenises (vLLM's v11 tests: Mistral Small 3.2, Devstral, Magistral). There is no end marker:
the calls run to the end of the reply. A call list after some junk is read from its first
`[{` (vLLM's fallback for the older form)."""

from __future__ import annotations

import json
import re
from typing import Any

from flashmoe.tools.calls import ToolCall
from flashmoe.tools.parsers._common import _DECODER, json_calls

name = "mistral"
tool_call_start = "[TOOL_CALLS]"
tool_call_end = ""


def _new_style(seg: str, raw: str) -> ToolCall:
    head, _, args = seg.partition("[ARGS]")
    call_id = None
    if "[CALL_ID]" in head:
        head, _, call_id = head.partition("[CALL_ID]")
        call_id = call_id.strip() or None
    fname = head.strip()
    if not fname:
        return ToolCall(None, None, raw, error="no tool name before [ARGS]")
    a = args.strip()
    if not a:
        return ToolCall(fname, None, raw, arguments_text="", id=call_id)
    try:
        value, end = _DECODER.raw_decode(a)
    except json.JSONDecodeError as e:
        return ToolCall(fname, None, raw, error=f"invalid JSON: {e}", arguments_text=a, id=call_id)
    if not isinstance(value, dict):
        return ToolCall(fname, None, raw, error="the arguments are not a JSON object", arguments_text=a, id=call_id)
    return ToolCall(fname, value, raw, id=call_id)


_NAME_THEN_ARGS = re.compile(r"\A([A-Za-z_][A-Za-z0-9_.\-]{0,127})\s*(?=\{)")
_LIST_START = re.compile(r"\[\s*\{")


def parse_tool_call(text: str, tools: Any = None) -> list[ToolCall]:
    if tool_call_start in text:
        pieces = text.split(tool_call_start)
        segs = [(tool_call_start + p, p) for p in pieces[1:]]
    else:
        segs = [(text, text)]
    calls: list[ToolCall] = []
    for raw, seg in segs:
        s = seg.strip()
        if not s:
            continue
        if s.startswith(("[", "{", "```")):
            calls.extend(json_calls(s, raw))
        elif "[ARGS]" in s:
            calls.append(_new_style(s, raw))
        elif _NAME_THEN_ARGS.match(s):  # NAME{...}: the [ARGS] token dropped
            m = _NAME_THEN_ARGS.match(s)
            calls.append(_new_style(f"{m.group(1)}[ARGS]{s[m.end() :]}", raw))
        elif _LIST_START.search(s):  # junk, then the call list
            calls.extend(json_calls(s[_LIST_START.search(s).start() :], raw))
        else:
            calls.append(
                ToolCall(None, None, raw, error="expected a JSON list of calls or NAME[ARGS]{...} after [TOOL_CALLS]")
            )
    if not calls:
        calls.append(ToolCall(None, None, text, error="empty tool call"))
    return calls
