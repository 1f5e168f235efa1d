"""argparse types for the command line: each rejects a bad value with a one-line reason (exit 2)
before any work starts."""

from __future__ import annotations

import argparse
import math
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


def number_in(low: float, high: float | None = None, *, low_open: bool = False, high_open: bool = False):
    """An argparse type: a finite number in the range from `low` to `high` (None: no upper end);
    `low_open` / `high_open` leave that end out. The same check serves config.toml and FLASHMOE_*."""
    if high is None:
        span = f"greater than {low:g}" if low_open else f"at least {low:g}"
    else:
        span = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def parse(text) -> float:
        try:
            v = float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if (
            isinstance(text, bool)
            or not math.isfinite(v)
            or v < low
            or (low_open and v == low)
            or (high is not None and (v > high or (high_open and v == high)))
        ):
            raise argparse.ArgumentTypeError(f"must be {span}, got {text}")
        return v

    parse.__name__ = "number"  # argparse's "invalid number value" when the type raises ValueError
    return parse


temperature = number_in(0.0)  # 0 is greedy; a negative one is a typo, not "more greedy"
top_p = number_in(0.0, 1.0, low_open=True)
min_p = number_in(0.0, 1.0)
repetition_penalty = number_in(0.0, low_open=True)


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


def lengths(text: str) -> list[int]:
    """'128,1k,4k' -> [128, 1024, 4096]: prompt lengths, each at least 1."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        m = re.fullmatch(r"(\d+)(k?)", part)
        if not m or int(m.group(1)) < 1:
            raise argparse.ArgumentTypeError(f"{part!r} is not a token count (like 128, 1k, 4k)")
        out.append(int(m.group(1)) * (1024 if m.group(2) else 1))
    return out
