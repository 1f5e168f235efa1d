"""OpenAI's Responses API, the subset coding agents use: POST /v1/responses with `input` as text
or items (messages, function_call, function_call_output), `instructions`, function tools, and
streamed events. Nothing is stored (`store` must not be true), so `previous_response_id` is
refused by name like any other field we do not implement."""
from __future__ import annotations

import json
import secrets
import time

from .errors import APIError, unknown_fields
from .generation import ChatCall, Reply
from .openai_api import conditions, max_tokens, response_format, sampling, text_of, tool_choice

FIELDS = {"model", "input", "instructions", "stream", "max_output_tokens", "temperature", "top_p", "tools",
          "tool_choice", "parallel_tool_calls", "store", "text", "include", "prompt_cache_key"}


def _input(body: dict) -> list[dict]:
    out: list[dict] = []
    if body.get("instructions"):
        out.append({"role": "system", "content": text_of(body["instructions"], "instructions")})
    items = body.get("input")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError(400, "input must be a string or a non-empty list of items", param="input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role")
            if role not in ("system", "user", "assistant"):
                raise APIError(400, f"{where}: role must be system, developer, user or assistant", param="input")
            out.append({"role": role, "content": text_of(item.get("content"), where)})
        elif kind == "function_call":
            try:
                args = json.loads(item.get("arguments") or "{}")
            except json.JSONDecodeError:
                raise APIError(400, f"{where}: arguments are not JSON", param="input") from None
            call = {"id": item.get("call_id") or "", "name": item.get("name") or "", "arguments": args}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            elif out and out[-1]["role"] == "assistant" and not out[-1].get("tool_calls"):
                out[-1]["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else text_of(output, where)})
        elif kind == "reasoning":
            continue  # earlier reasoning: templates drop it from the history too
        else:
            raise APIError(400, f"{where}: item type {kind!r} is not supported", param="input")
    return out


def _tools(tools) -> list[dict]:
    out = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise APIError(400, f"tools[{i}]: only function tools are supported", param="tools")
        unknown_fields(t, {"type", "name", "description", "parameters", "strict"}, f"tools[{i}]")
        out.append({"name": t["name"], "description": t.get("description") or "",
                    "parameters": t.get("parameters") or {"type": "object", "properties": {}}})
    return out


def parse_responses(body: dict, default_max: int) -> ChatCall:
    unknown_fields(body, FIELDS)
    if body.get("store"):
        raise APIError(400, "store: responses are not stored here; send store: false and the whole input",
                       param="store")
    if body.get("include"):
        raise APIError(400, "include is not supported", param="include")
    fmt = (body.get("text") or {}).get("format")
    if fmt is not None and fmt.get("type") == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
    json_reply, schema = response_format(fmt)
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return ChatCall(messages=_input(body), tools=_tools(body.get("tools")), tool_choice=tool_choice(choice),
                    parallel_tool_calls=body.get("parallel_tool_calls", True) is not False,
                    response_schema=schema, json_reply=json_reply,
                    max_tokens=max_tokens(body, "max_output_tokens", default=default_max), sampling=sampling(body))


def _usage(reply: Reply) -> dict:
    d = reply.done
    return {"input_tokens": d.prompt_tokens, "output_tokens": d.generation_tokens,
            "total_tokens": d.prompt_tokens + d.generation_tokens,
            "input_tokens_details": {"cached_tokens": d.reused_prompt_tokens},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _message(mid: str, text: str, status: str = "completed") -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def _calls(reply: Reply) -> list[dict]:
    return [{"id": f"fc_{secrets.token_hex(8)}", "type": "function_call", "call_id": c.id, "name": c.name,
             "arguments": json.dumps(c.arguments, ensure_ascii=False), "status": "completed"} for c in reply.calls]


def _response(rid: str, model: str, output: list, reply: Reply | None, info, created: int) -> dict:
    out = {"id": rid, "object": "response", "created_at": created, "model": model, "output": output,
           "status": "in_progress" if reply is None else
           ("incomplete" if reply.done.reason in ("length", "context") and not reply.calls else "completed"),
           "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "error": None,
           "incomplete_details": {"reason": "max_output_tokens"} if reply is not None and reply.done.reason in (
               "length", "context") and not reply.calls else None}
    if reply is not None:
        out["usage"] = _usage(reply)
        out["flashmoe"] = conditions(reply, info)
    return out


def response(reply: Reply, model: str, rid: str, info) -> dict:
    output = ([_message(f"msg_{secrets.token_hex(8)}", reply.text)] if reply.text else []) + _calls(reply)
    return _response(rid.replace("chatcmpl-", "resp_"), model, output, reply, info, int(time.time()))


async def events(gen, model: str, rid: str, info):
    """The streamed events, each with its sequence_number, as the SDK's event types read them."""
    rid = rid.replace("chatcmpl-", "resp_")
    created, seq = int(time.time()), 0
    mid = f"msg_{secrets.token_hex(8)}"

    def ev(kind: str, **fields) -> dict:
        nonlocal seq
        seq += 1
        return {"type": kind, "sequence_number": seq - 1, **fields}

    yield ev("response.created", response=_response(rid, model, [], None, info, created))
    yield ev("response.in_progress", response=_response(rid, model, [], None, info, created))
    text, opened = "", False
    async for d in gen.deltas():
        if d.kind != "text":
            continue
        if not opened:
            opened = True
            yield ev("response.output_item.added", output_index=0, item=_message(mid, "", "in_progress"))
            yield ev("response.content_part.added", item_id=mid, output_index=0, content_index=0,
                     part={"type": "output_text", "text": "", "annotations": []})
        text += d.text
        yield ev("response.output_text.delta", item_id=mid, output_index=0, content_index=0, delta=d.text, logprobs=[])
    reply = gen.reply
    output = []
    if opened:
        part = {"type": "output_text", "text": reply.text, "annotations": []}
        yield ev("response.output_text.done", item_id=mid, output_index=0, content_index=0, text=reply.text, logprobs=[])
        yield ev("response.content_part.done", item_id=mid, output_index=0, content_index=0, part=part)
        output.append(_message(mid, reply.text))
        yield ev("response.output_item.done", output_index=0, item=output[-1])
    for call in _calls(reply):
        i = len(output)
        yield ev("response.output_item.added", output_index=i, item={**call, "arguments": "", "status": "in_progress"})
        yield ev("response.function_call_arguments.delta", item_id=call["id"], output_index=i, delta=call["arguments"])
        yield ev("response.function_call_arguments.done", item_id=call["id"], output_index=i,
                 arguments=call["arguments"], name=call["name"])
        output.append(call)
        yield ev("response.output_item.done", output_index=i, item=call)
    yield ev("response.completed", response=_response(rid, model, output, reply, info, created))
