"""The tool loop: generate -> split the reply -> validate / approve / run each call -> feed the
results back -> generate again, until the model answers without calls or a limit is reached.

UI-agnostic: every face (headless, line REPL, TUI, scripted sessions) drives an AgentLoop and
renders the events it emits; approvals come from the face's Approver.
"""
from __future__ import annotations

import json
import queue
import threading
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

from .reasoning import reasoning_cut_note

CONSTRAIN_MODES = ("off", "tools", "required")


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
    status: str  # done | chain-limit | approval-needed | repairs-exhausted | cancelled | failed
    rounds: int
    message: str = ""  # why it stopped; with "done", a note (the reply ended inside its reasoning)
    exit_code: int = 0


# How a call is written, in the format of the parser that will read it (templates without native
# tools get these instructions in the system prompt, so what they say must be what is parsed).
CALL_FORMATS = {
    "deepseek_v3": ("For each function call, write its name and its arguments as a JSON object between DeepSeek's "
                    "tool-call markers:\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                    "<function-name>\n```json\n<args-json-object>\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
}
JSON_CALL_FORMAT = ("For each function call, return a json object with function name and arguments within "
                    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def tool_instructions(tools: list[dict], parser=None, *, native_results: bool = False) -> str:
    """For chat templates that render no tools: how to call them, in the parser's own format
    (Qwen / Hermes JSON unless the parser has one of its own)."""
    text = resources.files("flashmoe.prompts").joinpath("tool_instructions.md").read_text()
    results = ("Tool results come back to you in the next turn." if native_results else
               "Tool results come back to you inside <tool_response></tool_response> tags.")
    return (text.replace("{call_format}", CALL_FORMATS.get(getattr(parser, "name", ""), JSON_CALL_FORMAT))
                .replace("{results}", results)
                .replace("{tools}", "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)))


@dataclass
class AgentLoop:
    session: object  # flashmoe.cli.chat.ChatSession
    executor: ToolExecutor
    parser: object  # a tools.parsers module
    template: str = ""  # the chat template's text ("" when unknown)
    constrain: str = "off"
    on_event: Callable[[object], None] = lambda ev: None
    _cancel: threading.Event = field(default_factory=threading.Event)
    _handle: object = None
    _state: TextState | None = None  # the last reply, split

    def __post_init__(self):
        if self.constrain not in CONSTRAIN_MODES:
            raise ValueError(f"--constrain must be one of {', '.join(CONSTRAIN_MODES)}, got {self.constrain!r}")
        # Templates that render `tools` get them natively; others get instructions in the system
        # prompt. Calls and results are recorded in the template's own form when it renders
        # `tool_calls` (DeepSeek V3 renders calls but not tools), and DeepSeek's template
        # concatenates the arguments, so it gets them as a JSON string.
        self.native = "tools" in self.template
        self.native_calls = self.native or "tool_calls" in self.template
        self.json_arguments = getattr(self.parser, "name", "") == "deepseek_v3"
        self.tools = self.executor.registry.definitions()
        self._factories: dict[str, object] = {}

    def cancel(self) -> None:
        self._cancel.set()
        if self._handle is not None:
            self._handle.cancel()

    def _constraint(self, first_round: bool):
        """`required` forces a call in the first reply of a turn; later replies (after tool results)
        may answer in text, with any call they start still held to the schemas."""
        if self.constrain == "off":
            return None
        mode = "required" if self.constrain == "required" and first_round else "tools"
        if mode not in self._factories:
            from flashmoe.tools.grammar import tool_call_constraint

            fmt = "xml" if getattr(self.parser, "name", "") == "qwen3_coder" else "json"
            self._factories[mode] = tool_call_constraint(
                self.tools, mode, fmt, getattr(self.parser, "tool_call_start", "<tool_call>") or "<tool_call>",
                getattr(self.parser, "tool_call_end", "</tool_call>") or "</tool_call>")
        return self._factories[mode]

    def run_turn(self, text: str) -> TurnFinished:
        self._cancel.clear()
        self.executor.begin_turn()
        self.session.add({"role": "user", "content": text})
        rounds = 0
        while True:
            reply, calls, done = self._generate(first_round=rounds == 0)
            if isinstance(done, EngineFailed):
                return self._finish(TurnFinished("failed", rounds, done.message.splitlines()[0], done.exit_code))
            state = self._state
            if not calls:
                self.session.add(self._answer_message(reply, state), done=done,
                                 interrupted=done.reason == "cancelled")
                if done.reason == "cancelled":
                    return self._finish(TurnFinished("cancelled", rounds))
                note = reasoning_cut_note(done.reason, tools=True) if state.ended_in_reasoning else ""
                return self._finish(TurnFinished("done", rounds, note))
            rounds += 1
            self._record_calls(reply, calls, done, state)
            seen = len(self.executor.rejected)
            results = self.executor.execute_round(calls)
            for rej in self.executor.rejected[seen:]:
                self.on_event(RepairEvent(rej.name, rej.raw, rej.message, rej.repaired))
            for call, res in zip(calls, results):
                verdict = check_call(call, self.executor.registry)  # to name the failure, repaired ones too
                kind = None if verdict.ok else verdict.kind
                self.on_event(ToolCallEvent(call.name, call.arguments, call.raw, res.status != "invalid",
                                            None if res.ok else res.error, kind))
                self.on_event(ToolResultEvent(res.name, res.ok, res.status, res.content, res.duration_s,
                                              res.exit_code, res.truncated))
                self._record_result(call, res.content)
            if self._cancel.is_set():
                return self._finish(TurnFinished("cancelled", rounds))
            if self.executor.approval_needed:
                return self._finish(TurnFinished("approval-needed", rounds,
                                                 "a tool call needed approval, and this run cannot ask", 5))
            if any(r.stop for r in results):
                kind = "chain-limit" if any(r.status == "chain-limit" for r in results) else "repairs-exhausted"
                return self._finish(TurnFinished(kind, rounds, results[-1].content, 1))

    def _finish(self, ev: TurnFinished) -> TurnFinished:
        self.on_event(ev)
        return ev

    def _generate(self, first_round: bool):
        """One reply: stream its visible text, collect its tool calls."""
        extra = None if self.native else tool_instructions(self.tools, self.parser, native_results=self.native_calls)
        self._handle = self.session.generate(tools=self.tools if self.native else None,
                                             constraint=self._constraint(first_round), extra_system=extra)
        state = self._state = TextState(self.parser, tools=self.tools)
        fed = False
        done = None
        while done is None:
            try:
                ev = self._handle.get(timeout=0.1)
            except queue.Empty:
                continue
            except KeyboardInterrupt:  # Ctrl-C stops the reply; the turn ends after it
                self.cancel()
                continue
            self.on_event(ev)
            if isinstance(ev, PrefillProgress) and not fed and ev.reasoning:
                # the template opened a reasoning block: the reply starts inside it
                state = self._state = TextState(self.parser, tools=self.tools, in_reasoning=ev.reasoning)
            elif isinstance(ev, TokenGenerated):
                fed = True
                self.session.stream(ev.text)  # saved as it streams (chat.py)
                self._emit(state.feed(ev.text))
            elif isinstance(ev, GenerationFinished):
                self._emit(state.feed(ev.tail) + state.finish())
                done = ev
            elif isinstance(ev, EngineFailed):
                self.session.abandon_reply(unsend_if_empty=False)
                return "", [], ev
        if done.reason == "cancelled":
            return done.text, [], done  # an interrupted call is not run
        # Empty / nameless blocks next to named calls are dropped (no repair round for them).
        calls = parse_reply(self.parser, state.tool_calls, self.tools)
        return done.text, calls, done

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
            msg = {"role": "assistant", "content": state.text.strip(),
                   "tool_calls": [c.to_openai(f"call_{i}", json_arguments=self.json_arguments)
                                  for i, c in enumerate(calls)]}
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
                raise ValueError(f"--tools {part!r}: not a built-in tool ({', '.join(builtins)}, builtin) "
                                 "nor a .py, .json or .yaml file")
    return registry
