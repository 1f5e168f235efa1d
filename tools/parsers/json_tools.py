"""Qwen3 / Qwen2.5 / Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

Models also write their calls without the template's `<tool_call>`, in the forms llama.cpp's
Hermes 2 Pro parser reads (tests/test-chat.cpp): in `<tool>`, `<tools>`, `<response>`, `<json>`,
`<xml>`, `<JSON>` or `<function_call>` tags, as `<function=NAME>{args}</function>` or
`<function name="NAME">{args}</function>`, in a ``` fence (```json, ```xml, bare), or as a bare
JSON object after some prose. Those are read only when the reply gave no `<tool_call>`
(`find_calls_in_text`, which the text state machine asks at the end of such a reply), only when
every call names a known tool: a wrapped or fenced form only when it is the whole reply, a bare
object only at the very end of the reply, after prose that holds no other call object, and only
when its arguments fit the tool's schema. A call shown as an example before more text, or in a
fence after prose, stays text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from flashmoe.tools.calls import ToolCall, ToolsInfo
from flashmoe.tools.parsers._common import _DECODER, blocks, json_calls, strip_fence

name = "json_tools"
tool_call_start = "<tool_call>"
tool_call_end = "</tool_call>"
# Low-bit models drop the wrapper: a reply that is only one call object is read as a call (with
# tools to check it against; see tools.textstate).
bare_json_calls = True

_WRAPPER = re.compile(r"\A\s*<(tools?|response|json|xml|JSON|function_call)>\s*(.*?)\s*</\1>\s*\Z", re.DOTALL)
_FUNCTION = re.compile(
    r'<function(?:=([A-Za-z0-9_.:\-]+)|\s+name="([A-Za-z0-9_.:\-]+)")>\s*(.*?)\s*</function>', re.DOTALL
)
_FENCE = re.compile(r"\A\s*```[A-Za-z0-9_-]*[ \t]*\n(.*?)\n?[ \t]*```\s*\Z", re.DOTALL)


def parse_tool_call(text: str, tools: Any = None) -> list[ToolCall]:
    """Every call in `text` (whole tool-call blocks, or the inside of one, or one of the other
    forms above)."""
    if tool_call_start not in text:
        lenient = _lenient(text)
        if lenient is not None:
            return lenient
    calls: list[ToolCall] = []
    for raw, body in blocks(text, tool_call_start, tool_call_end):
        calls.extend(json_calls(body, raw))
    return calls


def _lenient(text: str) -> list[ToolCall] | None:
    """The calls of a block in one of the forms without <tool_call>, or None when it is not one."""
    s = text
    for _ in range(3):  # a fence around a wrapper, a wrapper around a fence
        m = _FENCE.match(s) or _WRAPPER.match(s)
        if m is None:
            break
        s = m.group(m.lastindex)
    found = list(_FUNCTION.finditer(s))
    if found and not _FUNCTION.sub("", s).strip():
        out = []
        for m in found:
            args = m.group(3).strip()
            try:
                value = json.loads(args) if args else {}
            except json.JSONDecodeError as e:
                out.append(
                    ToolCall(
                        m.group(1) or m.group(2), None, m.group(0), error=f"invalid JSON: {e}", arguments_text=args
                    )
                )
                continue
            out.append(
                ToolCall(
                    m.group(1) or m.group(2),
                    value if isinstance(value, dict) else None,
                    m.group(0),
                    error=None if isinstance(value, dict) else "the arguments are not a JSON object",
                    arguments_text=None if isinstance(value, dict) else args,
                )
            )
        return out
    if s is not text:
        return json_calls(s, text)
    return None


def find_calls_in_text(text: str, tools: Any = None) -> list[str]:
    """The calls of a reply that has no <tool_call>, in the forms above: the raw text of the
    block, or [] when the reply is not such a call."""
    known = ToolsInfo.of(tools).schemas if tools is not None else {}
    s = text.strip()
    if not known or not s:
        return []
    calls = _lenient(s)
    if calls is not None:  # the whole reply is a wrapped, fenced or <function...> form
        ok = calls and all(c.name in known and c.error is None for c in calls)
        return [text] if ok else []
    # a bare call object that ends the reply, after prose holding no other call object
    at = s.rfind("{")
    while at > 0:
        try:
            value, end = _DECODER.raw_decode(s, at)
        except json.JSONDecodeError:
            value, end = None, -1
        if end == len(s) and isinstance(value, dict):
            (call,) = json_calls(s[at:], s[at:])[:1] or [None]
            if (
                call is not None
                and call.name in known
                and _fits(call, known[call.name])
                and not _has_call_object(s[:at])
            ):
                return [s[at:]]
            return []
        at = s.rfind("{", 0, at)
    return []


def _has_call_object(prose: str) -> bool:
    at = prose.find("{")
    while at >= 0:
        try:
            value, _ = _DECODER.raw_decode(prose, at)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict) and "name" in value:
            return True
        at = prose.find("{", at + 1)
    return False


def _fits(call: ToolCall, schema: dict) -> bool:
    if not isinstance(call.arguments, dict):
        return False
    from flashmoe.tools.safe_schema import is_valid

    return is_valid(schema, call.arguments)  # (False for a schema it cannot take: no intent to be sure of)


__all__ = ["parse_tool_call", "find_calls_in_text", "strip_fence"]
