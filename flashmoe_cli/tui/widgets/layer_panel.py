"""The per-layer panel: one row per layer with attention, routing, expert I/O and compute times,
cache hits/misses, and a stacked bar of where the step's time went.

Rows are drawn with the line API (`render_line`) from the latest LayerTimings; the app hands the
panel at most ~10 updates a second, and an update only swaps the data and refreshes.
"""
from __future__ import annotations

from rich.style import Style
from rich.text import Text
from textual.containers import VerticalScroll
from textual.geometry import Size
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Static

# (field, label, colour) in bar order
PHASES = (
    ("attn_ms", "attn", "#5f87d7"),
    ("route_ms", "route", "#af87d7"),
    ("expert_io_ms", "I/O", "#e0675f"),
    ("expert_compute_ms", "comp", "#5faf5f"),
    ("other_ms", "other", "#878787"),
)
LAYER_ONLY = {"attn_ms", "expert_compute_ms", "other_ms"}  # measured only with --timing layer
FIXED = 36  # cells before the bar: layer, four times, hits/misses


def fmt_ms(v: float) -> str:
    if v < 100:
        return f"{v:5.1f}"
    if v < 100_000:
        return f"{v:5.0f}"
    return "  >99k"[-5:]


def heat(fraction: float) -> Style:
    """Amber for the layer reading least, through to bright red for the one reading most."""
    f = max(0.0, min(1.0, fraction))
    lo, hi = (0xd7, 0xaf, 0x5f), (0xff, 0x40, 0x40)
    r, g, b = (round(a + (c - a) * f) for a, c in zip(lo, hi))
    return Style(color=f"#{r:02x}{g:02x}{b:02x}", bold=f > 0.75)


def split_cells(values: list[float], cells: int) -> list[int]:
    """Share `cells` among values in proportion (largest remainder), so the bar adds up."""
    total = sum(values)
    if total <= 0 or cells <= 0:
        return [0] * len(values)
    exact = [v / total * cells for v in values]
    out = [int(x) for x in exact]
    for i in sorted(range(len(values)), key=lambda i: exact[i] - out[i], reverse=True)[:cells - sum(out)]:
        out[i] += 1
    return out


class LayerRows(Widget):
    DEFAULT_CSS = "LayerRows { height: auto; width: 1fr; }"

    def __init__(self) -> None:
        super().__init__()
        self.rows: tuple = ()
        self.mode = ""
        self._max_total = 0.0
        self._max_io = 0.0

    def set_rows(self, rows: tuple, mode: str) -> None:
        resized = len(rows) != len(self.rows)
        self.rows, self.mode = rows, mode
        totals = [sum(getattr(r, f) for f, _, _ in PHASES) for r in rows]
        self._max_total = max(totals, default=0.0)
        self._max_io = max((r.expert_io_ms for r in rows), default=0.0)
        self.refresh(layout=resized)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self.rows) + 1 if self.rows else 1  # the rows, then their sum

    def row_text(self, y: int) -> Text:
        """Row `y` as text (also what tests read)."""
        if not self.rows:
            return Text(" per-layer timings appear during a reply", style="dim italic")
        if y == len(self.rows):
            return self._sum_text()
        r = self.rows[y]
        t = Text()
        t.append(f"{r.layer:>3} ", style="bold")
        for field, _, colour in PHASES[:4]:
            v = getattr(r, field)
            if self.mode == "step" and field in LAYER_ONLY:
                t.append("    -", style="dim")
            elif field == "expert_io_ms":
                t.append(fmt_ms(v), style=heat(v / self._max_io if self._max_io else 0.0))
            else:
                t.append(fmt_ms(v), style=colour)
            t.append(" ")
        hits = f"{r.hits:>3}" if r.hits < 1000 else "999"
        misses = f"{r.misses:<3}" if r.misses < 1000 else "999"
        t.append(hits, style="#5faf5f")
        t.append("/", style="dim")
        t.append(misses, style="#e0675f" if r.misses else "dim")
        t.append(" ")
        width = max(0, self.size.width - FIXED)
        values = [getattr(r, f) for f, _, _ in PHASES]
        used = round(sum(values) / self._max_total * width) if self._max_total else 0
        for (_, _, colour), n in zip(PHASES, split_cells(values, used)):
            t.append("█" * n, style=colour)
        return t

    def _sum_text(self) -> Text:
        """The whole step: every layer's times and hits/misses added up."""
        t = Text("all ", style="bold")
        for field, _, _ in PHASES[:4]:
            if self.mode == "step" and field in LAYER_ONLY:
                t.append("    -", style="dim")
            else:
                t.append(fmt_ms(sum(getattr(r, field) for r in self.rows)), style="bold")
            t.append(" ")
        hits, misses = sum(r.hits for r in self.rows), sum(r.misses for r in self.rows)
        t.append(f"{hits}/{misses}", style="bold")
        total = sum(getattr(r, f) for r in self.rows for f, _, _ in PHASES)
        t.append(f"  {fmt_ms(total).strip()} ms", style="dim")
        return t

    def render_line(self, y: int) -> Strip:
        if y >= (len(self.rows) + 1 if self.rows else 1):
            return Strip.blank(self.size.width, self.rich_style)
        segments = list(self.row_text(y).render(self.app.console))
        return Strip(segments).crop_extend(0, self.size.width, self.rich_style).apply_style(self.rich_style)


class LayerPanel(VerticalScroll):
    """Toggled with F2 or /timing."""

    def __init__(self, id: str | None = None) -> None:
        super().__init__(id=id)
        self.rows_widget = LayerRows()
        self.updates = 0  # redraws so far (tests check the coalescing)
        self.step: int | None = None
        self.timing_mode = "step"
        self._title()

    def compose(self):
        header = Text(f"{'L':>3} {'attn':>5} {'route':>5} {'I/O':>5} {'comp':>5} {'hit/mis':<7} time", style="bold")
        yield Static(header, classes="layer-header")
        yield self.rows_widget

    def _title(self) -> None:
        step = f" · step {self.step}" if self.step is not None else ""
        self.border_title = f"layers · ms{step} · timing {self.timing_mode}"
        legend = Text()
        for i, (_, label, colour) in enumerate(PHASES):
            legend.append(("  " if i else "") + "■ ", style=colour)
            legend.append(label)
        self.border_subtitle = legend.markup

    def set_mode(self, mode: str) -> None:
        self.timing_mode = mode
        self._title()

    def show_timings(self, ev) -> None:
        """Draw one LayerTimings event (in place)."""
        self.updates += 1
        self.step = ev.step
        self.timing_mode = ev.mode
        self._title()
        self.rows_widget.set_rows(ev.rows, ev.mode)

    def row_texts(self) -> list[str]:
        return [self.rows_widget.row_text(i).plain for i in range(len(self.rows_widget.rows))]
