"""Text that may not be UTF-8. Bytes (stdin, a script file) are decoded here; str from argv, the
environment, a terminal (prompt-toolkit) or JSON may already hold what was not UTF-8 as lone
surrogates (Python's surrogateescape, or a JSON "\\ud800"), which fail later, when the text is
encoded: in the log database, a history file, a tokenizer.

Text the user gives goes through decode_bytes or decode_text once: what cannot be decoded becomes
U+FFFD, said on one stderr line naming where it came from. Paths are not text: they keep their
bytes, so that a folder with such a name still opens.
"""

from __future__ import annotations

import re
import sys

# surrogates that surrogateescape never produces (it maps bytes 0x80-0xff to U+DC80-U+DCFF)
_NOT_ESCAPED_BYTES = re.compile("[\ud800-\udc7f\udd00-\udfff]")


def warn(what: str, stderr=None) -> None:
    print(
        f"flashmoe: warning: {what} is not UTF-8: undecodable bytes are replaced with U+FFFD",
        file=stderr or sys.stderr,
        flush=True,
    )


def decode_bytes(data: bytes, what: str, stderr=None) -> str:
    """UTF-8 text; anything else is decoded with U+FFFD for what cannot be, and that is said once."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        warn(what, stderr)
        return data.decode("utf-8", "replace")


def scrub(text: str) -> str:
    """`text` without lone surrogates: escaped bytes are decoded again as decode_bytes does (so a
    prompt reads the same from argv as from stdin), any other surrogate becomes U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        data = _NOT_ESCAPED_BYTES.sub("\ufffd", text).encode("utf-8", "surrogateescape")
        return data.decode("utf-8", "replace")


def decode_text(text: str, what: str, stderr=None) -> str:
    """scrub(text), said once when it changed anything."""
    clean = scrub(text)
    if clean != text:
        warn(what, stderr)
    return clean
