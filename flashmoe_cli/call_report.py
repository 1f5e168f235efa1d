"""What became of each tool call, said the same way by every headless face: its status (ok,
declined, denied, error, timeout, invalid, ..., not-run) goes into the call's JSON line and onto
stderr, and calls that went without the yes they needed make the run exit 5 (exit_codes.py)."""

from __future__ import annotations

import json
import sys

from .agent import ToolCallEvent, ToolResultEvent
from .exit_codes import exit_code
from .json_events import event_dict
from .term_safe import safe

# Results that mean nobody said yes to the call: the run exits 5 (ExitCode.APPROVAL) at the end.
REFUSED = ("declined", "approval-needed")


class CallReport:
    """The AgentLoop's on_event in front of `json` (a JsonEvents, or None): pairs each tool_call
    event with the result that follows it, and passes every other event on."""

    def __init__(self, json_events=None, err=None):
        self.json = json_events
        self.err = err or sys.stderr
        self.pending: ToolCallEvent | None = None
        self.refused: list[str] = []

    def __call__(self, ev) -> None:
        if isinstance(ev, ToolCallEvent):
            self.flush()
            self.pending = ev
            return
        if isinstance(ev, ToolResultEvent) and self.pending is not None:
            call, self.pending = self.pending, None
            self._line(call, ev.status)
        if self.json is not None:
            self.json(ev)

    def flush(self) -> None:
        if self.pending is not None:  # a call with no result (the turn was cut short)
            call, self.pending = self.pending, None
            self._line(call, "not-run")

    def _line(self, call: ToolCallEvent, status: str) -> None:
        if self.json is not None:
            self.json.write(event_dict(call) | {"status": status})
        if status in REFUSED:
            self.refused.append(f"{call.name} {status}")
        why = f" ({call.error})" if status != "ok" and call.error else ""
        args = json.dumps(call.arguments, ensure_ascii=False) if call.arguments is not None else call.raw
        args = args if len(args) <= 200 else args[:199] + "…"
        # names, errors and arguments are the model's text: escaped for the terminal
        print(safe(f"flashmoe: tool call {call.name}: {status}{why} {args}"), file=self.err)

    def exit_code(self, end) -> int:
        """The run's exit code after the turn `end` (TurnFinished), saying which calls were refused."""
        self.flush()
        if self.refused:
            n = len(self.refused)
            print(
                safe(
                    f"flashmoe: error: {n} tool call{'s' if n != 1 else ''} refused for want of approval: "
                    f"{', '.join(self.refused)}"
                ),
                file=self.err,
            )
        return exit_code(end.status, engine_code=end.exit_code, refused=bool(self.refused))
