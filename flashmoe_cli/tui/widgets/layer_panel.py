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


def columns(mode: str, rows: tuple = ()) -> tuple:
    """The time columns a mode fills. Step timing measures routing and expert I/O per layer, and
    expert compute only where the expert store times it (the CPU kernels; not MLX's lazy ones):
    its rows leave out attention, and compute when no row has any, instead of showing them empty."""

    def filled(field: str) -> bool:
        return field not in LAYER_ONLY or (field == "expert_compute_ms" and any(r.expert_compute_ms for r in rows))

    return tuple(p for p in PHASES[:4] if mode != "step" or filled(p[0]))


def fixed_cells(mode: str, rows: tuple = ()) -> int:
    """Cells before the bar: layer, the times, hits/misses."""
    return 4 + 6 * len(columns(mode, rows)) + 8


def header(mode: str, rows: tuple = ()) -> Text:
    times = " ".join(f"{label:>5}" for _, label, _ in columns(mode, rows))
    return Text(f"{'L':>3} {times} {'hit/mis':<7} ms", style="bold")


def fmt_ms(v: float) -> str:
    if v < 100:
        return f"{v:5.1f}"
    if v < 100_000:
        return f"{v:5.0f}"
    return "  >99k"[-5:]


def heat(fraction: float) -> Style:
    """Amber for the layer reading least, through to bright red for the one reading most."""
    f = max(0.0, min(1.0, fraction))
    lo, hi = (0xD7, 0xAF, 0x5F), (0xFF, 0x40, 0x40)
    r, g, b = (round(a + (c - a) * f) for a, c in zip(lo, hi))
    return Style(color=f"#{r:02x}{g:02x}{b:02x}", bold=f > 0.75)


def split_cells(values: list[float], cells: int) -> list[int]:
    """Share `cells` among values in proportion (largest remainder), so the bar adds up."""
    total = sum(values)
    if total <= 0 or cells <= 0:
        return [0] * len(values)
    exact = [v / total * cells for v in values]
    out = [int(x) for x in exact]
    for i in sorted(range(len(values)), key=lambda i: exact[i] - out[i], reverse=True)[: cells - sum(out)]:
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
        for field, _, colour in columns(self.mode, self.rows):
            v = getattr(r, field)
            if field == "expert_io_ms":
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
        width = max(0, self.size.width - fixed_cells(self.mode, self.rows))
        values = [getattr(r, f) for f, _, _ in PHASES]
        used = round(sum(values) / self._max_total * width) if self._max_total else 0
        for (_, _, colour), n in zip(PHASES, split_cells(values, used)):
            t.append("█" * n, style=colour)
        return t

    def _sum_text(self) -> Text:
        """The whole step: every layer's times and hits/misses added up."""
        t = Text("all ", style="bold")
        for field, _, _ in columns(self.mode, self.rows):
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
    """Toggled with F2 or /timing. Its title says which rows are in view ("rows 0-17 of 30") when
    they do not all fit, so a panel that scrolls says so."""

    def __init__(self, id: str | None = None) -> None:
        super().__init__(id=id)
        self.rows_widget = LayerRows()
        self.header = Static(header("step"), classes="layer-header")
        self.updates = 0  # redraws so far (tests check the coalescing)
        self.step: int | None = None
        self.timing_mode = "step"
        self._title()

    def compose(self):
        yield self.header
        yield self.rows_widget

    def visible_rows(self) -> tuple[int, int] | None:
        """(first, last) index of the layer rows in view; None when every row is."""
        n = len(self.rows_widget.rows)
        window = self.scrollable_content_region.height - 1  # the header is docked on top
        if n == 0 or window <= 0 or window >= n + 1:  # the rows and their sum all fit
            return None
        first = min(round(self.scroll_y), n - 1)
        return first, min(first + window, n) - 1

    def _title(self) -> None:
        rows = self.rows_widget.rows
        seen = self.visible_rows() if self.is_mounted else None
        if seen is not None:
            what = f"rows {rows[seen[0]].layer}-{rows[seen[1]].layer} of {len(rows)}"
        else:
            what = "layers"
        step = f" · step {self.step}" if self.step is not None else ""
        self.border_title = f"{what}{step} · timing {self.timing_mode}"  # short: the panel is 48 wide
        legend = Text()
        shown = PHASES if self.timing_mode != "step" else columns("step", rows)
        for i, (_, label, colour) in enumerate(shown):
            legend.append(("  " if i else "") + "■ ", style=colour)
            legend.append(label)
        self.border_subtitle = legend.markup

    def watch_scroll_y(self, old: float, new: float) -> None:
        super().watch_scroll_y(old, new)
        self._title()

    def on_resize(self) -> None:
        self._title()

    def set_mode(self, mode: str) -> None:
        self.timing_mode = mode
        self.header.update(header(mode, self.rows_widget.rows if self.rows_widget.mode == mode else ()))
        self._title()

    def show_timings(self, ev) -> None:
        """Draw one LayerTimings event (in place)."""
        self.updates += 1
        self.step = ev.step
        before = columns(self.timing_mode, self.rows_widget.rows)
        self.timing_mode = ev.mode
        self.rows_widget.set_rows(ev.rows, ev.mode)
        if columns(ev.mode, ev.rows) != before:
            self.header.update(header(ev.mode, ev.rows))
        self._title()
        self.call_after_refresh(self._title)  # the rows' new height is known after the layout

    def row_texts(self) -> list[str]:
        return [self.rows_widget.row_text(i).plain for i in range(len(self.rows_widget.rows))]
