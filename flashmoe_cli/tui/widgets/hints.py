"""The bottom line: the keys that matter, shortened on a narrow terminal."""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

KEYS = (
    ("Enter", "Enter", "send"),
    ("Ctrl+J/Alt+Enter", "^J", "new line"),
    ("Esc", "Esc", "stop"),
    ("F1", "F1", "help"),
    ("F2", "F2", "layers"),
    ("Ctrl+P", "^P", "commands"),
    ("Ctrl+C×2", "^C^C", "quit"),
)


class KeyHints(Widget):
    DEFAULT_CSS = "KeyHints { height: 1; }"

    def render(self) -> Text:
        for short in (False, True):
            text = Text(" ")
            for i, (key, abbr, what) in enumerate(KEYS):
                if i:
                    text.append("  " if not short else " ")
                text.append(abbr if short else key, style="bold")
                text.append(f" {what}", style="dim")
            if text.cell_len <= self.size.width:
                break
        return text
