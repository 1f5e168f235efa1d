"""A streaming state machine over generated text: visible text, reasoning and tool calls.

Feed it text chunks as they arrive; it returns segments in order:

    Segment("text", ...)             visible answer text (incremental)
    Segment("reasoning", ...)        text inside <think>...</think> (incremental, tags removed)
    Segment("tool_call_begin", m)    a tool-call marker opened (a UI can show "calling a tool...")
    Segment("tool_call", raw)        one complete tool-call block, markers included, verbatim

Markers can be split across chunks at any offset: text that could still be the start of a marker
is held back until the next chunk decides it, so no marker ever leaks into the visible text.
Tool-call markers inside reasoning are not calls. With a marker-less format (plain_json), a reply
that may be a bare JSON call is held back until it is complete, then given as text or as a call.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal

from tools.parsers import parse_calls

SegmentKind = Literal["text", "reasoning", "tool_call_begin", "tool_call"]

THINK_START = "<think>"
THINK_END = "</think>"

_TEXT, _REASONING, _TOOL = "text", "reasoning", "tool"
_FENCE_OPEN = re.compile(r"^```[A-Za-z0-9_-]*")


@dataclass(frozen=True)
class Segment:
    kind: SegmentKind
    text: str
    closed: bool = True  # tool_call only: False when the reply ended inside the call


@dataclass
class Reply:
    """A whole reply split up (see split_reply)."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[str] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)


_CALL_KEYS = ("name", "function", "arguments", "parameters", "type", "id")
_FIRST_KEY = re.compile(r"""[\\"']*([A-Za-z_]*)""")


def _maybe_bare_call(s: str) -> bool:
    """Could s (left-stripped, non-empty) still become a reply that is only a JSON call?
    It must open with `{` (or `[{`, optionally in a code fence) and a key a call object has."""
    if "```".startswith(s):
        return True
    m = _FENCE_OPEN.match(s)
    if m:
        s = s[m.end():].lstrip(" \t\r\n")
        if not s:
            return True
    if s[0] == "[":
        s = s[1:].lstrip()
        if not s:
            return True
    if s[0] != "{":
        return False
    s = s[1:].lstrip()
    if not s:
        return True
    k = _FIRST_KEY.match(s)
    assert k is not None
    if k.end() == len(s):  # the first key is still arriving
        return any(name.startswith(k.group(1)) for name in _CALL_KEYS)
    return k.group(1) in _CALL_KEYS


def _complete_with_trailing_text(s: str) -> bool:
    """s starts with a JSON value that is complete and followed by more than whitespace or a fence."""
    body = s
    m = _FENCE_OPEN.match(body)
    if m:
        body = body[m.end():].lstrip(" \t\r\n")
    try:
        _, end = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError:
        return False
    rest = body[end:].strip()
    return bool(rest) and not "```".startswith(rest)


