"""FunctionGemma: `<start_function_call>call:NAME{key:<escape>text<escape>,n:1}<end_function_call>`,
Gemma 4's call syntax with `<escape>` as the string quote."""

from __future__ import annotations

from typing import Any

from flashmoe.tools.calls import ToolCall
from flashmoe.tools.parsers._common import blocks
from flashmoe.tools.parsers.gemma4 import brace_calls

name = "function_gemma"
tool_call_start = "<start_function_call>"
tool_call_end = "<end_function_call>"


def parse_tool_call(text: str, tools: Any = None) -> list[ToolCall]:
    out: list[ToolCall] = []
    for raw, body in blocks(text, tool_call_start, tool_call_end):
        out.extend(brace_calls(body, raw, "<escape>"))
    return out
