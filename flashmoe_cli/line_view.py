"""A turn as the line faces show it (headless `run`, `flashmoe agent`, the line REPL): the reply's
text on stdout as it streams, each reply's line ended when it finishes, the summary line (and
with --timing layer the per-layer table) on stderr after each reply, a note or an error when the
turn ends. One place for that order, so the faces differ only in how text looks.

A LineView is the AgentLoop's on_event. Subclasses say how text is drawn (`show`) and may show
the tool events (`other`): Stdout here (`run`, `flashmoe agent`), repl.ReplView.
"""

from __future__ import annotations

import json
import sys

from flashmoe.engine.events import GenerationFinished, PrefillProgress

from .agent import TextChunk, TurnFinished
from .progress import PrefillMeter
from .reasoning import show_segments
from .term_safe import is_tty, json_line, safe


class LineView:
    def __init__(self, loaded, stats, timing, *, out=None, err=None, summaries: bool = True, prefix: str = ""):
        """`stats`: the loop's TurnStats; `timing()`: the timing mode now (/timing changes it);
        `summaries`: print the lines after each reply; `prefix`: before a note or an error."""
        self.loaded, self.stats, self.timing = loaded, stats, timing
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.summaries, self.prefix = summaries, prefix
        self.line_open = False  # text was written since the last line this view ended
        self.report: list[str] = []  # the finished reply's lines, said before what comes next
        self.ended = False  # a reply's line was ended in this turn
        self.meter = PrefillMeter(self.err)  # a long prompt's progress, on a terminal

    def __call__(self, ev) -> None:
        if isinstance(ev, PrefillProgress):
            self.meter(ev)
        elif isinstance(ev, (TextChunk, GenerationFinished, TurnFinished)):
            self.meter.clear()  # the reply starts, or a stopped prefill ends: the line goes
        if isinstance(ev, TextChunk):
            self.show([ev])
        elif isinstance(ev, GenerationFinished):
            self.end_reply()
        elif isinstance(ev, TurnFinished):
            self.end_turn(ev)
            self.line_open = self.ended = False
        else:
            self.say_report()  # the reply before a tool call or the next reply
            self.other(ev)

    # -- what subclasses draw -----------------------------------------------------------------
    def show(self, segments, end: bool = False) -> None:
        """Reply text (TextChunk or Segment: kind, text); `end`: close what is open (a reasoning block)."""
        raise NotImplementedError

    def other(self, ev) -> None:
        """Any other event: engine figures, tool calls and results."""

    def put(self, text: str) -> None:
        """Raw text on stdout."""
        self.out.write(text)
        self.out.flush()

    def say(self, text: str) -> None:
        """A line for the user that is not the model's answer: stderr, after whatever stdout holds."""
        self.out.flush()
        print(safe(text), file=self.err, flush=True)

    # -- the order -------------------------------------------------------------------------
    def wrote(self, text: str) -> None:
        """Subclasses call this with the reply text they wrote."""
        if text:
            self.line_open = True

    def end_line(self) -> None:
        self.show([], end=True)
        if self.line_open:
            self.put("\n")
            self.line_open = False
            self.ended = True

    def end_reply(self) -> None:
        self.end_line()
        if self.summaries:
            self.report = self.stats.reply_report(self.loaded, self.timing())

    def say_report(self) -> None:
        for line in self.report:
            self.say(line)
        self.report = []

    def stopped(self, end: TurnFinished) -> None:
        """The turn was stopped (Ctrl-C, a signal, the deadline): the REPL marks the reply."""

    def end_turn(self, end: TurnFinished) -> None:
        had_text = self.line_open
        self.end_line()
        if not had_text and not self.ended and end.status != "failed":
            self.put("\n")  # an empty answer is still a line
        if end.status == "done" and end.message:  # the reply ended inside its reasoning
            self.say(f"flashmoe: note: {self.prefix}{end.message}")
        if end.status in ("cancelled", "timeout"):
            self.stopped(end)
        self.say_report()
        if end.status not in ("done", "cancelled", "timeout"):
            self.say(f"flashmoe: error: {self.prefix}{end.message or end.status}")


class Stdout(LineView):
    """A headless face's stdout: the answer (with `show_reasoning` the reasoning too, set apart),
    escaped on a terminal and as it is on a pipe; nothing but JSON lines with `json`. When its
    reader or terminal goes away the turn stops (`on_lost`) and is saved; `lost` keeps the error."""

    def __init__(self, loaded, stats, timing, *, show_reasoning: bool = False, json: bool = False, **kw):
        super().__init__(loaded, stats, timing, **kw)
        self.show_reasoning, self.json = show_reasoning, json
        self.tty = is_tty(self.out)  # a terminal never gets the model's control sequences
        self.in_think = [False]  # a reasoning block is open (between '<think>' and '</think>' lines)
        self.lost: list[OSError] = []
        self.on_lost = lambda: None

    def _write(self, text: str) -> None:
        if self.lost or not text:
            return
        try:
            self.out.write(text)
            self.out.flush()
        except OSError as e:  # a closed pipe, or EIO from a terminal that hung up
            self.lost.append(e)
            self.on_lost()

    def put(self, text: str) -> None:
        if not self.json:
            self._write(text)

    def show(self, segments, end: bool = False) -> None:
        if self.json:
            return
        text = show_segments(segments, self.show_reasoning, self.in_think, end)
        self._write(safe(text) if self.tty else text)
        self.wrote(text)

    def json_line(self, d: dict) -> None:
        line = json.dumps(d, ensure_ascii=False, default=str)
        self._write((json_line(line) if self.tty else line) + "\n")
