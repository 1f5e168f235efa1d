"""A streaming state machine over generated text: visible text, reasoning and tool calls.

Feed it text chunks as they arrive; it returns segments in order:

    Segment("text", ...)             visible answer text (incremental)
    Segment("reasoning", ...)        text inside <think>...</think>, [THINK]...[/THINK] or another
                                     pair of prompts.reasoning.REASONING_MARKERS (incremental,
                                     markers removed)
    Segment("tool_call_begin", m)    a tool-call marker opened (a UI can show "calling a tool...")
    Segment("tool_call", raw)        one complete tool-call block, markers included, verbatim

Markers can be split across chunks at any offset: text that could still be the start of a marker
is held back until the next chunk decides it, so no marker ever leaks into the visible text.
Tool-call markers inside reasoning are not calls, and neither are those the answer shows rather
than makes (a call quoted as an example): inside a fenced Markdown code block (a line that starts,
after at most three spaces, with three or more backticks or tildes, closed by a line starting with
as many of the same), an inline code span (a run of backticks closed by a run as long on the same
line; text after a run is held back until its line decides), an HTML comment (`<!--` to `-->`), a
`>` quote line, or an indented code block (a line indented four columns after a blank line that
follows text, or after another such line). The state can start inside reasoning (`in_reasoning`),
for templates whose generation prompt opened the block; `ended_in_reasoning` says a reply was cut
off before it closed it.

A format may open calls with several markers (`tool_call_starts`: Qwen3-Coder's `<tool_call>` and a
bare `<function=`, DeepSeek-R1's variant openers); any of them opens a call. A call ends at the
format's `tool_call_end`, or, where the parser has `find_call_end(text, start, final)`, where that
says (Qwen3-Coder: by the call's structure, so a `</tool_call>` inside a value does not end it);
it is asked again only when one of the parser's `call_end_tags` arrives or while only blanks
follow the last one, so a long call streams in linear time.

With a marker-less format (plain_json), a reply that may be bare JSON calls is held back until it
is complete, then given as text or as one call block: one JSON call object, several separated by
newlines, `;` or `,`, a list of them, optionally in a ``` fence. Text after a complete object that
cannot start another call object releases the reply as text.

Calls among prose (parsers with `find_calls_in_text`: plain_json's Llama 3.x calls with text
around them, json_tools' wrapped forms and a call object after prose): when a reply gave no call
block, at its end the parser is asked for the calls in its text, by its own rules; they are given
as tool_call segments after the text that held them.

Near-misses (parsers with `bare_json_calls`: Hermes / Qwen3's json_tools). Low-bit models drop
the `<tool_call>` wrapper. When the reply gives no call block, `tools` are known, and the visible
text, stripped, is exactly one JSON object, or exactly one ``` fenced block holding exactly one
JSON object, with nothing else before or after it, and that object is a call (plain_json's
checks: a known tool "name" and "arguments") whose arguments are an object that validates against
the tool's schema, the text is that call. Anything else stays text: a fenced call with prose before
or after it (a call shown as an example), several objects, an unknown tool, arguments that fail
the schema, or no tools to check against. Such a reply is held back like plain_json's while it
may still be one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal

from flashmoe.prompts.reasoning import REASONING_MARKERS
from flashmoe.tools.parsers import parse_calls, plain_json

SegmentKind = Literal["text", "reasoning", "tool_call_begin", "tool_call"]

THINK_START = "<think>"
THINK_END = "</think>"

_TEXT, _REASONING, _TOOL = "text", "reasoning", "tool"
_FENCES = ("```", "~~~")
_BACKTICK = "`"  # also opens an inline code span, where it does not open a fence
_COMMENT_OPEN, _COMMENT_CLOSE = "<!--", "-->"
_QUOTE_LINE = re.compile(r" {0,3}>")
_CODE_INDENT = re.compile(r" {0,3}\t| {4}")  # four columns
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
        s = s[m.end() :].lstrip(" \t\r\n")
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


_DECODER = json.JSONDecoder()


def _maybe_bare_calls(s: str, several: bool = True) -> bool:
    """Could s (left-stripped, non-empty) still become a reply that is only JSON call objects (one
    when not `several`), optionally fenced? False once a complete object is followed by text that
    is neither a closing fence nor (with `several`) the start of another call object."""
    if not _maybe_bare_call(s):
        return False
    body = s
    m = _FENCE_OPEN.match(body)
    if m:
        body = body[m.end() :].lstrip(" \t\r\n")
    while True:
        try:
            _, end = _DECODER.raw_decode(body)
        except json.JSONDecodeError:
            return True  # still arriving (or broken: finish() decides)
        rest = body[end:]
        stripped = rest.strip()
        if not stripped or "```".startswith(stripped):
            return True
        if stripped.startswith("```"):
            return not stripped[3:].strip()
        if not several:
            return False
        body = rest.lstrip(" \t\r\n;,")
        if not body:
            return True
        if not body.startswith("{") or not _maybe_bare_call(body):
            return False


def _one_json_call(text: str, tools: Any) -> bool:
    """The near-miss rule (see the module docstring): text is exactly one JSON call object, bare or
    alone in a ``` fence, naming a known tool with object arguments that fit its schema."""
    from flashmoe.tools.calls import ToolsInfo
    from flashmoe.tools.parsers._common import strip_fence

    s = text.strip()
    if s.startswith("```"):
        inner = strip_fence(s)
        if inner is s or "```" in inner:
            return False
        s = inner.strip()
    if not s.startswith("{"):
        return False
    try:
        _, end = _DECODER.raw_decode(s)
    except json.JSONDecodeError:
        return False
    if s[end:].strip():
        return False
    calls = parse_calls(plain_json, s, tools)
    if len(calls) != 1 or calls[0].error or not isinstance(calls[0].arguments, dict):
        return False
    schema = ToolsInfo.of(tools).schemas.get(calls[0].name or "")
    if schema is None:
        return False
    from flashmoe.tools.safe_schema import is_valid

    return is_valid(schema, calls[0].arguments)  # (False for a schema it cannot take: no intent to be sure of)


