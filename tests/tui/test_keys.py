"""Terminal bytes to keys: Alt+Enter must reach the message box as alt+enter, not enter."""

from __future__ import annotations

from textual._parser import ParseError
from textual._xterm_parser import XTermParser

from flashmoe.cli.tui.app import teach_alt_enter


def keys(data: str) -> list[str]:
    parser = XTermParser()
    events = list(parser.feed(data))
    try:
        events += list(parser.feed(""))  # end of input flushes a lone ESC
    except ParseError:
        pass
    return [e.key for e in events if hasattr(e, "key")]


def test_esc_cr_is_alt_enter():
    teach_alt_enter()
    assert keys("\x1b\r") == ["alt+enter"]
    assert keys("\x1b[13;3u") == ["alt+enter"]  # kitty keyboard protocol
    assert keys("\r") == ["enter"]
    assert keys("\n") == ["ctrl+j"]
    assert keys("\x1b") == ["escape"]
    assert keys("\x1ba") == ["alt+a"]
