"""Reasoning in a plain chat reply (no tools): the same split the agent loop makes with TextState,
so that every face (headless, line REPL, TUI) agrees on what is reasoning and what is the answer."""

from __future__ import annotations

from flashmoe.tools.textstate import Segment, TextState

# How `run --show-reasoning` (and the line REPL) set reasoning apart from the answer.
SHOW_OPEN, SHOW_CLOSE = "<think>\n", "\n</think>\n\n"


class ReplySplitter:
    """Feed it a reply's engine events' text; it gives Segment("reasoning" | "text", ...) in order."""

    def __init__(self) -> None:
        self.state = TextState(None)
        self._fed = False

    def prefill(self, reasoning: str) -> None:
        """PrefillProgress.reasoning: the prompt ended inside this reasoning block."""
        if reasoning and not self._fed:
            self.state = TextState(None, in_reasoning=reasoning)

    def feed(self, text: str) -> list[Segment]:
        self._fed = True
        return [s for s in self.state.feed(text) if s.text]

    def finish(self, tail: str = "") -> list[Segment]:
        out = self.state.feed(tail) if tail else []
        return [s for s in out + self.state.finish() if s.text]

    @property
    def in_reasoning(self) -> bool:
        return self.state.in_reasoning

    @property
    def ended_in_reasoning(self) -> bool:
        return self.state.ended_in_reasoning


CUT_IN_REASONING = {
    "length": "the --max-tokens limit was reached",
    "context": "the context is full",
    "stop": "the model stopped",
}


def reasoning_cut_note(reason: str, tools: bool = False) -> str:
    """What a face says when a reply ended inside its reasoning, before any answer."""
    note = f"the reply ended inside its reasoning ({CUT_IN_REASONING.get(reason, reason)}), before any answer"
    return note + ("; nothing in it was run as a tool call" if tools else "")


def show_segments(segments, with_reasoning: bool, in_think: list[bool], end: bool = False) -> str:
    """Text for a plain stream (`run`): the answer; with `with_reasoning` the reasoning too, set
    apart by lines SHOW_OPEN / SHOW_CLOSE. `in_think` ([bool]) carries whether a block is open."""
    out = []
    for seg in segments:
        if seg.kind == "reasoning":
            if not with_reasoning:
                continue
            if not in_think[0]:
                out.append(SHOW_OPEN)
                in_think[0] = True
            out.append(seg.text)
        elif seg.kind == "text":
            if in_think[0]:
                out.append(SHOW_CLOSE)
                in_think[0] = False
            out.append(seg.text)
    if end and in_think[0]:
        out.append(SHOW_CLOSE.rstrip("\n"))
        in_think[0] = False
    return "".join(out)
