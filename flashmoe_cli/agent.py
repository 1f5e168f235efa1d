"""The turn driver: generate -> split the reply -> validate / approve / run each call -> feed the
results back -> generate again, until the model answers without calls or a limit is reached.
With no tools that is one reply, so the plain reply and the tool loop are one path: one wait on
the engine, one split into answer and reasoning, one place the reply is saved as it streams, one
statistics accumulator (stats.py), one end (TurnFinished, whose exit code exit_codes.py decides).

UI-agnostic: every face (headless, line REPL, TUI, scripted sessions) drives an AgentLoop and
renders the events it emits (on the driving thread; a Textual worker posts them on); approvals
come from the face's Approver (approvers.py); cancel() works from any thread.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable

from flashmoe.engine.events import EngineFailed, GenerationFinished, PrefillProgress, TokenGenerated
from flashmoe.tools.calls import ToolCall
from flashmoe.tools.executor import ToolExecutor
from flashmoe.tools.parsers import parse_reply
from flashmoe.tools.textstate import TextState
from flashmoe.tools.validate import check_call

from . import signals
from .exit_codes import exit_code
from .reasoning import reasoning_cut_note
from .stats import TurnStats

CONSTRAIN_MODES = ("off", "tools", "required")
POLL_S = 0.1  # how often the wait for the next event wakes (saves a stalled reply, checks the deadline)
STOP_GRACE_S = 2.0  # past the deadline, how long the engine may take to end the reply before the turn ends


@dataclass(frozen=True)
class TextChunk:
    text: str
    kind: str = "text"  # "text" | "reasoning"


@dataclass(frozen=True)
class ToolCallEvent:
    name: str | None
    arguments: dict | None
    raw: str
    valid: bool  # parsed and matched its tool's schema (possibly after the low-bit quoting repair)
    error: str | None  # why it failed, when the call or its run did
    kind: str | None = None  # when invalid: parse, unknown-tool, malformed-json, schema, backslash-quotes, ...


@dataclass(frozen=True)
class ToolResultEvent:
    name: str | None
    ok: bool
    status: str
    content: str
    duration_s: float
    exit_code: int | None
    truncated: bool


@dataclass(frozen=True)
class RepairEvent:
    """A call that failed validation (kept verbatim), and what the model was told."""

    name: str | None
    raw: str
    message: str
    repaired: bool  # run anyway with the low-bit quoting put right


@dataclass(frozen=True)
class TurnFinished:
    status: str  # done | chain-limit | approval-needed | repairs-exhausted | cancelled | timeout | failed
    rounds: int
    message: str = ""  # why it stopped; with "done", a note (the reply ended inside its reasoning)
    exit_code: int = 0  # exit_codes.exit_code(status)


# How a call is written, in the format of the parser that will read it (templates without native
# tools get these instructions in the system prompt, so what they say must be what is parsed).
CALL_FORMATS = {
    "deepseek_v3": (
        "For each function call, write its name and its arguments as a JSON object between DeepSeek's "
        "tool-call markers:\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
        "<function-name>\n```json\n<args-json-object>\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    ),
}
JSON_CALL_FORMAT = (
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def tool_instructions(tools: list[dict], parser=None, *, native_results: bool = False) -> str:
    """For chat templates that render no tools: how to call them, in the parser's own format
    (Qwen / Hermes JSON unless the parser has one of its own)."""
    text = resources.files("flashmoe.prompts").joinpath("tool_instructions.md").read_text()
    results = (
        "Tool results come back to you in the next turn."
        if native_results
        else "Tool results come back to you inside <tool_response></tool_response> tags."
    )
    return (
        text.replace("{call_format}", CALL_FORMATS.get(getattr(parser, "name", ""), JSON_CALL_FORMAT))
        .replace("{results}", results)
        .replace("{tools}", "\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    )


@dataclass
class AgentLoop:
    """The one turn driver of every face. `run_turn(text)` blocks until the turn ends and returns
    its TurnFinished; `on_event` gets, on that thread, every engine event and TextChunk (a
    token's pieces of answer or reasoning come just before its TokenGenerated, the reply's last
    ones before its GenerationFinished), the tool events, and the TurnFinished last. `cancel()`
    may be called from any thread. Without an executor there are no tools and a turn is one
    plain reply: the same wait, split, saves, statistics and end as with tools."""

    session: object  # flashmoe.cli.chat.ChatSession
    executor: ToolExecutor | None = None  # None: no tools
    parser: object = None  # a tools.parsers module (None: no tools)
    template: str = ""  # the chat template's text ("" when unknown)
    constrain: str = "off"
    on_event: Callable[[object], None] = lambda ev: None
    raw: bool = False  # `run --raw`: the text is the prompt, without the chat template (no tools)
    poll_s: float = POLL_S
    stats: TurnStats = field(default_factory=TurnStats)  # fed each event before on_event sees it
    _cancel: threading.Event = field(default_factory=threading.Event)
    _handle: object = None
    _state: TextState | None = None  # the last reply, split
    _deadline: float | None = None
    _timed_out: bool = False

    def __post_init__(self):
        if self.constrain not in CONSTRAIN_MODES:
            raise ValueError(f"--constrain must be one of {', '.join(CONSTRAIN_MODES)}, got {self.constrain!r}")
        self.tools = self.executor.registry.definitions() if self.executor is not None else []
        # Templates that render `tools` get them natively; others get instructions in the system
        # prompt. Calls and results are recorded in the template's own form when it renders
        # `tool_calls` (DeepSeek V3 renders calls but not tools), and DeepSeek's template
        # concatenates the arguments, so it gets them as a JSON string. Without tools the reply
        # is recorded as it was written.
        self.native = bool(self.tools) and "tools" in self.template
        self.native_calls = bool(self.tools) and (self.native or "tool_calls" in self.template)
        self.json_arguments = getattr(self.parser, "name", "") == "deepseek_v3"
        self._factories: dict[str, object] = {}

    def cancel(self) -> None:
        """Stop the turn: the reply being written ends (kept, marked interrupted), no call runs after it."""
        self._cancel.set()
        if self._handle is not None:
            self._handle.cancel()

    def _constraint(self, first_round: bool):
        """`required` forces a call in the first reply of a turn; later replies (after tool results)
        may answer in text, with any call they start still held to the schemas."""
        if self.constrain == "off" or not self.tools:
            return None
        mode = "required" if self.constrain == "required" and first_round else "tools"
        if mode not in self._factories:
            from flashmoe.tools.grammar import tool_call_constraint

            fmt = "xml" if getattr(self.parser, "name", "") == "qwen3_coder" else "json"
            self._factories[mode] = tool_call_constraint(
                self.tools,
                mode,
                fmt,
                getattr(self.parser, "tool_call_start", "<tool_call>") or "<tool_call>",
                getattr(self.parser, "tool_call_end", "</tool_call>") or "</tool_call>",
            )
        return self._factories[mode]

    def run_turn(self, text: str, deadline: float | None = None) -> TurnFinished:
        """One user message to its end. `deadline` (time.monotonic()): past it the turn stops as
        cancel() stops it, with status "timeout"."""
        self._cancel.clear()
        self._deadline, self._timed_out = deadline, False
        self.stats.begin_turn()
        if self.executor is not None:
            self.executor.begin_turn()
            self.executor.deadline = deadline  # no tool runs past it
        rounds = 0
        while True:
            reply, calls, done, failed = self._generate(text if rounds == 0 else None)
            if failed is not None:
                message = (failed.message.strip().splitlines() or ["generation failed"])[0]
                return self._finish("failed", rounds, message, failed.exit_code)
            state = self._state
            interrupted = done is None or done.reason == "cancelled"
            if not calls:
                self.session.add(self._answer_message(reply, state), done=done, interrupted=interrupted)
                if interrupted:
                    return self._finish(self._stopped(), rounds)
                note = reasoning_cut_note(done.reason, tools=bool(self.tools)) if state.ended_in_reasoning else ""
                return self._finish("done", rounds, note)
            rounds += 1
            self._record_calls(reply, calls, done, state)
            seen = len(self.executor.rejected)
            results = self.executor.execute_round(calls)
            for rej in self.executor.rejected[seen:]:
                self.on_event(RepairEvent(rej.name, rej.raw, rej.message, rej.repaired))
            for call, res in zip(calls, results):
                verdict = check_call(call, self.executor.registry)  # to name the failure, repaired ones too
                kind = None if verdict.ok else verdict.kind
                self.on_event(
                    ToolCallEvent(
                        call.name,
                        call.arguments,
                        call.raw,
                        res.status != "invalid",
                        None if res.ok else res.error,
                        kind,
                    )
                )
                self.on_event(
                    ToolResultEvent(
                        res.name, res.ok, res.status, res.content, res.duration_s, res.exit_code, res.truncated
                    )
                )
                self._record_result(call, res.content)
            if self._cancel.is_set() or self._expired():
                return self._finish(self._stopped(), rounds)
            if self.executor.approval_needed:
                return self._finish("approval-needed", rounds, "a tool call needed approval, and this run cannot ask")
            if any(r.stop for r in results):
                kind = "chain-limit" if any(r.status == "chain-limit" for r in results) else "repairs-exhausted"
                return self._finish(kind, rounds, results[-1].content)

    def _finish(self, status: str, rounds: int, message: str = "", engine_code: int = 1) -> TurnFinished:
        ev = TurnFinished(status, rounds, message, exit_code(status, engine_code=engine_code))
        self.on_event(ev)
        return ev

    def _stopped(self) -> str:
        return "timeout" if self._timed_out else "cancelled"

    def _expired(self) -> bool:
        """Past the deadline: stop (once)."""
        if self._deadline is not None and not self._timed_out and time.monotonic() >= self._deadline:
            self._timed_out = True
            self.cancel()
        return self._timed_out

    def _wait_s(self) -> float:
        if self._deadline is None or self._timed_out:
            return self.poll_s
        return min(self.poll_s, max(0.0, self._deadline - time.monotonic()))

    def _submit(self, text: str | None):
        """The reply's request: the user's message first (`text`), then after tool results."""
        tools = self.tools if self.native else None
        extra = (
            tool_instructions(self.tools, self.parser, native_results=self.native_calls)
            if self.tools and not self.native
            else None
        )
        first = text is not None
        if first and self.raw:
            handle = self.session.send_raw(text)
        elif first:
            handle = self.session.send(text, tools=tools, constraint=self._constraint(True), extra_system=extra)
        else:
            handle = self.session.generate(tools=tools, constraint=self._constraint(False), extra_system=extra)
        self._handle = handle
        if self._cancel.is_set():  # cancelled while the request went out
            handle.cancel()
        return handle

    def _generate(self, text: str | None):
        """One reply: stream it, split into answer, reasoning and calls; (text, calls, done, failed).

        Each event is handed on and its text saved inside signals.deferred(), so Ctrl-C, SIGTERM
        or SIGHUP land between two pieces: what the face was given is what the session saves.
        The first Ctrl-C stops the reply (the turn ends after it); a second stops waiting for
        the engine to wind down (done is then None)."""
        first_round = text is not None
        handle = self._submit(text)
        state = self._state = TextState(self.parser, tools=self.tools or None)
        shown: list[str] = []
        fed = stopping = False
        done = failed = None
        while done is None and failed is None:
            try:
                try:
                    ev = handle.get(timeout=self._wait_s())
                except queue.Empty:
                    self.session.save_draft()  # what was shown is saved even while the model stalls
                    if self._expired() and time.monotonic() > self._deadline + STOP_GRACE_S:
                        break  # the engine is still busy (a template rendering): the turn ends without it
                    continue
                with signals.deferred():
                    self.stats.feed(ev)
                    if isinstance(ev, TokenGenerated) and self._cancel.is_set():
                        pass  # written after the stop (the step in flight): neither shown nor saved
                    elif isinstance(ev, TokenGenerated):
                        fed = True
                        self._emit(state.feed(ev.text))
                        self.on_event(ev)
                        shown.append(ev.text)
                        self.session.stream(ev.text)  # saved as it streams (chat.py)
                    elif isinstance(ev, GenerationFinished):
                        self._emit(state.feed(ev.tail) + state.finish())
                        shown.append(ev.tail)
                        self.on_event(ev)
                        done = ev
                    else:
                        if isinstance(ev, PrefillProgress) and not fed and ev.reasoning:
                            # the template opened a reasoning block: the reply starts inside it
                            state = self._state = TextState(
                                self.parser, tools=self.tools or None, in_reasoning=ev.reasoning
                            )
                        self.on_event(ev)
                        failed = ev if isinstance(ev, EngineFailed) else None
                self._expired()
            except KeyboardInterrupt:
                if stopping:
                    break
                stopping = True
                self.cancel()
        if failed is not None:
            # a partial reply is kept, marked; none: its row goes, and the user's message with it
            self.session.abandon_reply(unsend_if_empty=first_round)
            return "", [], None, failed
        reply = "".join(shown)
        if done is None or done.reason == "cancelled" or not self.tools:
            return reply, [], done, None  # an interrupted call is not run
        # Empty / nameless blocks next to named calls are dropped (no repair round for them).
        return reply, parse_reply(self.parser, state.tool_calls, self.tools), done, None

    def _emit(self, segments) -> None:
        for seg in segments:
            if seg.kind in ("text", "reasoning") and seg.text:
                self.on_event(TextChunk(seg.text, seg.kind))

    def _answer_message(self, reply: str, state: TextState) -> dict:
        """The reply as history: with a native template, reasoning goes apart (reasoning_content,
        which the Qwen3 / Qwen3.5 templates render in their own <think> block)."""
        if self.native_calls and state.reasoning:
            return {"role": "assistant", "content": state.text.strip(), "reasoning_content": state.reasoning.strip()}
        return {"role": "assistant", "content": reply}

    def _record_calls(self, reply: str, calls: list[ToolCall], done, state: TextState) -> None:
        if self.native_calls:
            # The visible text, without the call blocks TextState took out (whatever opened them:
            # a marker, a bare <function=, or a near-miss JSON reply) and without reasoning.
            msg = {
                "role": "assistant",
                "content": state.text.strip(),
                "tool_calls": [
                    c.to_openai(f"call_{i}", json_arguments=self.json_arguments) for i, c in enumerate(calls)
                ],
            }
            if state.reasoning:  # not cut at a call marker that was only in the reasoning
                msg["reasoning_content"] = state.reasoning.strip()
        else:
            msg = {"role": "assistant", "content": reply}
        self.session.add(msg, done=done)

    def _record_result(self, call: ToolCall, content: str) -> None:
        if self.native_calls:
            self.session.add({"role": "tool", "name": call.name or "", "content": content})
        else:  # the Qwen way: results come back in a user turn
            self.session.add({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})


def load_tools(specs: list[str], policy, runner):
    """--tools SPEC...: 'builtin' (all), a built-in's name, or a .py / .json / .yaml tools file."""
    from flashmoe.tools.builtin import builtin_tools
    from flashmoe.tools.registry import ToolRegistry
    from flashmoe.tools.user_tools import load_python_tools, load_tool_file

    registry = ToolRegistry()
    builtins = {t.name: t for t in builtin_tools(policy, runner)}
    for spec in specs:
        for part in spec.split(","):
            part = part.strip()
            if part == "builtin":
                for t in builtins.values():
                    registry.add(t) if t.name not in registry.names() else None
            elif part in builtins:
                registry.add(builtins[part])
            elif part.endswith(".py"):
                for t in load_python_tools(Path(part)):
                    registry.add(t)
            elif part.endswith((".json", ".yaml", ".yml")):
                for t in load_tool_file(Path(part), runner):
                    registry.add(t)
            else:
                raise ValueError(
                    f"--tools {part!r}: not a built-in tool ({', '.join(builtins)}, builtin) "
                    "nor a .py, .json or .yaml file"
                )
    return registry
