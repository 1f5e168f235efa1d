"""The top line: model, bits, K, decode speed, bytes per token, cache hit rate, memory."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace

from rich.text import Text
from textual.widget import Widget

from ...cli import human_bytes


def rss_bytes() -> int | None:
    """Resident memory of this process (the peak where /proc is missing, e.g. macOS)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
    except (ImportError, OSError):
        return None


@dataclass(frozen=True)
class Stats:
    model: str = ""
    bits: int | None = None
    top_k: int | None = None
    tok_s: float | None = None
    bytes_per_token: float | None = None
    hit_rate: float | None = None
    rss: int | None = None


class StatusBar(Widget):
    DEFAULT_CSS = "StatusBar { height: 1; }"

    def __init__(self, id: str | None = None) -> None:
        super().__init__(id=id)
        self.stats = Stats()

    def set(self, **changes) -> None:
        new = replace(self.stats, **changes)
        if new != self.stats:
            self.stats = new
            self.refresh()

    def render(self) -> Text:
        return self.render_stats(self.size.width)

    def render_stats(self, width: int = 0) -> Text:
        """The figures; on a narrow terminal the name goes first, then the spaces around separators."""
        s = self.stats
        dash = "–"
        parts = [
            s.model or "loading…",
            f"{s.bits}-bit" if s.bits else ("float" if s.model else dash),
            f"K={s.top_k}" if s.top_k else "K=" + dash,
            f"{s.tok_s:.1f} tok/s" if s.tok_s is not None else f"{dash} tok/s",
            f"{human_bytes(s.bytes_per_token)}/tok" if s.bytes_per_token is not None else f"{dash} B/tok",
            f"hits {s.hit_rate:.0%}" if s.hit_rate is not None else f"hits {dash}",
            f"RSS {human_bytes(s.rss)}" if s.rss is not None else f"RSS {dash}",
        ]
        for brand, sep in (("flashmoe", " │ "), ("", " │ "), ("", "│")):
            text = Text(" ")
            if brand:
                text.append(brand, style="bold")
                text.append(sep, style="dim")
            for i, part in enumerate(parts):
                if i:
                    text.append(sep, style="dim")
                text.append(part)
            if not width or text.cell_len <= width:
                break
        return text
