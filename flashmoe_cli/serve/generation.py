"""One API request on the engine, whichever API it came in: the prompt, the constraint, the
stream of text, reasoning and tool calls, and the calls the reply holds (parsed and validated by
the same code as the agent loop's).

The APIs (openai_api.py, responses_api.py, anthropic_api.py) turn their request bodies into a
ChatCall and a Reply back into their own response shapes; nothing here knows those shapes.
"""

from __future__ import annotations

import asyncio
import functools
import json
import queue
from dataclasses import dataclass, field
from typing import AsyncIterator

from flashmoe.engine.events import EngineFailed, GenerationFinished, PrefillProgress, TokenGenerated
from flashmoe.engine.runtime.generate import GenerationRequest
from flashmoe.engine.runtime.sampling import SamplingParams
from flashmoe.tools.calls import ToolCall
from flashmoe.tools.parsers import json_tools, parse_calls, parser_for_template
from flashmoe.tools.textstate import TextState

from ..agent import tool_instructions
from .callstream import JsonCallStream
from .errors import APIError

# A call is streamed as it is written only when at least this many tokens of max_tokens are left
# when it opens: the grammar then closes it inside the budget (tools/grammar.py); a call that
# opens later is sent whole once complete, or dropped if max_tokens cuts it.
STREAM_CALL_MIN_TOKENS = 128
POLL_S = 0.25  # how often a wait for the engine's next event looks up (cancel, keepalives)


@dataclass
class ChatCall:
    """A chat request in the one form the engine side takes. `messages` are OpenAI-style:
    role system | user | assistant | tool, content text, assistant `tool_calls` as
    [{"id", "name", "arguments": dict}], tool results with `tool_call_id` (and `name`)."""

    messages: list[dict]
    tools: list[dict] = field(default_factory=list)  # [{"name", "description", "parameters", "deferred"?}]
    tool_choice: str | dict = "auto"  # "auto" | "none" | "required" | {"name": NAME}
    parallel_tool_calls: bool = True
    response_schema: dict | None = None  # response_format: the reply is JSON of this schema
    json_reply: bool = False  # response_format json_object / json_schema
    max_tokens: int = 1024
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    prompt: str | None = None  # /v1/completions: raw text, no chat template
    thinking: bool | None = None  # the template's thinking switch; None: its default
    thinking_field: str = "thinking"  # the request's name for it (reasoning_effort, reasoning.effort)
    summary: bool = False  # Responses: the reasoning goes out as a summary


@dataclass
class Reply:
    text: str
    reasoning: str
    calls: list[ToolCall]  # valid calls, arguments decoded
    invalid: list[dict]  # calls that failed parsing, their schema, or were cut: {"raw", "error"}
    done: GenerationFinished
    stop_sequence: str | None = None  # the stop string that ended the reply
    invalid_text: str = ""  # the text of complete calls that failed (it stays in the answer)

    @property
    def finish_reason(self) -> str:
        """stop | length | tool_calls (OpenAI's words; the other faces map them)."""
        if self.calls:
            return "tool_calls"
        return "length" if self.done.reason in ("length", "context") else "stop"


@dataclass(frozen=True)
class Delta:
    """A piece of the reply as it streams: "text" and "reasoning" carry text; a streamed call is
    "call" (its index among the reply's calls, id and name), then "args" (more of its arguments'
    JSON), then "call_end"."""

    kind: str
    text: str = ""
    index: int = 0
    id: str = ""
    name: str = ""


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


_PROBE = "flashmoe-system-probe"


@functools.lru_cache(maxsize=8)
def system_anywhere(template: str) -> bool:
    """Whether the chat template renders a system message after the first user message (Qwen3's
    and ChatML's do; Qwen3.5's raises, others drop it). Tried once per template."""
    if not template:
        return True
    from flashmoe.engine.runtime.tokenizer import _make_environment

    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "system", "content": _PROBE},
        {"role": "user", "content": "v"},
    ]
    try:
        out = (
            _make_environment()
            .from_string(template)
            .render(messages=messages, add_generation_prompt=True, bos_token="", eos_token="")
        )
    except Exception:  # noqa: BLE001  (a template that refuses it, however it says so)
        return False
    return _PROBE in out


