"""F1: the keys and the slash commands."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from ...commands import COMMANDS

KEYS = (
    ("Enter", "send the message"),
    ("Ctrl+J, Alt+Enter", "new line in the message"),
    ("Esc, Ctrl+C", "stop the reply (its text so far is kept)"),
    ("Ctrl+C Ctrl+C", "quit (two presses within a second, no reply running)"),
    ("Ctrl+D", "quit, on an empty message box"),
    ("F1", "this help"),
    ("F2", "show or hide the per-layer panel"),
    ("Ctrl+T", "show or hide the model's reasoning (collapsed once the answer starts)"),
    ("Ctrl+P", "command palette"),
    ("Ctrl+Q", "quit at once"),
)


def keys_table() -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold #ffaf5f", no_wrap=True)
    table.add_column()
    for key, what in KEYS:
        table.add_row(Text(key), Text(what))
    return table


def commands_table() -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold #5fafd7", no_wrap=True)
    table.add_column()
    for name, what in COMMANDS.items():
        table.add_row(Text(f"/{name}"), Text(what))
    return table


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close", show=False)]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box") as box:
            box.border_title = "flashmoe chat · help"
            box.border_subtitle = "Esc closes"
            yield Static(Text("Keys", style="bold underline"))
            yield Static(keys_table())
            yield Static(Text("\nCommands", style="bold underline"))
            yield Static(commands_table())
            yield Static(
                Text(
                    "\nThe layer panel shows milliseconds per decode step for each layer: "
                    "attention (or linear-attention mixer), routing, waiting for expert reads "
                    "(I/O, shaded by how much that layer read), expert compute, and expert "
                    "cache hits/misses. attn, comp and other need /timing layer.",
                    style="dim",
                )
            )
