"""DeepSeek V3 / R1:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Also accepts V3.1's `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`, and the
variants of the opening marker that R1 and its distills write instead of the real token (as
llama.cpp accepts them): `<｜tool_calls_begin｜>`, `<｜tool calls begin｜>`, `<｜tool\\_calls\\_begin｜>`
and `<｜tool▁calls｜>` (`tool_call_starts`, so the text state machine opens a call at each).
"""

from __future__ import annotations

import json
from typing import Any

from flashmoe.tools.calls import ToolCall
from flashmoe.tools.parsers._common import blocks, strip_fence

name = "deepseek_v3"
tool_call_start = "<｜tool▁calls▁begin｜>"
tool_call_end = "<｜tool▁calls▁end｜>"
call_begin = "<｜tool▁call▁begin｜>"
call_end = "<｜tool▁call▁end｜>"
sep = "<｜tool▁sep｜>"
R1_STARTS = ("<｜tool_calls_begin｜>", "<｜tool calls begin｜>", "<｜tool\\_calls\\_begin｜>", "<｜tool▁calls｜>")
tool_call_starts = (tool_call_start, *R1_STARTS)  # any of them opens a call (tools.textstate)
# V3.1 writes calls inside a reasoning block it never closes (the prompt opened it): a reply that
# ends inside reasoning has its calls read from there (tools.textstate; llama.cpp does the same).
calls_in_open_reasoning = True


def _one(body: str, raw: str) -> ToolCall:
    if sep not in body:
        return ToolCall(None, None, raw, error=f"no {sep} in the tool call")
    kind, _, rest = body.partition(sep)
    kind = kind.strip()
    if kind in ("function", ""):
        fname, _, args = rest.lstrip("\n").partition("\n")
    else:  # V3.1: the name sits before the separator
        fname, args = kind, rest
    fname = fname.strip()
    if not fname:
        return ToolCall(None, None, raw, error="the tool call has no name")
    a = strip_fence(args.strip()).strip()
    if not a:
        return ToolCall(fname, None, raw, arguments_text="")
    try:
        value = json.loads(a)
    except json.JSONDecodeError as e:
        return ToolCall(fname, None, raw, error=f"invalid JSON: {e}", arguments_text=a)
    if not isinstance(value, dict):
        return ToolCall(fname, None, raw, error="the arguments are not a JSON object", arguments_text=a)
    return ToolCall(fname, value, raw)


def parse_tool_call(text: str, tools: Any = None) -> list[ToolCall]:
    calls: list[ToolCall] = []
    for variant in R1_STARTS:
        text = text.replace(variant, tool_call_start)
    for outer_raw, body in blocks(text, tool_call_start, tool_call_end):
        if call_end in body and not body.lstrip().startswith(call_begin):
            # R1 sometimes writes the first call right after the opener, without its own
            # <｜tool▁call▁begin｜> (llama.cpp takes that marker as optional there)
            body = call_begin + body.lstrip()
        inner = blocks(body, call_begin, call_end)
        single = len(inner) == 1
        for raw, call_body in inner:
            if not call_body.strip() and not single:
                continue
            calls.append(_one(call_body, outer_raw if single else raw))
    return calls