class Prompter:
    """How this model's chat template takes tools, calls, results and system messages."""

    def __init__(self, template: str):
        self.template = template or ""
        self.parser = parser_for_template(self.template, fallback=json_tools)
        self.native = "tools" in self.template  # renders the tool definitions itself
        self.native_calls = self.native or "tool_calls" in self.template
        self.json_arguments = self.parser.name == "deepseek_v3"

    def messages(self, call: ChatCall, defs: list[dict], fields=None) -> list[dict]:
        """The history as the template wants it, with tool instructions where it renders none."""
        names = {}
        out: list[dict] = []
        for m in self._systems(call.messages, fields):
            role = m["role"]
            if role == "assistant" and m.get("tool_calls"):
                for c in m["tool_calls"]:
                    names[c["id"]] = c["name"]
                if self.native_calls:
                    out.append(
                        {
                            "role": "assistant",
                            "content": m.get("content") or "",
                            "tool_calls": [
                                ToolCall(c["name"], c["arguments"], "").to_openai(
                                    c["id"], json_arguments=self.json_arguments
                                )
                                for c in m["tool_calls"]
                            ],
                        }
                    )
                else:
                    blocks = [
                        f"<tool_call>\n{json.dumps({'name': c['name'], 'arguments': c['arguments']}, ensure_ascii=False)}"
                        "\n</tool_call>"
                        for c in m["tool_calls"]
                    ]
                    out.append({"role": "assistant", "content": "\n".join(filter(None, [m.get("content"), *blocks]))})
            elif role == "tool":
                if self.native_calls:
                    out.append(
                        {
                            "role": "tool",
                            "name": m.get("name") or names.get(m.get("tool_call_id"), ""),
                            "tool_call_id": m.get("tool_call_id"),
                            "content": m["content"],
                        }
                    )
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

    def _systems(self, messages: list[dict], fields=None) -> list[dict]:
        """System messages after the first place: kept where they are when the template renders
        them there, else merged into the one system prompt at the front (in their order)."""
        later = [i for i, m in enumerate(messages) if m["role"] == "system" and i > 0]
        if not later or system_anywhere(self.template):
            return messages
        if fields is not None:
            fields.record("system messages: merged into the system prompt")
        system = [m["content"] for m in messages if m["role"] == "system" and m.get("content")]
        rest = [m for m in messages if m["role"] != "system"]
        return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + rest

    def constraint(self, call: ChatCall, defs: list[dict]):
        """The grammar the reply is held to: a JSON reply, a forced call, or calls (when the
        model writes one) that match their schemas, every call closed inside max_tokens."""
        try:
            if call.json_reply:
                return _factory("json", json.dumps(call.response_schema, sort_keys=True))
            if not defs:
                return None
            fmt = "xml" if self.parser.name == "qwen3_coder" else "json"
            start = getattr(self.parser, "tool_call_start", "") or "<tool_call>"
            end = getattr(self.parser, "tool_call_end", "") or "</tool_call>"
            mode = "tools" if call.tool_choice == "auto" else "required"
            parallel = mode == "required" and call.parallel_tool_calls
            factory = _factory("tools", json.dumps(defs, sort_keys=True), mode, fmt, start, end, parallel)
            return factory.with_budget(call.max_tokens)
        except (ValueError, TypeError) as e:
            raise APIError(
                400, f"cannot constrain the reply: {e}", param="response_format" if call.json_reply else "tools"
            ) from None

    def streams_calls(self) -> bool:
        """Whether calls can be streamed as they are written (JSON calls in the grammar's layout)."""
        return self.parser.name == "json_tools"


@functools.lru_cache(maxsize=16)
def _factory(kind: str, spec: str, *options):
    """A grammar factory for a JSON reply's schema or a set of tools, built once for all the
    requests that send the same (an agent sends its tools with every request: building their
    grammars is ~10 ms, their matchers for the tokenizer another ~10 ms)."""
    from flashmoe.tools.grammar import JsonConstraintFactory, tool_call_constraint

    if kind == "json":
        return JsonConstraintFactory(json.loads(spec))
    mode, fmt, start, end, parallel = options
    return tool_call_constraint(json.loads(spec), mode, fmt, start, end, parallel=parallel)


def as_openai_tool(t: dict) -> dict:
    return {
        "type": "function",
        "function": {"name": t["name"], "description": t.get("description") or "", "parameters": t["parameters"]},
    }


def loaded_tools(call: ChatCall) -> list[dict]:
    """The tools not deferred (fields.py: Fields.defer): those a model may call unasked."""
    return [t for t in call.tools if not t.get("deferred")]


