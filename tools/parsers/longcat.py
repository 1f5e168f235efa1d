"""Meituan LongCat: GLM's key/value calls with their own tags,

    <longcat_tool_call>NAME
    <longcat_arg_key>KEY</longcat_arg_key>
    <longcat_arg_value>VALUE</longcat_arg_value>
    </longcat_tool_call>

or a JSON call object inside the tags."""

from __future__ import annotations

from typing import Any

from flashmoe.tools.calls import ToolCall, ToolsInfo
from flashmoe.tools.parsers._common import blocks
from flashmoe.tools.parsers.glm47 import kv_call

name = "longcat"
tool_call_start = "<longcat_tool_call>"
tool_call_end = "</longcat_tool_call>"


def parse_tool_call(text: str, tools: Any = None) -> list[ToolCall]:
    info = ToolsInfo.of(tools)
    return [
        kv_call(body, raw, info, "longcat_arg_key", "longcat_arg_value")
        for raw, body in blocks(text, tool_call_start, tool_call_end)
    ]
