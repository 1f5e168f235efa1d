"""A JSON tool call's name and arguments, read from the call's text while it is being written, so a
server can stream them (OpenAI's tool_calls deltas, Anthropic's input_json_delta, the Responses
API's function_call_arguments.delta) before the call is complete.

Only the layout the tool-call grammar writes is read (`{"name": NAME, "arguments": {...}}`, the
Hermes / Qwen3 form, tools/grammar.py); anything else is left to the parse of the whole call. The
arguments are given verbatim up to the brace that closes them, never past it.
"""

from __future__ import annotations

import re

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.:\-]{1,128})"\s*,\s*"arguments"\s*:\s*')


class JsonCallStream:
    """Feed it the call's text so far (`update`); it says the name once the arguments begin, then
    each new piece of the arguments object. `failed` when the text does not have that layout."""

    def __init__(self, opener: str):
        self.opener = opener
        self.name: str | None = None
        self.failed = False
        self.complete = False  # the arguments' closing brace has been given
        self._at = -1  # where the arguments start in the body
        self._scanned = 0  # how much of the arguments has been read (and given)
        self._depth = 0
        self._in_string = False
        self._escape = False

    def update(self, text: str) -> tuple[str | None, str]:
        """(the name, when it is known for the first time; else None), and the new argument text."""
        if self.failed or self.complete or not text.startswith(self.opener):
            return None, ""
        body = text[len(self.opener) :]
        named = None
        if self.name is None:
            m = _HEAD.match(body)
            if m is None:
                # still arriving, or another layout: a head longer than any name allows is not ours
                self.failed = len(body) > 200 or (bool(body.strip()) and not body.lstrip().startswith("{"))
                return None, ""
            if m.end() == len(body):
                return None, ""  # the arguments' first character decides
            if body[m.end()] != "{":
                self.failed = True
                return None, ""
            self.name, self._at = m.group(1), m.end()
            named = self.name
        args = body[self._at :]
        start = self._scanned
        for i in range(start, len(args)):
            ch = args[i]
            if self._escape:
                self._escape = False
            elif self._in_string:
                if ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._scanned = i + 1
                    self.complete = True
                    return named, args[start : i + 1]
        self._scanned = len(args)
        return named, args[start:]