def offered_tools(call: ChatCall) -> list[dict]:
    """The tools the model sees: none under tool_choice "none", only the named one when named
    (deferred or not), else those not deferred."""
    if call.tool_choice == "none":
        return []
    if isinstance(call.tool_choice, dict):
        wanted = [t for t in call.tools if t["name"] == call.tool_choice["name"]]
        if not wanted:
            raise APIError(
                400, f"tool_choice names {call.tool_choice['name']!r}, which is not in tools", param="tool_choice"
            )
        return wanted
    if call.tool_choice == "required" and not loaded_tools(call):
        raise APIError(400, "tool_choice 'required' needs at least one tool (not deferred)", param="tool_choice")
    return loaded_tools(call)


def template_kwargs(call: ChatCall, template: str, fields=None) -> dict:
    """The template's thinking switch from the request (reasoning effort, Anthropic's thinking).
    A forced call turns it off: the grammar leaves no room for reasoning before the call. Where
    the template has no switch, a request for one changes nothing and is recorded as ignored."""
    from flashmoe.engine.runtime.reasoning import thinking_switch

    switch = thinking_switch(template)
    thinking = call.thinking
    if call.tool_choice != "auto" and call.tool_choice != "none" and switch:
        thinking = False
    if thinking is None:
        return {}
    if switch is None:
        if fields is not None:
            fields.ignore(call.thinking_field, "this model's chat template has no thinking switch")
        return {}
    if fields is not None:
        fields.record(f"{call.thinking_field} -> {switch}={str(thinking).lower()}")
    return {switch: thinking}


def build_request(
    call: ChatCall, template: str, timing: str = "off", fields=None
) -> tuple[GenerationRequest, Prompter, list]:
    """The engine request, the template's Prompter, and the tools offered (OpenAI form)."""
    prompter = Prompter(template)
    if call.prompt is not None:
        return (
            GenerationRequest(
                prompt=call.prompt, max_tokens=call.max_tokens, sampling=call.sampling, stop=call.stop, timing=timing
            ),
            prompter,
            [],
        )
    tools = offered_tools(call)
    defs = [as_openai_tool(t) for t in tools]
    if call.json_reply and tools:
        raise APIError(
            400, "response_format with tools is not supported; send one or the other", param="response_format"
        )
    request = GenerationRequest(
        messages=prompter.messages(call, defs, fields),
        tools=defs if prompter.native and defs else None,
        constraint=prompter.constraint(call, defs),
        max_tokens=call.max_tokens,
        sampling=call.sampling,
        stop=call.stop,
        timing=timing,
        template_kwargs=template_kwargs(call, template, fields),
    )
    return request, prompter, defs


@dataclass
class _Block:
    """One call block of the reply: its text, whether it was closed, and the streamed call it
    is (index into the reply's calls, id), if it was streamed."""

    raw: str
    closed: bool
    streamed: tuple[int, str] | None = None
    in_text: bool = False  # read out of text already given (no marker opened it)


