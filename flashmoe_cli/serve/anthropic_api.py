"""Anthropic's Messages API shapes: POST /v1/messages (plain and streamed) and
/v1/messages/count_tokens. What each field comes to is in MESSAGES and docs/serve.md."""

from __future__ import annotations

import json
import re

from .errors import APIError, expect
from .fields import Fields, Policy
from .generation import ChatCall, Reply
from .openai_api import conditions, response_format, sampling, stops

MESSAGES = Policy(
    honoured=frozenset(
        {
            "model",
            "messages",
            "system",
            "max_tokens",
            "stream",
            "temperature",
            "top_p",
            "top_k",
            "stop_sequences",
            "tools",
            "tool_choice",
            "thinking",
            "output_config",
        }
    ),
    ignored=frozenset({"metadata", "context_management", "service_tier", "cache_control", "inference_geo"}),
)
COUNT_TOKENS = Policy(
    honoured=frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config"}),
    # (a count is the same whatever the reply's settings: a client may send the message's body)
    ignored=frozenset(
        {
            "context_management",
            "cache_control",
            "metadata",
            "max_tokens",
            "stream",
            "temperature",
            "top_p",
            "top_k",
            "stop_sequences",
            "service_tier",
        }
    ),
)
OUTPUT_CONFIG = Policy(honoured=frozenset({"format"}), ignored=frozenset({"effort", "task_budget"}))
THINKING = Policy(honoured=frozenset({"type"}), ignored=frozenset({"budget_tokens", "display"}))
TEXT_BLOCK = Policy(honoured=frozenset({"type", "text"}), ignored=frozenset({"cache_control", "citations"}))
TOOL_USE = Policy(honoured=frozenset({"type", "id", "name", "input"}), ignored=frozenset({"cache_control", "caller"}))
TOOL_RESULT = Policy(
    honoured=frozenset({"type", "tool_use_id", "content", "is_error"}), ignored=frozenset({"cache_control"})
)
TOOL = Policy(
    honoured=frozenset({"name", "description", "input_schema", "type", "defer_loading"}),
    ignored=frozenset({"cache_control", "eager_input_streaming", "input_examples", "strict", "allowed_callers"}),
)
MESSAGE = Policy(honoured=frozenset({"role", "content"}))
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
THINKING_TYPES = {"enabled": True, "adaptive": True, "disabled": False}
# Claude Code's first system block: a per-prompt attribution hash for Anthropic's billing, which
# would make every prompt differ from the first tokens on (no prompt cache across sessions).
BILLING_BLOCK = re.compile(r"\s*x-anthropic-billing-header:[^\n]*\s*$")


def _text(blocks, where: str, fields: Fields) -> str:
    """Text from a string or a list of text blocks (anything else is refused by name)."""
    if isinstance(blocks, str):
        return blocks
    if blocks is None:
        return ""
    expect(blocks, list, where)
    out = []
    for i, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind != "text":
            fields.refuse(_block_problem(f"{where}[{i}]", kind), "messages")
            continue
        fields.top(b, TEXT_BLOCK, f"{where}[{i}]")
        out.append(b.get("text") or "")
    return "".join(out)


def _block_problem(where: str, kind) -> str:
    if kind in ("image", "document"):
        return f"{where}: a content block of type {kind!r}: this model reads text only"
    return f"{where}: content block of type {kind!r} is not supported"


def system_prompt(system, fields: Fields) -> str:
    """The system prompt, without Claude Code's billing block (recorded as ignored)."""
    if isinstance(system, list):
        kept = []
        for _i, b in enumerate(system):
            if isinstance(b, dict) and b.get("type") == "text" and BILLING_BLOCK.match(b.get("text") or ""):
                fields.ignore("system.x-anthropic-billing-header", "a billing hash that changes every prompt")
                continue
            kept.append(b)
        system = kept
    return _text(system, "system", fields)


def messages(body: dict, fields: Fields) -> list[dict]:
    out: list[dict] = []
    system = system_prompt(body.get("system"), fields)
    if system:
        out.append({"role": "system", "content": system})
    expect(body.get("messages"), list, "messages")
    for i, m in enumerate(body["messages"]):
        fields.attempt(_message, m, f"messages[{i}]", out, fields)  # a bad message hides no other problem
    return out


