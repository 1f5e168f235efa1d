"""argparse types for the command line: each rejects a bad value with a one-line reason (exit 2)
before any work starts."""
from __future__ import annotations

import argparse
import os
import re


def parse_size(text: str) -> int:
    """'2GB', '512MB', '1.5G', '0' -> bytes (powers of 1024, like the rest of the tools)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 2GB, 512MB or 0)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2)]
    return int(float(m.group(1)) * scale)


def at_least(low: int):
    """An argparse type: an integer no smaller than `low`."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {n}")
        return n
    return parse


def output_file(text: str) -> str:
    """An argparse type for a file we will write: its folder must exist now, not after a long run."""
    folder = os.path.dirname(os.path.abspath(os.path.expanduser(text)))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: the folder {folder} is not writable")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    return text