class TextState:
    """Splits streamed text. Give it a parser module (tools.parsers.*) or explicit markers.

    `in_reasoning` starts inside reasoning, for templates whose generation prompt already opened
    the block: True (the first pair: <think>), or the opening marker the prompt ended with
    (engine.reasoning.open_reasoning), which picks the closing one. `think_pairs` are the reasoning
    marker pairs recognised (default: all of REASONING_MARKERS; `think_start` / `think_end` put
    one pair first). `tools` is only used to decide held-back bare JSON replies (plain_json).
    """

    def __init__(
        self,
        parser: ModuleType | None = None,
        *,
        tool_call_start: str | None = None,
        tool_call_end: str | None = None,
        think_start: str | None = THINK_START,
        think_end: str | None = THINK_END,
        in_reasoning: bool | str = False,
        tools: Any = None,
        think_pairs: tuple[tuple[str, str], ...] | None = None,
    ) -> None:
        self.parser = parser
        if tool_call_start is not None:
            starts: tuple[str, ...] = (tool_call_start,)
        else:
            starts = tuple(getattr(parser, "tool_call_starts", ()) or (getattr(parser, "tool_call_start", ""),))
        self.tool_starts = tuple(m for m in starts if m)
        self.tool_start = self.tool_starts[0] if self.tool_starts else ""
        self.tool_end = tool_call_end if tool_call_end is not None else getattr(parser, "tool_call_end", "")
        # Where the parser finds a call's end by its structure (only with the parser's own markers).
        self._find_end = (
            getattr(parser, "find_call_end", None) if tool_call_start is None and tool_call_end is None else None
        )
        self._end_tags = tuple(getattr(parser, "call_end_tags", ()) or (self.tool_end or ">",))
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
        self._opener = ""  # the marker that opened the call we are in
        self._body = ""  # with _find_end: the call's text after its opener
        self._checked = 0  # how much of _body find_call_end has seen
        self._whole = bool(getattr(parser, "whole_reply", False)) and not self.tool_start
        # Hermes near-misses: a reply that is one bare call object (only checkable with tools).
        self._near_miss = bool(getattr(parser, "bare_json_calls", False)) and bool(tools) and not self._whole
        self._watch = self._whole or self._near_miss
        self._held = ""
        # Fenced code blocks matter where a marker opens a call (not for bare JSON replies).
        self._fences = _FENCES if self.tool_start else ()
        self._fence = ""  # the fence we are inside ("" outside): its character times its length
        self._inline = ""  # the backtick run that opened the inline code span we are in ("" outside)
        self._comment = False  # inside an HTML comment
        self._indent: int | None = 0  # blanks since the line started; None once it has other text
        self._line_head = ""  # the current line's first characters (a quote? indented?)
        self._after_blank = False  # an indented line here would be a code block (after a blank line)
        self._seen_text = False  # a line with text has ended (an indented reply start is not shown code)
        self.text = ""
        self.reasoning = ""
        self.tool_calls: list[str] = []
        self.finished = False
        self.ended_in_reasoning = False  # finish(): the reply stopped before closing its reasoning

    @property
    def in_reasoning(self) -> bool:
        return self.state == _REASONING

    @property
    def open_call(self) -> str | None:
        """The text of the call under way so far, its opening marker first, or None outside a
        call: what a server can stream of a call before it is complete."""
        if self.state != _TOOL:
            return None
        return "".join(self._tool) + self._body

    # -- markers -----------------------------------------------------------------------------

    def _markers(self) -> list[str]:
        if self.state == _TEXT:
            if self._fence:
                return [self._fence[0] * 3]
            if self._comment:
                return [_COMMENT_CLOSE]
            ms = [m for pair in self.think_pairs for m in pair] + [*self.tool_starts, *self._fences]
            if self._fences:  # (where a marker opens a call)
                ms += [_BACKTICK, _COMMENT_OPEN]
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
            if not stripped or _maybe_bare_calls(stripped, several=self._whole):
                return
            self._watch = False
            s, self._held = self._held, ""
        self.text += s
        out.append(Segment("text", s))

    def _track_line(self, s: str) -> None:
        """Where the current line stands: only blanks so far (how many), or other text (None); its
        first characters; and whether a line that ended here leaves room for an indented code block."""
        *ended, rest = s.split("\n")
        for part in ended:
            head = (self._line_head + part)[:8]
            blank = self._indent is not None and not part.strip(" \t")
            self._after_blank = (blank and self._seen_text) or (self._after_blank and bool(_CODE_INDENT.match(head)))
            self._seen_text = self._seen_text or not blank
            self._line_head, self._indent = "", 0
        self._line_head = (self._line_head + rest)[:8]
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
        if at_line_start and not self._fence and len(run) >= 3:
            self._fence = run
        elif at_line_start and self._fence and run[0] == self._fence[0] and len(run) >= len(self._fence):
            self._fence = ""
        elif ch == _BACKTICK and not self._fence:
            self._inline = run
        self._emit_text(run, out)
        return True

    def _inline_span(self, out: list[Segment]) -> bool:
        """Inside an inline code span: up to a backtick run as long as the one that opened it is
        code, shown as text. A line (or the reply) that ends first leaves the opening run a literal
        one, and what followed it is read as usual. False while undecided (held back)."""
        buf, n = self._buf, len(self._inline)
        nl = buf.find("\n")
        for m in re.finditer(r"`+", buf if nl < 0 else buf[:nl]):
            if m.end() == len(buf) and not self.finished:
                return False  # the run may still grow
            if len(m.group()) == n:
                self._buf, self._inline = buf[m.end() :], ""
                self._emit_text(buf[: m.end()], out)
                return True
        if nl >= 0 or self.finished:
            self._inline = ""  # never closed on its line: the backticks were text
            return True
        return False

    def _shown_as_code(self) -> bool:
        """Whether the current line is a `>` quote or a line of an indented code block."""
        head = self._line_head
        return bool(_QUOTE_LINE.match(head)) or (self._after_blank and bool(_CODE_INDENT.match(head)))

    def _transition(self, marker: str, out: list[Segment]) -> None:
        if self.state == _TEXT:
            if marker in self._closer:
                self.state, self._think_end = _REASONING, self._closer[marker]
            elif marker in self.tool_starts and self._shown_as_code():
                self._emit_text(marker, out)  # a call quoted or indented as code is shown, not made
            elif marker in self.tool_starts:
                self._release_held(out)  # a real call: the text before it is text
                self.state = _TOOL
                self._tool, self._opener, self._body, self._checked = [marker], marker, "", 0
                out.append(Segment("tool_call_begin", marker))
            # a stray closing marker in the answer is dropped
        elif self.state == _REASONING:
            self.state = _TEXT
            self._indent, self._line_head, self._after_blank = 0, "", False  # the answer starts
        else:
            self._tool.append(marker)
            self._close_tool(out, closed=True)

    def _release_held(self, out: list[Segment]) -> None:
        if self._watch:
            self._watch = False
            held, self._held = self._held, ""
            if held:
                self.text += held
                out.append(Segment("text", held))

    def _structured_end(self, out: list[Segment]) -> bool:
        """With find_call_end: take the buffer into the call; close it where the parser says it
        ends and put what follows back in the buffer. False while the call goes on."""
        assert self._find_end is not None
        self._body += self._buf
        self._buf = ""
        seen, self._checked = self._checked, len(self._body)
        # An end is decided by one of the parser's closing tags arriving, or by what follows one
        # (the text after it is only blanks so far); other chunks need no scan of the whole call.
        # Anything this skips is read at finish() with the same result.
        if not self.finished:
            lo = max(0, seen - max(map(len, self._end_tags)) + 1)
            tail = self._body[:seen].rstrip()
            if not (any(t in self._body[lo:] for t in self._end_tags) or any(tail.endswith(t) for t in self._end_tags)):
                return False
        end = self._find_end(self._body, self._opener)
        if end < 0 and self.finished:
            end = self._find_end(self._body, self._opener, final=True)
            if end < 0:
                return False
        if end < 0:
            return False
        body, self._buf = self._body[:end], self._body[end:]
        self._tool, self._body = [self._opener, body], ""
        self._close_tool(out, closed=True)
        return True

    def _close_tool(self, out: list[Segment], *, closed: bool) -> None:
        raw = "".join(self._tool) + self._body
        self._tool, self._body = [], ""
        self.state = _TEXT
        self._indent, self._line_head, self._after_blank = None, "\0", False  # the text after a call goes on its line
        self.tool_calls.append(raw)
        out.append(Segment("tool_call", raw, closed))

    # -- API ---------------------------------------------------------------------------------

    def _calls_in_open_reasoning(self, out: list[Segment]) -> None:
        """A reply that ended inside reasoning, for parsers that say their models write calls
        there (calls_in_open_reasoning): the complete calls from the first start marker on are
        calls (a marker merely mentioned, or a call cut off, stays reasoning; the reasoning stays
        as it was given)."""
        if not getattr(self.parser, "calls_in_open_reasoning", False):
            return
        at = min((i for i in (self.reasoning.find(m) for m in self.tool_starts) if i >= 0), default=-1)
        if at < 0:
            return
        rest = TextState(self.parser, think_pairs=(), tools=self.tools)
        rest.feed(self.reasoning[at:])
        rest.finish()
        for raw in rest.tool_calls:
            calls = parse_calls(self.parser, raw, self.tools)
            if calls and all(c.name and c.arguments is not None and c.error is None for c in calls):
                self.tool_calls.append(raw)
                out.append(Segment("tool_call", raw))

    def feed(self, chunk: str) -> list[Segment]:
        if self.finished:
            raise RuntimeError("TextState.feed after finish()")
        out: list[Segment] = []
        self._buf += chunk
        self._run(out)
        return out

    def _run(self, out: list[Segment]) -> None:
        while self._buf or (self.finished and self.state == _TOOL and self._find_end is not None and self._body):
            if self.state == _TOOL and self._find_end is not None:
                if not self._structured_end(out):
                    break
                continue
            if self.state == _TEXT and self._inline:
                if not self._inline_span(out):
                    break
                continue
            markers = self._markers()
            if not markers:  # inside a call that runs to the end of the reply
                self._emit(self._buf, out)
                self._buf = ""
                break
            i, m = self._earliest(self._buf, markers)
            if i >= 0:
                self._emit(self._buf[:i], out)
                self._buf = self._buf[i:]
                if (m in _FENCES or m == _BACKTICK) and self.state == _TEXT:
                    if not self._fence_run(m, out):
                        break
                    continue
                if self.state == _TEXT and m in (_COMMENT_OPEN, _COMMENT_CLOSE):
                    self._buf = self._buf[len(m) :]
                    self._emit_text(m, out)
                    self._comment = m == _COMMENT_OPEN
                    continue
                self._buf = self._buf[len(m) :]
                self._transition(m, out)
                continue
            if self.finished:
                self._emit(self._buf, out)
                self._buf = ""
                break
            keep = self._held_suffix(self._buf, markers)
            self._emit(self._buf[: len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep :]
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
            self._calls_in_open_reasoning(out)
        if self.state == _TOOL:
            self._close_tool(out, closed=not self.tool_end)
        if self._held:
            held, self._held = self._held, ""
            self._watch = False
            if self._whole:
                calls = parse_calls(self.parser, held, self.tools) if self.parser is not None else []
            else:
                calls = [True] if not self.tool_calls and _one_json_call(held, self.tools) else []
            if calls:
                self.tool_calls.append(held)
                out.append(Segment("tool_call", held))
            else:
                self.text += held
                out.append(Segment("text", held))
        find = getattr(self.parser, "find_calls_in_text", None)
        if find is not None and not self.tool_calls and self.text.strip():
            # Calls written among prose or in a wrapper of their own (the parser's rules); their
            # text was given as text already, so a reader may drop it from the answer.
            for raw in find(self.text, self.tools):
                self.tool_calls.append(raw)
                out.append(Segment("tool_call", raw))
        return out


def split_reply(text: str, parser: ModuleType | None = None, **kwargs: Any) -> Reply:
    """Run a whole reply through TextState at once."""
    st = TextState(parser, **kwargs)
    segs = st.feed(text) + st.finish()
    return Reply(st.text, st.reasoning, list(st.tool_calls), segs)