class Generation:
    """One request in flight: iterate `deltas()`, then read `reply`. `cancel()` stops it (the
    engine checks between tokens). Building it renders nothing; `count_prompt()` does."""

    def __init__(self, engine, call: ChatCall, template: str, fields=None):
        self.call = call
        self.request, self.prompter, self.tools = build_request(call, template, fields=fields)
        self.registry = _registry(self.tools) if self.tools else None
        self.engine = engine
        self.tenant = ""  # whose prompt caches it may reuse (keys.tenant)
        self.handle = None
        self._state: TextState | None = None
        self._fed = False  # a token was read (a reasoning block the prompt opened is known by then)
        self.reply: Reply | None = None
        self.prompt_tokens: int | None = None  # count_prompt()'s answer
        self._blocks: list[_Block] = []
        self._stream: JsonCallStream | None = None  # the call being streamed
        self._announced: tuple[int, str] | None = None  # its index among the calls and its id, once named
        self._streamed = 0  # calls announced so far
        self._held = ""  # blank text after a call or before one: not content if a call follows
        self._opened = False  # a call marker opened the block under way
        self._ids: list[int] = []  # the generated token ids (which stop string matched)
        self._shown = 0  # TokenGenerated events seen
        self._whole = False  # run(): the reply is sent whole, nothing of it was streamed

    # -- before it runs ---------------------------------------------------------------------
    def count_prompt(self) -> int | None:
        """The prompt's length in tokens as the engine will run it (the chat template rendered,
        the context fitted), or None where the engine cannot say (the scripted test engine).
        A prompt the engine would refuse (longer than the context, a template that fails) is
        an APIError now, before anything is sent. CPU work: call it off the event loop."""
        loaded = getattr(self.engine, "loaded", None)
        if loaded is None or getattr(loaded, "tokenizer", None) is None:
            return None
        from flashmoe.engine.errors import FlashMoEError
        from flashmoe.engine.runtime import generate

        try:
            ids = generate.render_prompt(loaded, self.request)
            mode = self.request.truncate_prompt or getattr(self.engine, "truncate_prompt", "off")
            context, what = generate.context_of(loaded)  # as generate() fits it
            ids, _ = generate.fit_context(ids, context, mode, self.request.max_tokens, what)
        except (FlashMoEError, ValueError) as e:
            raise APIError(400, (str(e).strip().splitlines() or ["the prompt cannot run"])[0]) from None
        self.prompt_tokens = len(ids)
        return self.prompt_tokens

    # -- running ----------------------------------------------------------------------------
    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()

    async def deltas(self) -> AsyncIterator[Delta]:
        """The reply as it streams. Reading the text, parsing calls and checking them against
        their schemas is CPU work on the model's output (a schema's pattern, a long call): it
        runs on a worker thread, never on the event loop every client shares (issue 41)."""
        self.handle = self.engine.submit(self.request, session=None, tenant=self.tenant)
        parser = self.prompter.parser if self.tools else None
        self._state = TextState(parser, tools=self.tools or None)
        try:
            while self.reply is None:
                out, error = await asyncio.to_thread(self._next_deltas)
                for d in out:
                    yield d
                if error is not None:
                    raise error
        finally:
            if self.reply is None:
                self.cancel()

    def _next_deltas(self) -> tuple[list[Delta], APIError | None]:
        """The deltas of the events queued now (and the error that ended the reply, after the
        deltas before it). Runs on a worker thread."""
        out: list[Delta] = []
        try:
            for ev in self._next_events():
                out.extend(self._take(ev, self._state))
                if self.reply is not None:
                    break
                if isinstance(ev, PrefillProgress) and not self._fed and ev.reasoning:
                    self._state = TextState(self._state.parser, tools=self.tools or None, in_reasoning=ev.reasoning)
                self._fed = self._fed or isinstance(ev, TokenGenerated)
        except APIError as e:
            return out, e
        return out, None

    def _next_events(self) -> list:
        """The events queued now, waiting at most POLL_S for the first: one thread hop for
        several tokens when the client reads slower than the engine writes, and no thread held
        for long while a prompt waits its turn."""
        try:
            out = [self.handle.get(timeout=POLL_S)]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self.handle.events.get_nowait())
            except queue.Empty:
                return out

    def _take(self, ev, state: TextState):
        """One engine event: its text and calls as deltas; the reply once it is finished."""
        if isinstance(ev, TokenGenerated):
            self._ids.append(ev.id)
            self._shown += 1
            yield from self._segments(state.feed(ev.text), state)
        elif isinstance(ev, GenerationFinished):
            yield from self._segments(state.feed(ev.tail) + state.finish(), state, final=True)
            self.reply = self._reply(state, ev)
        elif isinstance(ev, EngineFailed):
            message = (ev.message.strip().splitlines() or ["generation failed"])[0]
            raise APIError(
                400 if ev.exit_code == 2 or ev.exc_type in ("ContextLengthError", "ValueError") else 500,
                message,
                kind="invalid_request_error" if ev.exit_code == 2 else "server_error",
            )

    def _segments(self, segments, state: TextState, final: bool = False):
        for seg in segments:
            if seg.kind == "reasoning" and seg.text:
                yield Delta("reasoning", seg.text)
            elif seg.kind == "text" and seg.text:
                yield from self._text(seg.text)
            elif seg.kind == "tool_call_begin":
                self._held, self._opened = "", True  # blanks between calls are not content
                left = self.call.max_tokens - len(self._ids)
                if self.prompter.streams_calls() and left >= STREAM_CALL_MIN_TOKENS:
                    self._stream, self._announced = JsonCallStream(seg.text), None
            elif seg.kind == "tool_call":
                block = _Block(seg.text, seg.closed, in_text=not self._opened)
                self._opened = False
                if self._stream is not None:
                    yield from self._stream_call(seg.text, block)
                    if block.streamed is not None:
                        yield Delta("call_end", index=block.streamed[0])
                self._stream = None
                self._blocks.append(block)
        if self._stream is not None and state.open_call is not None:
            yield from self._stream_call(state.open_call, None)
        if final and not self._blocks and self._held:
            held, self._held = self._held, ""
            yield Delta("text", held)

    def _text(self, text: str):
        """Text as content, except blanks that may only separate calls: held until text follows."""
        body = text.rstrip()
        if body:
            yield Delta("text", self._held + body)
            self._held = ""
        self._held += text[len(body) :]

    def _stream_call(self, text: str, block: _Block | None):
        name, args = self._stream.update(text)
        if name is not None:
            self._announced = (self._streamed, f"call_{_short_id()}_{len(self._blocks)}")
            self._streamed += 1
            yield Delta("call", index=self._announced[0], id=self._announced[1], name=name)
        if args and self._announced:
            yield Delta("args", args, index=self._announced[0])
        if block is not None:
            block.streamed = self._announced

    async def run(self) -> Reply:
        self._whole = True
        async for _ in self.deltas():
            pass
        return self.reply

    # -- the reply --------------------------------------------------------------------------
    def _reply(self, state: TextState, done: GenerationFinished) -> Reply:
        """The calls (valid ones; what failed in `invalid`), the text, and how the reply ended.
        A call cut by max_tokens is neither a call nor content; a call already streamed that
        turns out cut or invalid is an APIError (after the headers: an error event), so a
        client never runs a partial call."""
        from flashmoe.tools.validate import check_call

        text = state.text
        calls: list[ToolCall] = []
        invalid: list[dict] = []
        invalid_text = ""
        if self.tools and done.reason != "cancelled":
            parsed = [
                (b, parse_calls(self.prompter.parser, b.raw, self.registry) if b.closed else []) for b in self._blocks
            ]
            named = any(c.name is not None for _, cs in parsed for c in cs)
            for i, (block, found) in enumerate(parsed):
                if not block.closed:
                    why = (
                        f"cut by max_tokens ({self.call.max_tokens})"
                        if done.reason == "length"
                        else f"the reply ended inside it ({done.reason})"
                    )
                    invalid.append({"raw": block.raw, "error": why})
                    self._check_streamed(block, None, f"{why} before it was complete")
                    continue
                if named:  # a stray empty block beside named calls is no call (parse_reply's rule)
                    found = [c for c in found if c.name is not None]
                for j, c in enumerate(found):
                    verdict = check_call(c, self.registry)
                    ok = verdict.ok and not verdict.repaired
                    streamed = block.streamed if j == 0 else None
                    call_id = streamed[1] if streamed else f"call_{_short_id()}_{i}"
                    if ok:
                        calls.append(ToolCall(c.name, verdict.arguments, c.raw, id=call_id))
                    else:
                        invalid.append({"raw": c.raw, "error": verdict.message})
                        invalid_text += c.raw  # what the model wrote stays in the answer
                    if streamed:
                        self._check_streamed(block, calls[-1] if ok else None, verdict.message)
                if block.streamed and not found:
                    self._check_streamed(block, None, "it could not be read")
        for block in self._blocks:  # a call read out of the text (a wrapper, prose around it) is not content
            if block.in_text:
                text = text.replace(block.raw, "", 1)
        reply_text = (text.strip() if self._blocks else text) + invalid_text  # blanks around calls: not content
        return Reply(reply_text, state.reasoning, calls, invalid, done, self._matched_stop(done), invalid_text)

    def _check_streamed(self, block: _Block, call: ToolCall | None, why: str) -> None:
        if block.streamed is None or self._whole:
            return
        if call is None or call.id != block.streamed[1]:
            raise APIError(
                500, f"the tool call streamed as #{block.streamed[0]} is not a valid call: {why}", kind="server_error"
            )

    def _matched_stop(self, done: GenerationFinished) -> str | None:
        """The stop string that ended the reply, or None (the end of the turn, a complete JSON
        reply or call, max_tokens). The engine cuts at a stop string after showing the token
        that completed it; at the end of a turn the last token is never shown."""
        stops = self.call.stop
        may_complete = self.call.json_reply or self.call.tool_choice not in ("auto", "none")
        if not stops or done.reason != "stop" or self._shown != done.generation_tokens or may_complete:
            return None
        tok = getattr(getattr(self.engine, "loaded", None), "tokenizer", None)
        if tok is None:
            return stops[0] if len(stops) == 1 else None
        raw = tok.decode(self._ids)
        cut = len(done.text)
        for s in stops:  # the engine's order: the first stop string found wins
            if raw.find(s, max(0, cut - len(s))) >= 0:
                return s
        return None


def _short_id() -> str:
    import secrets

    return secrets.token_hex(6)
