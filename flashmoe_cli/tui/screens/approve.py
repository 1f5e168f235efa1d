"""The question before a tool call runs: y yes, n or Esc no, a always (for this session).

Keys are ignored for the first ARM_S seconds, so letters typed into the message box as the
question pops up do not answer it.
"""

from __future__ import annotations

import json
import time

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from ...term_safe import safe

ARM_S = 0.3


class ApproveScreen(ModalScreen[str]):
    AUTO_FOCUS = "#approve-no"
    BINDINGS = [
        Binding("y", "answer('yes')", "Yes", show=False),
        Binding("n,escape", "answer('no')", "No", show=False),
        Binding("a", "answer('always')", "Always", show=False),
    ]

    def __init__(self, name: str, arguments, reason: str) -> None:
        super().__init__()
        self.tool_name = name
        self.arguments = arguments
        self.reason = reason
        self._armed_at = float("inf")
        self.answered = False

    @property
    def armed(self) -> bool:
        return time.monotonic() >= self._armed_at

    def compose(self) -> ComposeResult:
        # the call is the model's text: shown with its control characters escaped
        args = safe(json.dumps(self.arguments, indent=2, ensure_ascii=False)) if self.arguments is not None else "{}"
        with Vertical(id="approve-box") as box:
            box.border_title = safe(f"Run {self.tool_name}?")
            box.border_subtitle = "y yes · n/Esc no · a always"
            yield Static(Text(safe(self.reason.rstrip(".")) + "."), id="approve-reason")
            with VerticalScroll(id="approve-args"):
                yield Static(Text(args))
            with Horizontal(id="approve-buttons"):
                yield Button("Yes (y)", variant="success", id="approve-yes")
                yield Button("No (n)", variant="error", id="approve-no")
                yield Button("Always (a)", variant="warning", id="approve-always")

    def on_mount(self) -> None:
        self._armed_at = time.monotonic() + ARM_S

    def action_answer(self, value: str) -> None:
        if self.answered or not (self.armed or value == "no"):
            return
        self.answered = True
        self.dismiss(value)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.action_answer(event.button.id.removeprefix("approve-"))
