"""The conversation: user messages as typed, replies as streamed Markdown, notes and errors."""

from __future__ import annotations

import asyncio
import re

from markdown_it import MarkdownIt
from rich.text import Text
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Collapsible, Markdown, Static

from ...chat import is_tool_result, mark_of
from ...term_safe import safe
from .tool_block import ToolBlock

TOOL_CALL_MARKUP = re.compile(r"<tool_call>.*?(?:</tool_call>|\Z)", re.DOTALL)


def html_as_text() -> MarkdownIt:
    """Textual's parser with raw HTML off: a reply's <div>, <br> or <tool_result> is shown as the
    text the model wrote (the default parser turns it into html tokens, which Markdown drops)."""
    return MarkdownIt("gfm-like", {"html": False})


# A streamed reply's Markdown is cut into another widget before a top-level list's item once this many
# items are done above it (see AssistantMessage.append).
LIST_CUT = 12
APPEND_GAP_S = 0.1  # a reply's Markdown is appended to at most 10 times a second (ReplyStream)
MARKER_RUN = 3  # list or quote markers that open a block in a block on one line, shown as such
_RUN = re.compile(r"([ \t]*)((?:(?:\d{1,9}[.)]|[-+*>])[ \t]+){%d,})" % (MARKER_RUN + 1))
_MARKER = re.compile(r"(\d{1,9}[.)]|[-+*>])([ \t]+)")
_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")
_ITEM = re.compile(r"^ {0,3}(?:\d{1,9}[.)]|[-+*])[ \t]", re.M)  # a line that may start a top-level list item


def tame(text: str) -> str:
    """text with each line's run of list or quote markers past the MARKER_RUN-th escaped (not in
    a code block). A model wrote "1. 1. 2. 3. 4. ..." for hundreds of tokens: Markdown nests a
    list in the item at each marker, Textual a widget in a widget, each narrower; nothing showed,
    and the chat's decode fell from 27 to 4 tok/s as the nesting deepened. Past the third, a
    marker is shown as the text it is. Only what is shown changes, never the reply
    (`AssistantMessage.text`)."""

    def escape(m: re.Match) -> str:
        markers = _MARKER.findall(m.group(2))
        if all(mark in "-*" for mark, _ in markers):  # "- - - -", "* * * *": a thematic break
            return m.group(0)
        rest = "".join(mark[:-1] + "\\" + mark[-1] + gap for mark, gap in markers[MARKER_RUN:])
        return m.group(1) + "".join(mark + gap for mark, gap in markers[:MARKER_RUN]) + rest

    lines, fence = text.splitlines(keepends=True), None
    for i, line in enumerate(lines):
        f = _FENCE.match(line)
        if f and (fence is None or f.group(1)[0] == fence[0] and len(f.group(1)) >= len(fence)):
            fence = f.group(1) if fence is None else None
        elif fence is None:
            lines[i] = _RUN.sub(escape, line, count=1) if _RUN.match(line) else line
    return "".join(lines)


def list_cut(source: str, parser: MarkdownIt) -> int | None:
    """Where to cut `source` so that its last top-level block, a list of more than LIST_CUT items,
    goes on in a widget of its own: the offset of its last item's first line (the item still
    growing), or None. The rest starts with that item's marker, so an ordered list goes on from
    its number (Textual numbers a list from its first item's)."""
    if len(_ITEM.findall(source)) <= LIST_CUT:  # (no need to parse: a long reply of prose is never cut)
        return None
    tokens = parser.parse(source)
    last = next((t for t in reversed(tokens) if t.level == 0 and t.map is not None), None)
    if last is None or last.type not in ("bullet_list_open", "ordered_list_open"):
        return None
    at = tokens.index(last)
    items = [t for t in tokens[at:] if t.type == "list_item_open" and t.level == 1]
    if len(items) <= LIST_CUT:
        return None
    line = items[-1].map[0]
    return sum(len(part) for part in source.splitlines(keepends=True)[:line])


class Transcript(VerticalScroll):
    """Scrolls; anchored to the bottom while a reply streams, until the user scrolls up."""

    can_focus = False

    def show_history(self, history: list[dict]) -> None:
        """A resumed conversation (-c / --cid): its messages as boxes, tool results as blocks."""
        for m in history:
            if is_tool_result(m):
                self.mount(ToolBlock.from_history(m))
            elif m["role"] == "user":
                self.mount(UserMessage(m["content"]))
            elif m["role"] == "assistant":
                content = m["content"]
                text = TOOL_CALL_MARKUP.sub("", content).strip()
                if text == content.strip() and not m.get("tool_calls"):
                    self.mount(box := AssistantMessage(text=content))
                elif text:  # a reply with tool calls: its text (the calls show as their results)
                    self.mount(box := AssistantMessage(text=text))
                else:
                    continue
                if mark_of(m):  # stopped, or cut short by a crash, when it was written
                    box.mark(mark_of(m))


class UserMessage(Static):
    """What the user typed, shown verbatim (no Markdown, no markup; control characters escaped)."""

    def __init__(self, text: str) -> None:
        super().__init__(Text(safe(text)), classes="msg -user")
        self.text = text
        self.border_title = "you"