def _message(m, where: str, out: list[dict], fields: Fields) -> None:
    """One message of `messages`, read into `out`."""
    role = m.get("role") if isinstance(m, dict) else None
    if role == "system":  # Claude Code's mid-conversation system messages
        if fields.translate(f"{where}.role", "a system message inside messages"):
            out.append({"role": "system", "content": _text(m.get("content"), f"{where}.content", fields)})
        return
    if role not in ("user", "assistant"):
        fields.refuse(f"{where}: role must be user or assistant", "messages")
        return
    fields.top(m, MESSAGE, where)
    content = m.get("content")
    if isinstance(content, str):
        out.append({"role": role, "content": content})
        return
    expect(content, list, f"{where}.content")
    text, calls = [], []
    for j, b in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            fields.top(b, TEXT_BLOCK, at)
            text.append(b.get("text") or "")
        elif kind == "tool_use" and role == "assistant":
            fields.top(b, TOOL_USE, at)
            calls.append({"id": b.get("id") or "", "name": b.get("name") or "", "arguments": b.get("input") or {}})
        elif kind == "tool_result" and role == "user":
            fields.top(b, TOOL_RESULT, at)
            if text:
                out.append({"role": "user", "content": "".join(text)})
                text = []
            result = _text(b.get("content"), f"{at}.content", fields)
            if b.get("is_error"):
                result = f"error: {result}"
            out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": result})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            fields.ignore(f"{where}.content[] (type {kind!r})", "earlier reasoning is left out, as templates do")
        else:
            fields.refuse(_block_problem(at, kind), "messages")
    if calls:
        out.append({"role": "assistant", "content": "".join(text), "tool_calls": calls})
    elif text or role == "assistant":
        out.append({"role": role, "content": "".join(text)})


def tool_defs(tools, fields: Fields) -> tuple[list[dict], dict[str, str]]:
    """Custom tools as {"name", "description", "parameters"}, and the tools of Anthropic's own
    types (web_search_..., bash_..., text_editor_...), left out and recorded: {name: type}."""
    out, dropped = [], {}
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            fields.refuse(f"tools[{i}]: a tool needs a name", "tools")
            continue
        if t.get("type") not in (None, "custom"):
            dropped[t["name"]] = str(t["type"])
            fields.ignore(f"tools[{i}] (type {t['type']!r})", "only custom tools are run here")
            continue
        fields.top(t, TOOL, f"tools[{i}]")
        out.append(
            fields.defer(
                {
                    "name": t["name"],
                    "description": t.get("description") or "",
                    "parameters": t.get("input_schema") or {"type": "object", "properties": {}},
                },
                t,
                f"tools[{i}]",
            )
        )
    return out, dropped


def tool_choice(value, dropped: dict[str, str]) -> tuple[str | dict, bool]:
    """(tool_choice in the ChatCall's words, parallel calls allowed)."""
    if value is None:
        return "auto", True
    kind = value.get("type") if isinstance(value, dict) else None
    parallel = not value.get("disable_parallel_tool_use", False) if isinstance(value, dict) else True
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(value.get("name"), str):
        if value["name"] in dropped:
            raise APIError(
                400,
                f"tool_choice names {value['name']!r}, a tool of type {dropped[value['name']]!r}: "
                "flashmoe serve runs custom tools only",
                param="tool_choice",
            )
        return {"name": value["name"]}, parallel
    raise APIError(
        400,
        "tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}",
        param="tool_choice",
    )


