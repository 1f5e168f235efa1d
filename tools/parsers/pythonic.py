"""Pythonic calls (LFM2, Llama 4 style): `<|tool_call_start|>[NAME(key="v", n=2), OTHER()]<|tool_call_end|>`.

Read with Python's own parser (never evaluated): keyword arguments only, literal values, with
JSON's true/false/null accepted since templates render nested values as JSON."""

from __future__ import annotations

import ast
from typing import Any

from flashmoe.tools.calls import ToolCall
from flashmoe.tools.parsers._common import blocks, literal

name = "pythonic"
tool_call_start = "<|tool_call_start|>"
tool_call_end = "<|tool_call_end|>"


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        parent = _dotted(node.value)
        return f"{parent}.{node.attr}" if parent else None
    return None


def _call(node: ast.expr, src: str, raw: str) -> ToolCall:
    seg = ast.get_source_segment(src, node) or raw
    if not isinstance(node, ast.Call) or _dotted(node.func) is None:
        return ToolCall(None, None, seg, error="expected NAME(key=value, ...)")
    fname = _dotted(node.func)
    if node.args or any(k.arg is None for k in node.keywords):
        return ToolCall(fname, None, seg, error="arguments must be given as key=value")
    args: dict[str, Any] = {}
    for k in node.keywords:
        text = ast.get_source_segment(src, k.value) or ""
        try:
            args[str(k.arg)] = literal(text)
        except ValueError:
            return ToolCall(fname, None, seg, error=f"the value of '{k.arg}' is not a literal: {text[:60]}")
    return ToolCall(fname, args, seg)


def parse_tool_call(text: str, tools: Any = None) -> list[ToolCall]:
    out: list[ToolCall] = []
    for raw, body in blocks(text, tool_call_start, tool_call_end):
        src = body.strip()
        if not src:
            out.append(ToolCall(None, None, raw, error="empty tool call"))
            continue
        try:
            tree = ast.parse(src, mode="eval").body
        except SyntaxError as e:
            out.append(ToolCall(None, None, raw, error=f"not a Python call list: {e.msg}"))
            continue
        nodes = tree.elts if isinstance(tree, (ast.List, ast.Tuple)) else [tree]
        calls = [_call(n, src, raw) for n in nodes]
        if len(calls) == 1:
            c = calls[0]
            calls = [ToolCall(c.name, c.arguments, raw, c.error)]
        out.extend(calls or [ToolCall(None, None, raw, error="empty tool call")])
    return out
