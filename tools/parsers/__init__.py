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