def thinking(value, fields: Fields) -> bool | None:
    """Anthropic's thinking onto the template's switch (enabled and adaptive: on)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in THINKING_TYPES:
        fields.refuse(f"thinking.type must be one of {', '.join(THINKING_TYPES)}", "thinking")
        return None
    fields.top(value, THINKING, "thinking")
    if not fields.translate("thinking", "reasoning onto the chat template's thinking switch"):
        return None
    return THINKING_TYPES[value["type"]]


def output_format(value, fields: Fields) -> tuple[bool, dict | None]:
    """output_config: its JSON Schema format is a JSON reply (structured outputs); effort a hint."""
    if value is None:
        return False, None
    expect(value, dict, "output_config")
    fields.top(value, OUTPUT_CONFIG, "output_config")
    fmt = value.get("format")
    if fmt is None:
        return False, None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise APIError(
            400, "output_config.format must be {'type': 'json_schema', 'schema': ...}", param="output_config"
        )
    return response_format({"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}})


def max_tokens(body: dict, counting: bool) -> int:
    n = body.get("max_tokens", 1 if counting else None)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise APIError(400, "max_tokens is required and must be a positive integer", param="max_tokens")
    return n


def parse_messages(body: dict, fields: Fields, counting: bool = False) -> ChatCall:
    """The body as a ChatCall; each part is read even after another was refused (fields.attempt)."""
    fields.top(body, COUNT_TOKENS if counting else MESSAGES)
    n = fields.attempt(max_tokens, body, counting, default=1)
    tools, dropped = tool_defs(body.get("tools"), fields)
    choice, parallel = fields.attempt(tool_choice, body.get("tool_choice"), dropped, default=("auto", True))
    json_reply, schema = fields.attempt(output_format, body.get("output_config"), fields, default=(False, None))
    return ChatCall(
        messages=fields.attempt(messages, body, fields, default=[]),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        max_tokens=n,
        sampling=sampling(body, fields),
        stop=fields.attempt(stops, body.get("stop_sequences"), "stop_sequences", default=()),
        json_reply=json_reply,
        response_schema=schema,
        thinking=thinking(body.get("thinking"), fields),
    )


def usage(reply: Reply) -> dict:
    d = reply.done
    return {
        "input_tokens": d.prompt_tokens - d.reused_prompt_tokens,
        "output_tokens": d.generation_tokens,
        "cache_read_input_tokens": d.reused_prompt_tokens,
        "cache_creation_input_tokens": 0,
    }


def stop_reason(reply: Reply) -> str:
    return "stop_sequence" if reply.stop_sequence is not None else STOP_REASONS[reply.finish_reason]


def _tool_id(call_id: str) -> str:
    return call_id.replace("call_", "toolu_")


def blocks(reply: Reply) -> list[dict]:
    out = []
    if reply.reasoning:
        out.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.text:
        out.append({"type": "text", "text": reply.text})
    out += [{"type": "tool_use", "id": _tool_id(c.id), "name": c.name, "input": c.arguments} for c in reply.calls]
    return out


def message_response(gen, model: str, rid: str, info) -> dict:
    reply = gen.reply
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks(reply),
        "stop_reason": stop_reason(reply),
        "stop_sequence": reply.stop_sequence,
        "usage": usage(reply),
        "flashmoe": conditions(reply, info),
    }


async def message_events(gen, model: str, rid: str, info):
    """(event name, payload) of a streamed message, in the order Anthropic's SDK reads them:
    message_start with the prompt's length, one content block at a time (thinking, text, each
    tool_use with its input as it is written where the format allows), message_delta, message_stop."""
    yield (
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": rid,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": gen.prompt_tokens or 0, "output_tokens": 0},
            },
        },
    )
    index, open_kind = -1, None
    streamed = 0

    def start(kind: str, block: dict):
        nonlocal index, open_kind
        if open_kind is not None:
            yield "content_block_stop", {"type": "content_block_stop", "index": index}
        index += 1
        open_kind = kind
        yield "content_block_start", {"type": "content_block_start", "index": index, "content_block": block}

    async for d in gen.deltas():
        if d.kind == "call":
            streamed += 1
            for e in start("tool_use", {"type": "tool_use", "id": _tool_id(d.id), "name": d.name, "input": {}}):
                yield e
            continue
        if d.kind == "call_end":
            yield "content_block_stop", {"type": "content_block_stop", "index": index}
            open_kind = None
            continue
        if d.kind == "args":
            yield (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": d.text},
                },
            )
            continue
        kind = "text" if d.kind == "text" else "thinking"
        if open_kind != kind:
            for e in start(
                kind,
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""},
            ):
                yield e
        delta = (
            {"type": "text_delta", "text": d.text} if kind == "text" else {"type": "thinking_delta", "thinking": d.text}
        )
        yield "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
    reply = gen.reply
    if reply.invalid_text:
        if open_kind != "text":
            for e in start("text", {"type": "text", "text": ""}):
                yield e
        yield (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "text_delta", "text": reply.invalid_text},
            },
        )
    if open_kind is not None:
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    for c in reply.calls[streamed:]:
        index += 1
        yield (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": index,
                "content_block": {"type": "tool_use", "id": _tool_id(c.id), "name": c.name, "input": {}},
            },
        )
        yield (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "input_json_delta", "partial_json": json.dumps(c.arguments, ensure_ascii=False)},
            },
        )
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    yield (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(reply), "stop_sequence": reply.stop_sequence},
            "usage": usage(reply),
            "flashmoe": conditions(reply, info),
        },
    )
    yield "message_stop", {"type": "message_stop"}


def count_tokens_response(gen) -> dict:
    return {"input_tokens": gen.prompt_tokens}
