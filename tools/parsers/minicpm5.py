"""OpenBMB MiniCPM5: `<function name="NAME"><param name="KEY">VALUE</param></function>`, one
block per call and no outer wrapper; values holding <, & or newlines come in <![CDATA[...]]>."""

from __future__ import annotations

import re
from typing import Any

from flashmoe.tools.calls import ToolCall, ToolsInfo
from flashmoe.tools.parsers._common import blocks
from flashmoe.tools.parsers.minimax_m2 import xml_calls

name = "minicpm5"
tool_call_start = "<function name="
tool_call_end = "</function>"

_FUNC = re.compile(r"<function\s+name=(\"[^\"]*\"|'[^']*'|[^\s>]+)\s*>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAM = re.compile(r"<param\s+name=(\"[^\"]*\"|'[^']*'|[^\s>]+)\s*>(.*?)(?:</param>|\Z)", re.DOTALL)
_CDATA = re.compile(r"^\s*<!\[CDATA\[(.*?)\]\]>\s*$", re.DOTALL)


def _value(v: str) -> str:
    m = _CDATA.match(v)
    return m.group(1) if m else v.strip()


def parse_tool_call(text: str, tools: Any = None) -> list[ToolCall]:
    info = ToolsInfo.of(tools)
    if "<function" not in text:  # the inside of a block: put the start marker back
        text = tool_call_start + text
    out: list[ToolCall] = []
    for raw, _ in blocks(text, tool_call_start, tool_call_end):
        out.extend(xml_calls(raw, raw, info, _FUNC, _PARAM, _value))
    return out
