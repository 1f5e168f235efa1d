"""Tool-call formats, one module each, with the same surface (the mlx-lm convention):

    name              the format's name
    tool_call_start   the marker that opens a call ("" when there is none)
    tool_call_end     the marker that closes it ("" when the call runs to the end of the reply)
    parse_tool_call(text, tools=None) -> list[ToolCall]

`text` is a whole call block, markers included (as the text state machine hands it over), or just
the inside of one. `tools` (OpenAI tool dicts or a ToolRegistry) lets formats with untyped values
coerce them by schema.
"""
from __future__ import annotations

from types import ModuleType

import dataclasses
import re
from typing import Any

from tools.calls import MAX_ARGUMENT_CHARS, ToolCall, argument_problem
from tools.errors import ToolError
from tools.parsers import deepseek_v3, json_tools, mistral, plain_json, qwen3_coder

PARSERS: dict[str, ModuleType] = {
    "json_tools": json_tools,
    "qwen3_coder": qwen3_coder,
    "mistral": mistral,
    "deepseek_v3": deepseek_v3,
    "plain_json": plain_json,
}
ALIASES = {"hermes": "json_tools", "qwen3": "json_tools", "json": "json_tools", "qwen3_5": "qwen3_coder",
           "xml": "qwen3_coder", "deepseek": "deepseek_v3", "fallback": "plain_json"}


def get_parser(name: str) -> ModuleType:
    """A parser module by name (or alias), for a config or flag override."""
    key = ALIASES.get(name, name)
    if key not in PARSERS:
        raise ToolError(f"unknown tool-call format {name!r}; use one of {', '.join(PARSERS)}")
    return PARSERS[key]


def sniff_template(chat_template: str | None) -> str | None:
    """The format a chat template renders tool calls in, or None when it shows none."""
    t = chat_template or ""
    if "tool▁calls▁begin" in t or "tool▁call▁begin" in t:
        return "deepseek_v3"
    if "<function=" in t and ("<parameter=" in t or "<tool_call>" in t):
        return "qwen3_coder"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<tool_call>" in t:
        return "json_tools"
    return None


def parser_for_template(chat_template: str | None, fallback: ModuleType = plain_json) -> ModuleType:
    """The parser module for the format a chat template uses, or `fallback` (plain JSON replies)."""
    found = sniff_template(chat_template)
    return PARSERS[found] if found else fallback


_NAME = re.compile(r"""["'\\]*name["'\\]*\s*[:=]\s*["'\\]*([A-Za-z0-9_.\-]{1,64})|<function=([A-Za-z0-9_.\-]{1,64})""")


def parse_calls(parser: ModuleType, text: str, tools: Any = None) -> list[ToolCall]:
    """parser.parse_tool_call, made safe for whatever a model writes: a call the decoder cannot
    take (nesting that exhausts the recursion limit, a 5,000-digit number, too much text) or
    whose arguments are junk (see argument_problem) comes back as a call with an error, which
    validation turns into a message and a repair round."""
    problem: str | None = None
    if len(text) > 4 * MAX_ARGUMENT_CHARS:
        problem = f"the tool call is longer than {4 * MAX_ARGUMENT_CHARS:,} characters"
    else:
        try:
            calls = parser.parse_tool_call(text, tools)
        except RecursionError:
            problem = "the arguments nest too deeply to decode"
        except (ValueError, MemoryError, OverflowError) as e:  # int digits limit, huge floats
            problem = f"the arguments cannot be decoded: {str(e)[:120]}"
        else:
            return [_checked(c) for c in calls]
    m = _NAME.search(text[:4096])
    name = (m.group(1) or m.group(2)) if m else None
    return [ToolCall(name, None, text, error=problem)]


def _checked(call: ToolCall) -> ToolCall:
    if call.arguments is None:
        return call
    problem = argument_problem(call.arguments)
    return call if problem is None else dataclasses.replace(call, arguments=None, arguments_text=None, error=problem)
