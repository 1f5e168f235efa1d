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
A call that starts at `<function=` without `<tool_call>` is read too.

Values are bare text; they are typed by the tool's JSON Schema (see _common.coerce: integers,
numbers, booleans, JSON or Python-literal objects and arrays, double-encoded objects, null for
nullable types), so pass `tools` (OpenAI dicts or a ToolRegistry). Without a schema every value
stays a string.
"""
from __future__ import annotations

import re
from typing import Any

from tools.calls import ToolCall, ToolsInfo
from tools.parsers._common import blocks, coerce, json_calls

name = "qwen3_coder"
tool_call_start = "<tool_call>"
tool_call_end = "</tool_call>"

FUNC, PARAM = "<function=", "<parameter="
_TAG = re.compile(r"<tool_call>|</tool_call>|<function=|</function>|<parameter=|</parameter>")
# What may follow the `</parameter>` that really ends a value.
_AFTER_VALUE = re.compile(r"\s*(?:<parameter=|</function>|</tool_call>|<function=|\Z)")
_NAME_END = re.compile(r"[>\n]")


def _value_end(text: str, start: int) -> tuple[int, int]:
    """(end of value, where reading resumes) for a value starting at `start`."""
    depth = 0
    for m in _TAG.finditer(text, start):
        tag = m.group(0)
        if tag == "</parameter>" and depth == 0 and _AFTER_VALUE.match(text, m.end()):
            return m.start(), m.end()
        depth += -1 if tag.startswith("</") else 1
        depth = max(depth, 0)
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
            v = v[len(nl):]
            break
    for nl in ("\r\n", "\n"):
        if v.endswith(nl):
            v = v[:-len(nl)]
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
