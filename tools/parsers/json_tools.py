"""Qwen3 / Qwen2.5 / Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`."""
from __future__ import annotations

from typing import Any

from flashmoe.tools.calls import ToolCall
from flashmoe.tools.parsers._common import blocks, json_calls

name = "json_tools"
tool_call_start = "<tool_call>"
tool_call_end = "</tool_call>"
# Low-bit models drop the wrapper: a reply that is only one call object is read as a call (with
# tools to check it against; see tools.textstate).
bare_json_calls = True


def parse_tool_call(text: str, tools: Any = None) -> list[ToolCall]:
    """Every call in `text` (whole tool-call blocks, or the inside of one)."""
    calls: list[ToolCall] = []
    for raw, body in blocks(text, tool_call_start, tool_call_end):
        calls.extend(json_calls(body, raw))
    return calls
