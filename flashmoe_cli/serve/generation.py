"""One API request on the engine, whichever API it came in: the prompt, the constraint, the
stream of text and reasoning, and the tool calls the reply holds (parsed and validated by the
same code as the agent loop's).

The APIs (openai_api.py, anthropic_api.py) turn their request bodies into a ChatCall and a
Reply back into their own response shapes; nothing here knows either shape.
"""
from __future__ import annotations

import asyncio
import json
import queue
from dataclasses import dataclass, field
from typing import AsyncIterator

from flashmoe.engine.events import EngineFailed, GenerationFinished, PrefillProgress, TokenGenerated
from flashmoe.engine.runtime.generate import GenerationRequest
from flashmoe.engine.runtime.sampling import SamplingParams
from flashmoe.tools.calls import ToolCall
from flashmoe.tools.parsers import json_tools, parse_reply, parser_for_template
from flashmoe.tools.textstate import TextState

from ..agent import tool_instructions
from .errors import APIError


@dataclass
class ChatCall:
    """A chat request in the one form the engine side takes. `messages` are OpenAI-style:
    role system | user | assistant | tool, content text, assistant `tool_calls` as
    [{"id", "name", "arguments": dict}], tool results with `tool_call_id` (and `name`)."""

    messages: list[dict]
    tools: list[dict] = field(default_factory=list)  # [{"name", "description", "parameters"}]
    tool_choice: str | dict = "auto"  # "auto" | "none" | "required" | {"name": NAME}
    parallel_tool_calls: bool = True
    response_schema: dict | None = None  # response_format: the reply is JSON of this schema
    json_reply: bool = False  # response_format json_object / json_schema
    max_tokens: int = 1024
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    prompt: str | None = None  # /v1/completions: raw text, no chat template


@dataclass
class Reply:
    text: str
    reasoning: str
    calls: list[ToolCall]  # valid calls, arguments decoded
    invalid: list[dict]  # calls that failed parsing or their schema: {"raw", "error"}
    done: GenerationFinished

    @property
    def finish_reason(self) -> str:
        """stop | length | tool_calls (OpenAI's words; the Anthropic face maps them)."""
        if self.calls:
            return "tool_calls"
        return "length" if self.done.reason in ("length", "context") else "stop"


@dataclass(frozen=True)
class Delta:
    kind: str  # "text" | "reasoning"
    text: str


def _registry(defs: list[dict]):
    """The offered tools as a registry (what check_call validates against); a bad name or a
    duplicate is a 400 before anything runs."""
    from flashmoe.tools.errors import ToolError
    from flashmoe.tools.registry import Tool, ToolRegistry

    registry = ToolRegistry()
    for d in defs:
        fn = d["function"]
        try:
            registry.add(Tool(fn["name"], fn["description"], fn["parameters"], fn=lambda **kw: None))
        except (ToolError, ValueError, TypeError) as e:
            raise APIError(400, f"tools: {e}", param="tools") from None
    return registry


class Prompter:
    """How this model's chat template takes tools, calls and results."""

    def __init__(self, template: str):
        self.template = template or ""
        self.parser = parser_for_template(self.template, fallback=json_tools)
        self.native = "tools" in self.template  # renders the tool definitions itself
        self.native_calls = self.native or "tool_calls" in self.template
        self.json_arguments = self.parser.name == "deepseek_v3"

    def messages(self, call: ChatCall, defs: list[dict]) -> list[dict]:
        """The history as the template wants it, with tool instructions where it renders none."""
        names = {}
        out: list[dict] = []
        for m in call.messages:
            role = m["role"]
            if role == "assistant" and m.get("tool_calls"):
                for c in m["tool_calls"]:
                    names[c["id"]] = c["name"]
                if self.native_calls:
                    out.append({"role": "assistant", "content": m.get("content") or "", "tool_calls": [
                        ToolCall(c["name"], c["arguments"], "").to_openai(c["id"], json_arguments=self.json_arguments)
                        for c in m["tool_calls"]]})
                else:
                    blocks = [f'<tool_call>\n{json.dumps({"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False)}'
                              "\n</tool_call>" for c in m["tool_calls"]]
                    out.append({"role": "assistant", "content": "\n".join(filter(None, [m.get("content"), *blocks]))})
            elif role == "tool":
                if self.native_calls:
                    out.append({"role": "tool", "name": m.get("name") or names.get(m.get("tool_call_id"), ""),
                                "tool_call_id": m.get("tool_call_id"), "content": m["content"]})
                else:
                    out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
            else:
                out.append({"role": role, "content": m.get("content") or ""})
        if defs and not self.native:
            extra = tool_instructions(defs, self.parser, native_results=self.native_calls)
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{extra}"}
            else:
                out.insert(0, {"role": "system", "content": extra})
        return out

    def constraint(self, call: ChatCall, defs: list[dict]):
        """The grammar the reply is held to: a JSON reply, a forced call, or calls (when the
        model writes one) that match their schemas."""
        try:
            if call.json_reply:
                from flashmoe.tools.grammar import JsonConstraintFactory

                return JsonConstraintFactory(call.response_schema)
            if not defs:
                return None
            from flashmoe.tools.grammar import tool_call_constraint

            fmt = "xml" if self.parser.name == "qwen3_coder" else "json"
            start = getattr(self.parser, "tool_call_start", "") or "<tool_call>"
            end = getattr(self.parser, "tool_call_end", "") or "</tool_call>"
            if call.tool_choice == "auto":
                return tool_call_constraint(defs, "tools", fmt, start, end)
            return tool_call_constraint(defs, "required", fmt, start, end, parallel=call.parallel_tool_calls)
        except (ValueError, TypeError) as e:
            raise APIError(400, f"cannot constrain the reply: {e}",
                           param="response_format" if call.json_reply else "tools") from None


