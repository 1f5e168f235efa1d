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

from flashmoe.tools.calls import MAX_ARGUMENT_CHARS, ToolCall, argument_problem
from flashmoe.tools.errors import ToolError
from flashmoe.tools.parsers import (
    deepseek_v3,
    function_gemma,
    gemma4,
    glm47,
    json_tools,
    kimi_k2,
    kimi_k3,
    laguna,
    longcat,
    minicpm5,
    minimax_m2,
    mistral,
    muse_spark,
    plain_json,
    pythonic,
    qwen3_coder,
)

# Every format mlx-lm 0.32's tool_parsers knows, under its names, plus DeepSeek and the fallback.
PARSERS: dict[str, ModuleType] = {
    m.name: m
    for m in (
        json_tools,
        qwen3_coder,
        glm47,
        laguna,
        longcat,
        minimax_m2,
        kimi_k2,
        kimi_k3,
        gemma4,
        function_gemma,
        pythonic,
        minicpm5,
        mistral,
        muse_spark,
        deepseek_v3,
        plain_json,
    )
}
ALIASES = {
    "hermes": "json_tools",
    "qwen3": "json_tools",
    "json": "json_tools",
    "qwen3_5": "qwen3_coder",
    "xml": "qwen3_coder",
    "deepseek": "deepseek_v3",
    "deepseek_r1": "deepseek_v3",
    "deepseek_v31": "deepseek_v3",
    "glm4_moe": "glm47",
    "glm45": "glm47",
    "minimax": "minimax_m2",
    "lfm2": "pythonic",
    "fallback": "plain_json",
}


def get_parser(name: str) -> ModuleType:
    """A parser module by name (or alias), for a config or flag override."""
    key = ALIASES.get(name, name)
    if key not in PARSERS:
        raise ToolError(f"unknown tool-call format {name!r}; use one of {', '.join(PARSERS)}")
    return PARSERS[key]


# (format, markers any one of which picks it), tried in order: mlx-lm's order (tokenizer_utils.
# _infer_tool_parser), which matters (GLM's <arg_key> templates also hold <tool_call>), with
# DeepSeek first. Looser than mlx-lm in two places: <function= with <parameter= picks Qwen3-Coder
# however the template spaces it, and any <tool_call> left over is Hermes JSON (mlx-lm also
# wants "tool_call.name"), since that is what such templates ask for.
_SNIFF: list[tuple[str, tuple[str, ...]]] = [
    ("deepseek_v3", ("tool▁calls▁begin", "tool▁call▁begin")),
    ("minimax_m2", ("<minimax:tool_call>",)),
    ("gemma4", ("<|tool_call>",)),  # with <tool_call|>, checked below
    ("function_gemma", ("<start_function_call>",)),
    ("longcat", ("<longcat_tool_call>",)),
    ("glm47", ("<arg_key>",)),
    ("pythonic", ("<|tool_list_start|>", "<|tool_call_start|>")),
    ("qwen3_coder", ("<tool_call>\\n<function=", "<tool_call>\n<function=")),
    ("kimi_k2", ("<|tool_calls_section_begin|>",)),
    ("minicpm5", ()),  # <function name=" with <param name=", checked below
    ("mistral", ("[TOOL_CALLS]",)),
    ("muse_spark", ("<atem:function_calls>",)),
    ("kimi_k3", ("<|open|>tools<|sep|>",)),
    ("json_tools", ("<tool_call>",)),
]


def sniff_template(chat_template: str | None) -> str | None:
    """The format a chat template renders tool calls in, or None when it shows none."""
    t = chat_template or ""
    for fmt, markers in _SNIFF:
        if fmt == "gemma4" and not ("<|tool_call>" in t and "<tool_call|>" in t):
            continue
        if fmt == "minicpm5":
            if '<function name="' in t and '<param name="' in t:
                return fmt
            continue
        if fmt == "json_tools" and "<function=" in t and "<parameter=" in t:
            return "qwen3_coder"
        if any(m in t for m in markers):
            return fmt
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


def parse_reply(parser: ModuleType, raws: list[str], tools: Any = None) -> list[ToolCall]:
    """The calls of a whole reply: parse_calls for each call block, then, when the reply holds at
    least one call with a name, the blocks that gave no name at all (empty, or nothing a call
    could be read from) are dropped: the model's intent is the named calls, and a stray empty
    `<tool_call></tool_call>` next to them should not cost a repair round. A broken call that
    names a tool is kept, so the model hears what was wrong with it."""
    calls = [c for raw in raws for c in parse_calls(parser, raw, tools)]
    if any(c.name is not None for c in calls):
        calls = [c for c in calls if c.name is not None]
    return calls


def _checked(call: ToolCall) -> ToolCall:
    if call.arguments is None:
        return call
    problem = argument_problem(call.arguments)
    return call if problem is None else dataclasses.replace(call, arguments=None, arguments_text=None, error=problem)
