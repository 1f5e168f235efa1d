"""Qwen3.5 / Qwen3-Coder XML calls:

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

The reading is structure-aware: a value may itself hold `</parameter>`, `</function>` or a whole
`<tool_call>` (a file whose content shows a tool call): tags nest, and a `</parameter>` only ends
a value at nesting depth 0 when the next thing is another parameter or the end of the function.
A call that starts at `<function=` without `<tool_call>` is read too (`tool_call_starts` tells the
text state machine to open a call at either), and `find_call_end` tells it where a streamed call
ends by the same structure, so a `</tool_call>` inside a value does not end the call.

Values are bare text; they are typed by the tool's JSON Schema (see _common.coerce: integers,
numbers, booleans, JSON or Python-literal objects and arrays, double-encoded objects, null for
nullable types), so pass `tools` (OpenAI dicts or a ToolRegistry). Without a schema every value
stays a string.
"""

from __future__ import annotations

import re
from typing import Any

from flashmoe.tools.calls import ToolCall, ToolsInfo
from flashmoe.tools.parsers._common import blocks, coerce, json_calls

name = "qwen3_coder"
tool_call_start = "<tool_call>"
tool_call_end = "</tool_call>"
tool_call_starts = (tool_call_start, "<function=")
call_end_tags = (tool_call_end, "</function>")  # the tags after which find_call_end may find an end

FUNC, PARAM = "<function=", "<parameter="
_TAG = re.compile(r"<tool_call>|</tool_call>|<function=|</function>|<parameter=|</parameter>")
# What may follow the `</parameter>` that really ends a value.
_AFTER_VALUE = re.compile(r"\s*(?:<parameter=|</function>|</tool_call>|<function=|\Z)")
_NAME_END = re.compile(r"[>\n]")


def _value_end(text: str, start: int, balanced: bool = False) -> tuple[int, int]:
    """(end of value, where reading resumes) for a value starting at `start`. `balanced`: only a
    balanced close counts ((-1, -1) without one: a streamed value may still be arriving)."""
    depth = 0
    for m in _TAG.finditer(text, start):
        tag = m.group(0)
        if tag == "</parameter>" and depth == 0 and _AFTER_VALUE.match(text, m.end()):
            return m.start(), m.end()
        depth += -1 if tag.startswith("</") else 1
        depth = max(depth, 0)
    if balanced:
        return -1, -1
    # No balanced close: the value ends at the first tag that cannot be part of it (a cut-off
    # reply, or a model that left out </parameter>).
    m = re.compile(r"</parameter>|<parameter=|</function>|</tool_call>").search(text, start)
    if m is None:
        return len(text), len(text)
    return m.start(), m.end() if m.group(0) == "</parameter>" else m.start()


def _strip_newlines(v: str) -> str:
    # The template writes "\n" after the opening tag and before the closing one.
    for nl in ("\r\n", "\n"):
        if v.startswith(nl):
            v = v[len(nl) :]
            break
    for nl in ("\r\n", "\n"):
        if v.endswith(nl):
            v = v[: -len(nl)]
            break
    return v


def _read_name(text: str, pos: int) -> tuple[str, int]:
    m = _NAME_END.search(text, pos)
    end = m.start() if m else len(text)
    return text[pos:end].strip(), (end + 1 if m and m.group(0) == ">" else end)


def _function(text: str, start: int, info: ToolsInfo) -> tuple[ToolCall, int]:
    """The call whose `<function=` is at `start`, and where it ends."""
    fname, pos = _read_name(text, start + len(FUNC))
    args: dict[str, Any] = {}
    dup = None
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if text.startswith(PARAM, pos):
            pname, vstart = _read_name(text, pos + len(PARAM))
            vend, pos = _value_end(text, vstart)
            if pname in args:
                dup = pname
            args[pname] = coerce(_strip_newlines(text[vstart:vend]), info.property_schema(fname, pname))
            continue
        if text.startswith("</function>", pos):
            pos += len("</function>")
        break  # </tool_call>, the next <function=, stray text or the end: the function is over
    raw = text[start:pos]
    if not fname or not re.fullmatch(r"[\w.\-]+", fname):
        return ToolCall(None, None, raw, error=f"<function={fname[:40]}> is not a tool name"), pos
    if dup is not None:
        return ToolCall(fname, None, raw, error=f"parameter '{dup}' is given twice"), pos
    return ToolCall(fname, args, raw), pos


