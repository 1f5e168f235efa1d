"""Muse Spark (XML_ATEM):

    <atem:function_calls>
    <atem:invoke name="NAME"><atem:parameter name="KEY">VALUE</atem:parameter></atem:invoke>
    </atem:function_calls>

Values are JSON when they decode as JSON (the template writes non-strings that way)."""

from __future__ import annotations

import re
from typing import Any

from flashmoe.tools.calls import ToolCall, ToolsInfo
from flashmoe.tools.parsers._common import blocks
from flashmoe.tools.parsers.minimax_m2 import xml_calls

name = "muse_spark"
tool_call_start = "<atem:function_calls>"
tool_call_end = "</atem:function_calls>"

_INVOKE = re.compile(r"<atem:invoke\b[^>]*?\bname=(\"[^\"]*\")[^>]*>(.*?)(?:</atem:invoke>|\Z)", re.DOTALL)
_PARAM = re.compile(r"<atem:parameter\b[^>]*?\bname=(\"[^\"]*\")[^>]*>(.*?)</atem:parameter>", re.DOTALL)


def parse_tool_call(text: str, tools: Any = None) -> list[ToolCall]:
    info = ToolsInfo.of(tools)
    out: list[ToolCall] = []
    for raw, body in blocks(text, tool_call_start, tool_call_end):
        out.extend(xml_calls(body, raw, info, _INVOKE, _PARAM, untyped="guess"))
    return out
