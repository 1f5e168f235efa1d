"""Gemma 4: `<|tool_call>call:NAME{key:VALUE,...}<tool_call|>`, one or more `call:` in a block.

Values: strings between `<|"|>` delimiters, numbers, true/false/null, [lists] and {objects} with
bare keys. A reader, not a regex, so braces and commas inside strings are just text."""

from __future__ import annotations

import json
import re
from typing import Any

from flashmoe.tools.calls import ToolCall
from flashmoe.tools.parsers._common import blocks

name = "gemma4"
tool_call_start = "<|tool_call>"
tool_call_end = "<tool_call|>"
QUOTE = '<|"|>'

_CALL = re.compile(r"call:([\w.\-]+)\s*\{")
_KEY = re.compile(r"\s*(?:\"([^\"]*)\"|([\w.\-]+))\s*:")
_ATOM = re.compile(r"[^,}\]]*")


class _Reader:
    def __init__(self, text: str, quote: str) -> None:
        self.s, self.q, self.i = text, quote, 0

    def fail(self, what: str) -> ValueError:
        return ValueError(f"{what} at character {self.i}")

    def ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i].isspace():
            self.i += 1

    def value(self) -> Any:
        self.ws()
        s = self.s
        if s.startswith(self.q, self.i):
            end = s.find(self.q, self.i + len(self.q))
            if end < 0:
                raise self.fail("unterminated string")
            v, self.i = s[self.i + len(self.q) : end], end + len(self.q)
            return v
        if s.startswith("{", self.i):
            self.i += 1
            return self.obj()
        if s.startswith("[", self.i):
            self.i += 1
            items: list[Any] = []
            self.ws()
            if s.startswith("]", self.i):
                self.i += 1
                return items
            while True:
                items.append(self.value())
                self.ws()
                if s.startswith(",", self.i):
                    self.i += 1
                elif s.startswith("]", self.i):
                    self.i += 1
                    return items
                else:
                    raise self.fail("expected , or ]")
        m = _ATOM.match(s, self.i)
        atom = m.group(0).strip() if m else ""
        if not atom:
            raise self.fail("expected a value")
        self.i = m.end() if m else self.i
        try:
            return json.loads(atom)
        except json.JSONDecodeError:
            return atom  # a bare word: the model left out the string delimiters

    def obj(self) -> dict[str, Any]:
        """The members of an object whose `{` was just read."""
        out: dict[str, Any] = {}
        self.ws()
        if self.s.startswith("}", self.i):
            self.i += 1
            return out
        while True:
            m = _KEY.match(self.s, self.i)
            if not m:
                raise self.fail("expected key:")
            self.i = m.end()
            out[m.group(1) if m.group(1) is not None else m.group(2)] = self.value()
            self.ws()
            if self.s.startswith(",", self.i):
                self.i += 1
            elif self.s.startswith("}", self.i):
                self.i += 1
                return out
            else:
                raise self.fail("expected , or }")


def brace_calls(body: str, raw: str, quote: str) -> list[ToolCall]:
    """Every call:NAME{...} in body (Gemma 4 and FunctionGemma differ only in the string quote)."""
    found = list(_CALL.finditer(body))
    if not found:
        return [
            ToolCall(
                None,
                None,
                raw,
                error="empty tool call" if not body.strip() else "expected call:NAME{...} in the tool call",
            )
        ]
    calls = []
    pos = 0
    for m in found:
        if m.start() < pos:  # inside the previous call's arguments
            continue
        r = _Reader(body, quote)
        r.i = m.end()
        try:
            args = r.obj()
        except ValueError as e:
            calls.append(ToolCall(m.group(1), None, body[m.start() :], error=f"cannot read the arguments: {e}"))
            break
        pos = r.i
        calls.append(ToolCall(m.group(1), args, body[m.start() : pos]))
    if len(calls) == 1:
        c = calls[0]
        calls = [ToolCall(c.name, c.arguments, raw, c.error)]
    return calls


def parse_tool_call(text: str, tools: Any = None) -> list[ToolCall]:
    out: list[ToolCall] = []
    for raw, body in blocks(text, tool_call_start, tool_call_end):
        out.extend(brace_calls(body, raw, QUOTE))
    return out
