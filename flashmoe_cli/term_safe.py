"""Text from the model or a tool, made safe to show on a terminal.

A model (or a file a tool read) can write control sequences: OSC 52 puts text on the clipboard,
OSC 0 renames the window, CSI moves the cursor or clears the screen, bidi overrides reorder what
the eye reads ("Trojan source"). None of them may reach a terminal. Every control character but
newline and tab (C0, DEL, the C1 range U+0080-U+009F with 8-bit CSI U+009B and OSC U+009D) and
every bidi override or isolate is replaced by a visible escape in Python's notation: ESC shows
as the four characters `\\x1b`, U+202E as `\\u202e`. The rest of the sequence is left as text,
so the user sees that something was there and what it was.

Each character is judged on its own, so a sequence split across two tokens is caught too.
Piped output does not go through here: a pipe gets the model's bytes unchanged.
"""

from __future__ import annotations

import re

BIDI = "\u202a-\u202e\u2066-\u2069"  # embeddings, overrides, isolates
UNSAFE = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{BIDI}]")


def _visible(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def safe(text: str) -> str:
    """`text` with every control character but \\n and \\t, and every bidi control, escaped."""
    return UNSAFE.sub(_visible, text)


def json_line(line: str) -> str:
    """A JSON line for a terminal: the same controls as \\u escapes, so it stays valid JSON
    (json.dumps already escapes C0 controls; C1 and bidi controls it leaves as they are)."""
    return UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", line)


def for_stream(text: str, stream) -> str:
    """`text` as it should be written to `stream`: escaped on a terminal, unchanged otherwise."""
    return safe(text) if is_tty(stream) else text


def is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):  # closed, or not a file
        return False