def as_openai_tool(t: dict) -> dict:
    return {"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                             "parameters": t["parameters"]}}


def offered_tools(call: ChatCall) -> list[dict]:
    """The tools the model sees: none under tool_choice "none", only the named one when named."""
    if call.tool_choice == "none":
        return []
    if isinstance(call.tool_choice, dict):
        wanted = [t for t in call.tools if t["name"] == call.tool_choice["name"]]
        if not wanted:
            raise APIError(400, f"tool_choice names {call.tool_choice['name']!r}, which is not in tools",
                           param="tool_choice")
        return wanted
    if call.tool_choice == "required" and not call.tools:
        raise APIError(400, "tool_choice 'required' needs at least one tool", param="tool_choice")
    return call.tools


def build_request(call: ChatCall, template: str, timing: str = "off") -> tuple[GenerationRequest, Prompter, list]:
    """The engine request, the template's Prompter, and the tools offered (OpenAI form)."""
    prompter = Prompter(template)
    if call.prompt is not None:
        return (GenerationRequest(prompt=call.prompt, max_tokens=call.max_tokens, sampling=call.sampling,
                                  stop=call.stop, timing=timing), prompter, [])
    tools = offered_tools(call)
    defs = [as_openai_tool(t) for t in tools]
    if call.json_reply and tools:
        raise APIError(400, "response_format with tools is not supported; send one or the other",
                       param="response_format")
    request = GenerationRequest(
        messages=prompter.messages(call, defs), tools=defs if prompter.native and defs else None,
        constraint=prompter.constraint(call, defs), max_tokens=call.max_tokens, sampling=call.sampling,
        stop=call.stop, timing=timing)
    return request, prompter, defs


class Generation:
    """One request in flight: iterate `deltas()`, then read `reply`. `cancel()` stops it (the
    engine checks between tokens)."""

    def __init__(self, engine, call: ChatCall, template: str):
        self.request, self.prompter, self.tools = build_request(call, template)
        self.registry = _registry(self.tools) if self.tools else None
        self.engine = engine
        self.handle = None
        self.reply: Reply | None = None

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()

    async def deltas(self) -> AsyncIterator[Delta]:
        self.handle = self.engine.submit(self.request, session=None)
        parser = self.prompter.parser if self.tools else None
        state = TextState(parser, tools=self.tools or None)
        fed = False
        try:
            while True:
                for ev in await asyncio.to_thread(self._next_events):
                    for d in self._take(ev, state):
                        yield d
                    if self.reply is not None:
                        return
                    if isinstance(ev, PrefillProgress) and not fed and ev.reasoning:
                        state = TextState(parser, tools=self.tools or None, in_reasoning=ev.reasoning)
                    fed = fed or isinstance(ev, TokenGenerated)
        finally:
            if self.reply is None:
                self.cancel()

    def _next_events(self) -> list:
        """The next event (waiting for it) and every one queued behind it: one thread hop for
        several tokens when the client reads slower than the engine writes."""
        out = [self.handle.get()]
        while True:
            try:
                out.append(self.handle.events.get_nowait())
            except queue.Empty:
                return out

    def _take(self, ev, state: TextState):
        """One engine event: its text as deltas; the reply once it is finished."""
        if isinstance(ev, TokenGenerated):
            for d in _deltas(state.feed(ev.text)):
                yield d
        elif isinstance(ev, GenerationFinished):
            for d in _deltas(state.feed(ev.tail) + state.finish()):
                yield d
            self.reply = self._reply(state, ev)
        elif isinstance(ev, EngineFailed):
            message = (ev.message.strip().splitlines() or ["generation failed"])[0]
            raise APIError(400 if ev.exit_code == 2 or ev.exc_type in ("ContextLengthError", "ValueError")
                           else 500, message, kind="invalid_request_error" if ev.exit_code == 2 else "server_error")

    async def run(self) -> Reply:
        async for _ in self.deltas():
            pass
        return self.reply

    def _reply(self, state: TextState, done: GenerationFinished) -> Reply:
        from flashmoe.tools.validate import check_call

        text = state.text
        calls, invalid = [], []
        if self.tools and done.reason != "cancelled":
            for i, c in enumerate(parse_reply(self.prompter.parser, state.tool_calls, self.registry)):
                verdict = check_call(c, self.registry)
                if verdict.ok and not verdict.repaired:
                    calls.append(ToolCall(c.name, verdict.arguments, c.raw, id=f"call_{_short_id()}_{i}"))
                else:
                    invalid.append({"raw": c.raw, "error": verdict.message})
                    text = f"{text}{c.raw}"  # what the model wrote stays in the answer
        return Reply(text.strip() if calls else text, state.reasoning, calls, invalid, done)


def _deltas(segments):
    for seg in segments:
        if seg.kind in ("text", "reasoning") and seg.text:
            yield Delta(seg.kind, seg.text)


def _short_id() -> str:
    import secrets

    return secrets.token_hex(6)
