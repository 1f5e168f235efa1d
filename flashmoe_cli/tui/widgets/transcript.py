"""The conversation: user messages as typed, replies as streamed Markdown, notes and errors."""
from __future__ import annotations

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
    """A reply: a Markdown widget fed by a MarkdownStream while tokens arrive.

    Whoever feeds it passes the text through term_safe.safe: Textual writes a Markdown's text to
    the terminal as it is, control sequences included."""

    def __init__(self, title: str = "assistant", text: str = "") -> None:
        super().__init__(classes="msg -assistant")
        self.border_title = title
        self.markdown = Markdown(safe(text) or None, parser_factory=html_as_text)

    def compose(self):
        yield self.markdown

    @property
    def text(self) -> str:
        return self.markdown.source

    @property
    def reasoning(self) -> ReasoningBlock | None:
        found = self.query(ReasoningBlock)
        return found.first() if found else None

    async def add_reasoning(self, text: str, collapsed: bool = False) -> ReasoningBlock:
        """More reasoning: into its block, made (above the answer) when the first comes."""
        block = self.reasoning
        if block is None:
            block = ReasoningBlock(collapsed=collapsed)
            await self.mount(block, before=self.markdown)
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
