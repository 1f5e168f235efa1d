"""The message box: Enter sends, Ctrl+J or Alt+Enter starts a new line."""

from __future__ import annotations

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea


class PromptInput(TextArea):
    BINDINGS = [
        Binding("ctrl+d", "end_of_input", "Quit when empty", show=False),
    ]
    NEWLINE_KEYS = ("ctrl+j", "alt+enter", "shift+enter", "ctrl+enter")

    class Submitted(Message):
        def __init__(self, prompt: PromptInput, text: str) -> None:
            super().__init__()
            self.prompt = prompt
            self.text = text

        @property
        def control(self) -> PromptInput:
            return self.prompt

    class EndOfInput(Message):
        """Ctrl-D on an empty box."""

    def __init__(self, *, placeholder: str = "", cursor_blink: bool = True, id: str | None = None) -> None:
        super().__init__(
            soft_wrap=True,
            tab_behavior="focus",
            show_line_numbers=False,
            placeholder=placeholder,
            id=id,
            highlight_cursor_line=False,
        )
        self.cursor_blink = cursor_blink

    async def _on_key(self, event: events.Key) -> None:
        # Runs before TextArea._on_key (Textual walks the MRO); prevent_default stops it there.
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
        elif event.key in self.NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            start, end = self.selection
            self._replace_via_keyboard("\n", start, end)

    def action_end_of_input(self) -> None:
        if self.text:
            self.action_delete_right()
        else:
            self.post_message(self.EndOfInput())