class ReasoningBlock(Collapsible):
    """The model's reasoning, above its answer: dimmed, open while it streams, collapsed once the
    answer starts (Ctrl+T shows or hides every block). Shown as plain text, control sequences escaped."""

    def __init__(self, text: str = "", collapsed: bool = False) -> None:
        self._text = text
        self.body = Static(self._render_text(), classes="reasoning-text")
        super().__init__(self.body, title="reasoning", collapsed=collapsed, classes="reasoning")

    def _render_text(self) -> Text:
        return Text(safe(self._text.strip("\n")), style="dim italic")

    @property
    def text(self) -> str:
        return self._text.strip("\n")

    def append(self, text: str) -> None:
        self._text += text
        self.body.update(self._render_text())


class AssistantMessage(Vertical):
    """A reply: Markdown widgets fed by a ReplyStream while tokens arrive.

    Textual's Markdown re-renders its last top-level block on every append, and a list is one
    block whose items are widgets: a reply that was a long numbered list re-made every item at
    every token, and the chat's decode fell from 33 to 5 tok/s by its 300th token (the UI thread
    held the interpreter). So a list that grows past LIST_CUT items goes on in a new Markdown
    widget below, from its last item: each widget re-renders at most that many.

    Whoever feeds it passes the text through term_safe.safe: Textual writes a Markdown's text to
    the terminal as it is, control sequences included."""

    def __init__(self, title: str = "assistant", text: str = "") -> None:
        super().__init__(classes="msg -assistant")
        self.border_title = title
        self._raw = [safe(text)]  # each widget's part of the reply, as written (it shows tame(part))
        self.parts = [self._part(self._raw[0])]  # the Markdown widgets, top to bottom; the last one grows
        self._appending = asyncio.Lock()
        self._parser = html_as_text()  # list_cut's, made once: not at every append

    @staticmethod
    def _part(text: str) -> Markdown:
        return Markdown(tame(text) or None, parser_factory=html_as_text)

    def compose(self):
        yield self.parts[0]

    @property
    def markdown(self) -> Markdown:
        """The widget the reply grows in."""
        return self.parts[-1]

    @property
    def text(self) -> str:
        return "".join(self._raw)

    async def append(self, text: str) -> None:
        """More reply text (already through term_safe.safe), cut where list_cut says (tame keeps
        to lines, and a cut is at a line's start, so each widget shows tame of its own part)."""
        async with self._appending:
            live = self.parts[-1]
            self._raw[-1] += text
            shown = tame(self._raw[-1])
            if shown.startswith(live.source):
                await live.append(shown[len(live.source) :])
            else:  # the last line's markers were escaped as more came
                await live.update(shown)
            cut = list_cut(self._raw[-1], self._parser)
            if cut:
                head, tail = self._raw[-1][:cut], self._raw[-1][cut:]
                self._raw[-1:] = [head, tail]
                await live.update(tame(head))
                self.parts.append(self._part(tail))
                await self.mount(self.parts[-1])

    def stream(self) -> ReplyStream:
        return ReplyStream(self)

    @property
    def reasoning(self) -> ReasoningBlock | None:
        found = self.query(ReasoningBlock)
        return found.first() if found else None

    async def add_reasoning(self, text: str, collapsed: bool = False) -> ReasoningBlock:
        """More reasoning: into its block, made (above the answer) when the first comes."""
        block = self.reasoning
        if block is None:
            block = ReasoningBlock(collapsed=collapsed)
            await self.mount(block, before=self.parts[0])
        block.append(text)
        return block

    def mark(self, state: str, detail: str = "") -> None:
        """state: "streaming", "done", "interrupted", "incomplete" (a resumed reply whose process
        died while writing it) or "failed"; shown on the bottom border."""
        for s in ("streaming", "interrupted", "failed"):
            self.set_class(s == state or (s, state) == ("interrupted", "incomplete"), f"-{s}")
        if state == "streaming":
            self.border_subtitle = "…"
        elif state in ("interrupted", "incomplete"):
            self.border_subtitle = f"({state})"
        elif state == "failed":
            self.border_subtitle = "(failed)"
        else:
            self.border_subtitle = detail


class Note(Static):
    """Help output, confirmations and errors: text, not part of the conversation."""

    def __init__(self, text: str, kind: str = "info", title: str = "") -> None:
        super().__init__(Text(safe(text)), classes=f"note -{kind}")  # notes quote engine and tool errors
        self.text = text
        self.kind = kind
        if title:
            self.border_title = title


class ReplyStream:
    """Feeds an AssistantMessage as Textual's MarkdownStream feeds a Markdown (text that comes
    faster than it renders is joined into one append), and at most every APPEND_GAP_S: an append
    re-renders the growing block whole, however little it adds."""

    def __init__(self, box: AssistantMessage) -> None:
        self.box = box
        self._pending: list[str] = []
        self._more = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def write(self, text: str) -> None:
        if self._task is None:
            raise RuntimeError("the reply's stream has stopped")
        if text:
            self._pending.append(text)
            self._more.set()
            await asyncio.sleep(0)  # let the task render it

    async def stop(self) -> None:
        """Render what is pending, then end."""
        if self._task is not None:
            self._task.cancel()
            await self._task
            self._task = None

    async def _run(self) -> None:
        try:
            while await self._more.wait():
                self._more.clear()
                await asyncio.shield(self._flush())
                await asyncio.sleep(APPEND_GAP_S)
        except asyncio.CancelledError:
            pass
        await self._flush()

    async def _flush(self) -> None:
        text, self._pending = "".join(self._pending), []
        if text:
            await self.box.append(text)