def parse_tool_call(text: str, tools: Any = None) -> list[ToolCall]:
    info = ToolsInfo.of(tools)
    if FUNC not in text:
        calls: list[ToolCall] = []
        for raw, body in blocks(text, tool_call_start, tool_call_end):
            if body.strip().startswith(("{", "[", "```")):  # the model fell back to Hermes JSON
                calls.extend(json_calls(body, raw))
            else:
                calls.append(ToolCall(None, None, raw, error="no <function=NAME> block in the tool call"))
        return calls
    calls = []
    pos = text.find(FUNC)
    while pos >= 0:
        call, end = _function(text, pos, info)
        calls.append(call)
        pos = text.find(FUNC, end)
    if len(calls) == 1:  # one call: its raw is the whole block, markers included
        c = calls[0]
        calls = [ToolCall(c.name, c.arguments, text, c.error, c.arguments_text, c.id)]
    return calls


_NEXT = (PARAM, "</function>", tool_call_end, FUNC)


def find_call_end(text: str, start: str = tool_call_start, final: bool = False) -> int:
    """Where a call that `start` opened ends in `text` (what follows that marker): the offset just
    past its closing marker, read with parse_tool_call's structure (a `</tool_call>` inside a value
    is part of the value). -1 while the call may still be going on; with `final` (the reply is
    over) a value without a balanced close ends as parse_tool_call reads it, and -1 means the call
    runs to the end of the reply unclosed.

    A call opened by `<tool_call>` ends at the `</tool_call>` after its functions (the first one
    when it holds Hermes JSON instead); one opened by a bare `<function=` ends after its
    `</function>`, taking a `</tool_call>` right after it along."""
    bare = start == FUNC
    n = len(text)

    def ws(p: int) -> int:
        while p < n and text[p].isspace():
            p += 1
        return p

    def partial(p: int) -> bool:  # the text from p may still become one of the tags read next
        return not final and any(t.startswith(text[p:]) for t in _NEXT)

    if bare:
        pos = 0
    else:
        pos = ws(0)
        if not text.startswith(FUNC, pos):
            if not final and FUNC.startswith(text[pos:]):
                return -1
            j = text.find(tool_call_end, pos)  # Hermes JSON (or junk): the first close ends it
            return j + len(tool_call_end) if j >= 0 else -1
        pos += len(FUNC)
    while True:  # a function whose name starts at pos
        m = _NAME_END.search(text, pos)
        if m is None:
            return -1
        pos = m.end() if m.group(0) == ">" else m.start()
        closed = False
        while True:
            pos = ws(pos)
            if text.startswith(PARAM, pos):
                m = _NAME_END.search(text, pos + len(PARAM))
                if m is None:
                    return -1
                vstart = m.end() if m.group(0) == ">" else m.start()
                _, pos = _value_end(text, vstart, balanced=not final)
                if pos < 0:
                    return -1
                continue
            if partial(pos) and not text.startswith(_NEXT, pos):
                return -1
            if text.startswith("</function>", pos):
                pos += len("</function>")
                closed = True
            break
        if bare:
            j = ws(pos)
            if text.startswith(tool_call_end, j):
                return j + len(tool_call_end)
            if closed and not final and tool_call_end.startswith(text[j:]):
                return -1
            return pos if closed or pos < n else -1
        j = text.find(tool_call_end, pos)
        f = text.find(FUNC, pos)
        if f >= 0 and (j < 0 or f < j):
            pos = f + len(FUNC)
            continue
        return j + len(tool_call_end) if j >= 0 else -1
