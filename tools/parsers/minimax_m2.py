"""MiniMax M2 / M2.1:

    <minimax:tool_call>
    <invoke name="NAME">
    <parameter name="KEY">VALUE</parameter>
    </invoke>
    </minimax:tool_call>

Several <invoke> blocks may share one tool_call block. Values are bare text typed by the schema."""

from __future__ import annotations

import re
from typing import Any

from flashmoe.tools.calls import ToolCall, ToolsInfo
from flashmoe.tools.parsers._common import blocks, coerce

name = "minimax_m2"
tool_call_start = "<minimax:tool_call>"
tool_call_end = "</minimax:tool_call>"

_INVOKE = re.compile(r"<invoke\s+name=(\"[^\"]*\"|'[^']*'|[^\s>]+)\s*>(.*?)(?:</invoke>|(?=<invoke\s)|\Z)", re.DOTALL)
_PARAM = re.compile(
    r"<parameter\s+name=(\"[^\"]*\"|'[^']*'|[^\s>]+)\s*>(.*?)(?:</parameter>|(?=<parameter\s)|\Z)", re.DOTALL
)


def unquote(s: str) -> str:
    s = s.strip()
    return s[1:-1] if len(s) >= 2 and s[0] == s[-1] and s[0] in "\"'" else s


def xml_calls(
    body: str,
    raw: str,
    info: ToolsInfo,
    invoke: re.Pattern,
    param: re.Pattern,
    value=lambda v: v.strip(),
    untyped: str = "string",
) -> list[ToolCall]:
    """Calls from <invoke name=...><parameter name=...>v</parameter>...</invoke> shaped text."""
    found = list(invoke.finditer(body))
    if not found:
        return [
            ToolCall(
                None,
                None,
                raw,
                error="empty tool call" if not body.strip() else "no <invoke name=...> in the tool call",
            )
        ]
    calls = []
    for m in found:
        fname = unquote(m.group(1))
        call_raw = raw if len(found) == 1 else m.group(0)
        args: dict[str, Any] = {}
        for p in param.finditer(m.group(2)):
            pname = unquote(p.group(1))
            if pname in args:
                calls.append(ToolCall(fname, None, call_raw, error=f"parameter '{pname}' is given twice"))
                break
            args[pname] = coerce(value(p.group(2)), info.property_schema(fname, pname), untyped)
        else:
            calls.append(
                ToolCall(fname, args, call_raw)
                if fname
                else ToolCall(None, None, call_raw, error="the call has no name")
            )
    return calls


def parse_tool_call(text: str, tools: Any = None) -> list[ToolCall]:
    info = ToolsInfo.of(tools)
    out: list[ToolCall] = []
    for raw, body in blocks(text, tool_call_start, tool_call_end):
        out.extend(xml_calls(body, raw, info, _INVOKE, _PARAM))
    return out