class TextState:
    """Splits streamed text. Give it a parser module (tools.parsers.*) or explicit markers.

    `in_reasoning=True` starts inside reasoning, for templates whose generation prompt already
    opened <think>. `tools` is only used to decide held-back bare JSON replies (plain_json).
    """

    def __init__(self, parser: ModuleType | None = None, *, tool_call_start: str | None = None,
                 tool_call_end: str | None = None, think_start: str | None = THINK_START,
                 think_end: str | None = THINK_END, in_reasoning: bool = False, tools: Any = None) -> None:
        self.parser = parser
        self.tool_start = tool_call_start if tool_call_start is not None else getattr(parser, "tool_call_start", "")
        self.tool_end = tool_call_end if tool_call_end is not None else getattr(parser, "tool_call_end", "")
        self.think_start = think_start or ""
        self.think_end = think_end or ""
        self.tools = tools
        self.state = _REASONING if in_reasoning and self.think_end else _TEXT
        self._buf = ""
        self._tool: list[str] = []
        self._watch = bool(getattr(parser, "whole_reply", False)) and not self.tool_start
        self._held = ""
        self.text = ""
        self.reasoning = ""
        self.tool_calls: list[str] = []
        self.finished = False

    # -- markers -----------------------------------------------------------------------------

    def _markers(self) -> list[str]:
        if self.state == _TEXT:
            ms = [self.think_start, self.think_end, self.tool_start]
        elif self.state == _REASONING:
            ms = [self.think_end]
        else:
            ms = [self.tool_end]
        return [m for m in ms if m]

    @staticmethod
    def _earliest(buf: str, markers: list[str]) -> tuple[int, str]:
        best, best_m = -1, ""
        for m in markers:
            i = buf.find(m)
            if i >= 0 and (best < 0 or i < best or (i == best and len(m) > len(best_m))):
                best, best_m = i, m
        return best, best_m

    @staticmethod
    def _held_suffix(buf: str, markers: list[str]) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a marker."""
        longest = min(len(buf), max(len(m) for m in markers) - 1)
        for k in range(longest, 0, -1):
            tail = buf[-k:]
            if any(m.startswith(tail) for m in markers):
                return k
        return 0

    # -- output ------------------------------------------------------------------------------

    def _emit(self, s: str, out: list[Segment]) -> None:
        if not s:
            return
        if self.state == _REASONING:
            self.reasoning += s
            out.append(Segment("reasoning", s))
        elif self.state == _TOOL:
            self._tool.append(s)
        else:
            self._emit_text(s, out)

    def _emit_text(self, s: str, out: list[Segment]) -> None:
        if self._watch:
            self._held += s
            stripped = self._held.lstrip()
            if not stripped or (_maybe_bare_call(stripped) and not _complete_with_trailing_text(stripped)):
                return
            self._watch = False
            s, self._held = self._held, ""
        self.text += s
        out.append(Segment("text", s))

    def _transition(self, marker: str, out: list[Segment]) -> None:
        if self.state == _TEXT:
            if marker == self.think_start:
                self.state = _REASONING
            elif marker == self.tool_start:
                self.state = _TOOL
                self._tool = [marker]
                out.append(Segment("tool_call_begin", marker))
            # a stray think_end in the answer is dropped
        elif self.state == _REASONING:
            self.state = _TEXT
        else:
            self._tool.append(marker)
            self._close_tool(out, closed=True)

    def _close_tool(self, out: list[Segment], *, closed: bool) -> None:
        raw = "".join(self._tool)
        self._tool = []
        self.state = _TEXT
        self.tool_calls.append(raw)
        out.append(Segment("tool_call", raw, closed))

    # -- API ---------------------------------------------------------------------------------

    def feed(self, chunk: str) -> list[Segment]:
        if self.finished:
            raise RuntimeError("TextState.feed after finish()")
        out: list[Segment] = []
        self._buf += chunk
        while self._buf:
            markers = self._markers()
            if not markers:  # inside a call that runs to the end of the reply
                self._emit(self._buf, out)
                self._buf = ""
                break
            i, m = self._earliest(self._buf, markers)
            if i >= 0:
                self._emit(self._buf[:i], out)
                self._buf = self._buf[i + len(m):]
                self._transition(m, out)
                continue
            keep = self._held_suffix(self._buf, markers)
            self._emit(self._buf[:len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            break
        return out

    def finish(self) -> list[Segment]:
        """End of the reply: flush held text; an unterminated call is given with closed=False
        (closed=True for formats whose calls run to the end of the reply)."""
        if self.finished:
            return []
        out: list[Segment] = []
        buf, self._buf = self._buf, ""
        self._emit(buf, out)
        if self.state == _TOOL:
            self._close_tool(out, closed=not self.tool_end)
        if self._held:
            held, self._held = self._held, ""
            self._watch = False
            calls = parse_calls(self.parser, held, self.tools) if self.parser is not None else []
            if calls:
                self.tool_calls.append(held)
                out.append(Segment("tool_call", held))
            else:
                self.text += held
                out.append(Segment("text", held))
        self.finished = True
        return out


def split_reply(text: str, parser: ModuleType | None = None, **kwargs: Any) -> Reply:
    """Run a whole reply through TextState at once."""
    st = TextState(parser, **kwargs)
    segs = st.feed(text) + st.finish()
    return Reply(st.text, st.reasoning, list(st.tool_calls), segs)
