"""Fallback for templates without a tool-call format (Llama 3.x's JSON calls among them): the
whole reply is a JSON object `{"name": ..., "arguments": {...}}` ("parameters" for Llama),
optionally in a ```json fence, or a list of them, or several separated by `;`.

There are no markers; `whole_reply` tells the text state machine to hold back a reply that might
be such an object until it is complete. A reply that is not a call gives no calls: the object
must have an "arguments" (or "parameters") key, and when `tools` is given its name must be one of
them, so a plain JSON answer such as {"name": "Ada"} stays an answer.

Llama 3.x models also write their calls with prose before or after them ("Here is the result:
{...} Would you like to know more?"); vLLM's llama3_json parser and SGLang's Llama 3.2 detector
run those. `find_calls_in_text` reads such calls out of a reply that is not only calls, by the
same rules (a name that is a known tool when tools are given, an arguments object).
"""

from __future__ import annotations

from typing import Any

from flashmoe.tools.calls import ToolCall, ToolsInfo
import json

from flashmoe.tools.parsers._common import _ARGS_KEY, _DECODER, _NAME_KEY, call_from_object, json_calls, strip_fence

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


def find_calls_in_text(text: str, tools: Any = None) -> list[str]:
    """The raw text of each call object in a reply with prose around them (see the docstring)."""
    known = ToolsInfo.of(tools).schemas if tools is not None else None
    out, at = [], text.find("{")
    while at >= 0:
        try:
            value, end = _DECODER.raw_decode(text, at)
        except json.JSONDecodeError:
            at = text.find("{", at + 1)
            continue
        raw = text[at:end]
        call = call_from_object(value, raw) if isinstance(value, dict) else None
        if (
            call is not None
            and call.name is not None
            and call.error is None
            and any(k in value for k in ("arguments", "parameters"))
            and (known is None or call.name in known)
        ):
            out.append(raw)
            at = text.find("{", end)
        else:
            at = text.find("{", at + 1)
    return out
