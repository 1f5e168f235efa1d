"""A turn's events as JSON lines, one rendering for `run --json` (stdout) and `flashmoe agent
--transcript` (a file), with tools or without.

`token` events carry the answer's part of their text; reasoning goes as its own `reasoning`
events, with the id and step of the token it came in (None for the reply's held-back tail);
tool calls are `tool_call` lines with what became of them (call_report.py). Per-layer events
only with --timing layer: a row per layer per token otherwise swamps the rest.
"""

from __future__ import annotations

import dataclasses

from flashmoe.engine.events import GenerationFinished, LayerTimings, TokenGenerated

from .agent import RepairEvent, TextChunk, ToolCallEvent, ToolResultEvent, TurnFinished

NAMES = {ToolCallEvent: "tool_call", ToolResultEvent: "tool_result", RepairEvent: "repair", TurnFinished: "turn_end"}


def event_dict(ev) -> dict:
    """An engine or agent event as its JSON object."""
    if hasattr(ev, "to_dict"):
        return ev.to_dict()
    return {"event": NAMES[type(ev)], **dataclasses.asdict(ev)}


class JsonEvents:
    """The AgentLoop's events to `write(dict)`. `layers`: per-layer events too; `turn_end`:
    the turn's end as a line (a plain `run --json` ends with the reply's `done`)."""

    def __init__(self, write, *, layers: bool = False, turn_end: bool = True):
        self.write, self.layers, self.turn_end = write, layers, turn_end
        self.pending: list[TextChunk] = []  # the pieces of the token (or tail) that follows them

    def __call__(self, ev) -> None:
        if isinstance(ev, TextChunk):
            self.pending.append(ev)
            return
        if isinstance(ev, (TokenGenerated, GenerationFinished)):
            token = ev if isinstance(ev, TokenGenerated) else None
            pieces, self.pending = self.pending, []
            for c in pieces:
                if c.kind == "reasoning":
                    self.write(
                        {"event": "reasoning", "id": token and token.id, "text": c.text, "step": token and token.step}
                    )
            if token is not None:
                answer = "".join(c.text for c in pieces if c.kind == "text")
                if answer or not pieces:  # a token that was all reasoning has said it already
                    self.write(ev.to_dict() | {"text": answer})
                return
        elif isinstance(ev, LayerTimings) and not self.layers:
            return
        elif isinstance(ev, TurnFinished) and not self.turn_end:
            return
        self.write(event_dict(ev))
