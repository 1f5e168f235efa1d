"""A streaming state machine over generated text: visible text, reasoning and tool calls.

Feed it text chunks as they arrive; it returns segments in order:

    Segment("text", ...)             visible answer text (incremental)
    Segment("reasoning", ...)        text inside <think>...</think>, [THINK]...[/THINK] or another
                                     pair of engine.reasoning.REASONING_MARKERS (incremental,
                                     markers removed)
    Segment("tool_call_begin", m)    a tool-call marker opened (a UI can show "calling a tool...")
    Segment("tool_call", raw)        one complete tool-call block, markers included, verbatim

Markers can be split across chunks at any offset: text that could still be the start of a marker
is held back until the next chunk decides it, so no marker ever leaks into the visible text.
Tool-call markers inside reasoning are not calls, and neither are those inside a fenced Markdown
code block of the answer (a call shown as an example): a fence is a line that starts (after at most
three spaces) with three or more backticks or tildes, closed by a line starting with as many of the
same. The state can start inside reasoning (`in_reasoning`), for templates whose generation prompt
opened the block; `ended_in_reasoning` says a reply was cut off before it closed it. With a
marker-less format (plain_json), a reply that may be a bare JSON call is held back until it is
complete, then given as text or as a call.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal

from engine.reasoning import REASONING_MARKERS
from tools.parsers import parse_calls

SegmentKind = Literal["text", "reasoning", "tool_call_begin", "tool_call"]

THINK_START = "<think>"
THINK_END = "</think>"

_TEXT, _REASONING, _TOOL = "text", "reasoning", "tool"
_FENCES = ("```", "~~~")
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

    `in_reasoning` starts inside reasoning, for templates whose generation prompt already opened
    the block: True (the first pair: <think>), or the opening marker the prompt ended with
    (engine.reasoning.open_reasoning), which picks the closing one. `think_pairs` are the reasoning
    marker pairs recognised (default: all of REASONING_MARKERS; `think_start` / `think_end` put
    one pair first). `tools` is only used to decide held-back bare JSON replies (plain_json).
    """

    def __init__(self, parser: ModuleType | None = None, *, tool_call_start: str | None = None,
                 tool_call_end: str | None = None, think_start: str | None = THINK_START,
                 think_end: str | None = THINK_END, in_reasoning: bool | str = False, tools: Any = None,
                 think_pairs: tuple[tuple[str, str], ...] | None = None) -> None:
        self.parser = parser
        self.tool_start = tool_call_start if tool_call_start is not None else getattr(parser, "tool_call_start", "")
        self.tool_end = tool_call_end if tool_call_end is not None else getattr(parser, "tool_call_end", "")
        pairs = list(think_pairs if think_pairs is not None else REASONING_MARKERS)
        if think_start and think_end:
            pairs = [(think_start, think_end)] + [p for p in pairs if p != (think_start, think_end)]
        self.think_pairs = [(a, b) for a, b in pairs if a and b]
        self._closer = dict(self.think_pairs)
        self.think_start, self.think_end = self.think_pairs[0] if self.think_pairs else ("", "")
        self.tools = tools
        self.state = _TEXT
        self._think_end = ""  # the marker that closes the reasoning block we are in
        if in_reasoning:
            opener = self.think_start if in_reasoning is True else str(in_reasoning)
            if self._closer.get(opener):
                self.state, self._think_end = _REASONING, self._closer[opener]
        self._buf = ""
        self._tool: list[str] = []
        self._watch = bool(getattr(parser, "whole_reply", False)) and not self.tool_start
        self._held = ""
        # Fenced code blocks matter where a marker opens a call (not for bare JSON replies).
        self._fences = _FENCES if self.tool_start else ()
        self._fence = ""  # the fence we are inside ("" outside): its character times its length
        self._indent: int | None = 0  # blanks since the line started; None once it has other text
        self.text = ""
        self.reasoning = ""
        self.tool_calls: list[str] = []
        self.finished = False
        self.ended_in_reasoning = False  # finish(): the reply stopped before closing its reasoning

    @property
    def in_reasoning(self) -> bool:
        return self.state == _REASONING

    # -- markers -----------------------------------------------------------------------------

    def _markers(self) -> list[str]:
        if self.state == _TEXT:
            if self._fence:
                return [self._fence[0] * 3]
            ms = [m for pair in self.think_pairs for m in pair] + [self.tool_start, *self._fences]
        elif self.state == _REASONING:
            ms = [self._think_end]
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
        self._track_line(s)
        if self._watch:
            self._held += s
            stripped = self._held.lstrip()
            if not stripped or (_maybe_bare_call(stripped) and not _complete_with_trailing_text(stripped)):
                return
            self._watch = False
            s, self._held = self._held, ""
        self.text += s
        out.append(Segment("text", s))

    def _track_line(self, s: str) -> None:
        """Where the current line stands: only blanks so far (how many), or other text (None)."""
        line = s.rsplit("\n", 1)[-1]
        start = 0 if "\n" in s else self._indent
        if start is None or line.strip(" \t"):
            self._indent = None
        else:
            self._indent = start + len(line)

    def _fence_run(self, m: str, out: list[Segment]) -> bool:
        """A run of backticks or tildes at the front of the buffer: a fence when it starts a line.
        False when the run may still grow (the next chunk decides)."""
        ch = m[0]
        n = len(self._buf) - len(self._buf.lstrip(ch))
        if n == len(self._buf) and not self.finished:
            return False
        run, self._buf = self._buf[:n], self._buf[n:]
        at_line_start = self._indent is not None and self._indent <= 3
        if at_line_start and not self._fence:
            self._fence = run
        elif at_line_start and run[0] == self._fence[0] and len(run) >= len(self._fence):
            self._fence = ""
        self._emit_text(run, out)
        return True

    def _transition(self, marker: str, out: list[Segment]) -> None:
        if self.state == _TEXT:
            if marker in self._closer:
                self.state, self._think_end = _REASONING, self._closer[marker]
            elif marker == self.tool_start:
                self.state = _TOOL
                self._tool = [marker]
                out.append(Segment("tool_call_begin", marker))
            # a stray closing marker in the answer is dropped
        elif self.state == _REASONING:
            self.state = _TEXT
            self._indent = 0  # the answer starts a line
        else:
            self._tool.append(marker)
            self._close_tool(out, closed=True)

    def _close_tool(self, out: list[Segment], *, closed: bool) -> None:
        raw = "".join(self._tool)
        self._tool = []
        self.state = _TEXT
        self._indent = None
        self.tool_calls.append(raw)
        out.append(Segment("tool_call", raw, closed))

    # -- API ---------------------------------------------------------------------------------

    def feed(self, chunk: str) -> list[Segment]:
        if self.finished:
            raise RuntimeError("TextState.feed after finish()")
        out: list[Segment] = []
        self._buf += chunk
        self._run(out)
        return out

    def _run(self, out: list[Segment]) -> None:
        while self._buf:
            markers = self._markers()
            if not markers:  # inside a call that runs to the end of the reply
                self._emit(self._buf, out)
                self._buf = ""
                break
            i, m = self._earliest(self._buf, markers)
            if i >= 0:
                self._emit(self._buf[:i], out)
                self._buf = self._buf[i:]
                if m in _FENCES and self.state == _TEXT:
                    if not self._fence_run(m, out):
                        break
                    continue
                self._buf = self._buf[len(m):]
                self._transition(m, out)
                continue
            if self.finished:
                self._emit(self._buf, out)
                self._buf = ""
                break
            keep = self._held_suffix(self._buf, markers)
            self._emit(self._buf[:len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            break

    def finish(self) -> list[Segment]:
        """End of the reply: flush held text; an unterminated call is given with closed=False
        (closed=True for formats whose calls run to the end of the reply)."""
        if self.finished:
            return []
        out: list[Segment] = []
        self.finished = True
        self._run(out)  # a fence run at the very end is text
        if self.state == _REASONING:
            self.ended_in_reasoning = True
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
        return out


def split_reply(text: str, parser: ModuleType | None = None, **kwargs: Any) -> Reply:
    """Run a whole reply through TextState at once."""
    st = TextState(parser, **kwargs)
    segs = st.feed(text) + st.finish()
    return Reply(st.text, st.reasoning, list(st.tool_calls), segs)
