"""Anthropic's Messages API shapes: POST /v1/messages, plain and streamed."""
from __future__ import annotations

import json

from .errors import APIError, expect, unknown_fields
from .generation import ChatCall, Reply
from .openai_api import conditions, sampling, stops

MESSAGE_FIELDS = {"model", "messages", "system", "max_tokens", "stream", "temperature", "top_p", "top_k",
                  "stop_sequences", "tools", "tool_choice", "metadata"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _text(blocks, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    out = []
    for b in blocks or []:
        if not isinstance(b, dict) or b.get("type") != "text":
            raise APIError(400, f"{where}: only text blocks are supported here, got {b.get('type') if isinstance(b, dict) else b!r}")
        out.append(b.get("text") or "")
    return "".join(out)


def messages(body: dict) -> list[dict]:
    out: list[dict] = []
    if body.get("system"):
        out.append({"role": "system", "content": _text(body["system"], "system")})
    expect(body.get("messages"), list, "messages")
    for i, m in enumerate(body["messages"]):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise APIError(400, f"{where}: role must be user or assistant")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        expect(content, list, f"{where}.content")
        text, calls = [], []
        for b in content:
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                text.append(b.get("text") or "")
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": b.get("id") or "", "name": b.get("name") or "", "arguments": b.get("input") or {}})
            elif kind == "tool_result" and role == "user":
                if text:
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                result = _text(b.get("content"), f"{where}: tool_result content")
                if b.get("is_error"):
                    result = f"error: {result}"
                out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": result})
            elif kind == "thinking" and role == "assistant":
                continue  # earlier reasoning: templates drop it from the history too
            else:
                raise APIError(400, f"{where}: content block of type {kind!r} is not supported")
        if calls:
            out.append({"role": "assistant", "content": "".join(text), "tool_calls": calls})
        elif text or role == "assistant":
            out.append({"role": role, "content": "".join(text)})
    return out


def tool_defs(tools) -> list[dict]:
    out = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or t.get("type") not in (None, "custom"):
            raise APIError(400, f"tools[{i}]: only custom tools with a name and input_schema are supported")
        unknown_fields(t, {"name", "description", "input_schema", "type", "cache_control"}, f"tools[{i}]")
        out.append({"name": t["name"], "description": t.get("description") or "",
                    "parameters": t.get("input_schema") or {"type": "object", "properties": {}}})
    return out


def tool_choice(value) -> tuple[str | dict, bool]:
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
        return {"name": value["name"]}, parallel
    raise APIError(400, "tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}")


def parse_messages(body: dict) -> ChatCall:
    unknown_fields(body, MESSAGE_FIELDS)
    n = body.get("max_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise APIError(400, "max_tokens is required and must be a positive integer", param="max_tokens")
    choice, parallel = tool_choice(body.get("tool_choice"))
    return ChatCall(messages=messages(body), tools=tool_defs(body.get("tools")), tool_choice=choice,
                    parallel_tool_calls=parallel, max_tokens=n, sampling=sampling(body),
                    stop=stops({"stop": body.get("stop_sequences")}))


def usage(reply: Reply) -> dict:
    d = reply.done
    return {"input_tokens": d.prompt_tokens - d.reused_prompt_tokens, "output_tokens": d.generation_tokens,
            "cache_read_input_tokens": d.reused_prompt_tokens, "cache_creation_input_tokens": 0}


def blocks(reply: Reply) -> list[dict]:
    out = []
    if reply.reasoning:
        out.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.text:
        out.append({"type": "text", "text": reply.text})
    out += [{"type": "tool_use", "id": c.id.replace("call_", "toolu_"), "name": c.name, "input": c.arguments}
            for c in reply.calls]
    return out


def message_response(reply: Reply, model: str, rid: str, info) -> dict:
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": blocks(reply),
            "stop_reason": STOP_REASONS[reply.finish_reason], "stop_sequence": None, "usage": usage(reply),
            "flashmoe": conditions(reply, info)}


async def message_events(gen, model: str, rid: str, info):
    """(event name, payload) of a streamed message, in the order Anthropic's SDK reads them."""
    yield "message_start", {"type": "message_start", "message": {
        "id": rid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}}
    index, open_kind = -1, None
    async for d in gen.deltas():
        kind = "text" if d.kind == "text" else "thinking"
        if open_kind != kind:
            if open_kind is not None:
                yield "content_block_stop", {"type": "content_block_stop", "index": index}
            index += 1
            open_kind = kind
            start = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": ""}
            yield "content_block_start", {"type": "content_block_start", "index": index, "content_block": start}
        delta = {"type": "text_delta", "text": d.text} if kind == "text" else {"type": "thinking_delta", "thinking": d.text}
        yield "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
    if open_kind is not None:
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    reply = gen.reply
    for b in blocks(reply):
        if b["type"] != "tool_use":
            continue
        index += 1
        yield "content_block_start", {"type": "content_block_start", "index": index,
                                      "content_block": {**b, "input": {}}}
        yield "content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
            "type": "input_json_delta", "partial_json": json.dumps(b["input"], ensure_ascii=False)}}
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    yield "message_delta", {"type": "message_delta", "delta": {"stop_reason": STOP_REASONS[reply.finish_reason],
                                                               "stop_sequence": None},
                            "usage": usage(reply), "flashmoe": conditions(reply, info)}
    yield "message_stop", {"type": "message_stop"}
