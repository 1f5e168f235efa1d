"""Reading the JSON files of a model folder without hanging or crashing on hostile ones.

A FIFO (or a device) in place of config.json would block a plain open() forever, and JSON nested
100,000 deep makes json.loads raise RecursionError; both become one ModelLoadError naming the file.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from flashmoe.engine.errors import ModelLoadError

# Far above any real config, manifest or tokenizer file; refuses a runaway file before reading it.
MAX_JSON_BYTES = 512 * 1024 * 1024


def read_bytes(path: Path, limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of a regular file. O_NONBLOCK makes opening a FIFO return at once (no writer
    needed), and fstat on what was opened then refuses it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ModelLoadError(path, "missing") from None
    except OSError as e:
        raise ModelLoadError(path, f"cannot read: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ModelLoadError(path, "not a regular file (a FIFO, device or folder); give a JSON file")
        if st.st_size > limit:
            raise ModelLoadError(path, f"too large for a JSON file ({st.st_size} bytes)")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    except OSError as e:
        raise ModelLoadError(path, f"cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)


def read_json(path: Path, expect: type | None = dict):
    """The parsed JSON in `path`; with `expect`, it must be of that type (an object by default)."""
    path = Path(path)
    raw = read_bytes(path)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ModelLoadError(path, "not valid JSON (not UTF-8 text)") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(path, f"not valid JSON ({e})") from None
    except RecursionError:
        raise ModelLoadError(path, "not valid JSON for a model (nested too deeply)") from None
    if expect is not None and not isinstance(doc, expect):
        kind = {dict: "a JSON object", list: "a JSON array"}.get(expect, expect.__name__)
        raise ModelLoadError(path, f"not {kind} (it holds {_kind(doc)})")
    return doc


def _kind(doc) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "true/false", type(None): "null"}.get(
        type(doc), "a number"
    )
