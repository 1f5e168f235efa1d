"""OpenAI's Responses API, the subset coding agents use: POST /v1/responses with `input` as text
or items (messages, function_call, function_call_output, reasoning), `instructions`, function
tools, and streamed events. Nothing is stored, so `store: true` and `previous_response_id` are
refused by name; what else each field comes to is in RESPONSES and docs/serve.md."""

from __future__ import annotations

import json
import secrets
import time

from .errors import APIError
from .fields import Fields, Policy
from .generation import ChatCall, Reply
from .openai_api import (
    conditions,
    forced_name_check,
    max_tokens,
    response_format,
    sampling,
    text_of,
    thinking_from_effort,
    tool_choice,
)

RESPONSES = Policy(
    honoured=frozenset(
        {
            "model",
            "input",
            "instructions",
            "stream",
            "max_output_tokens",
            "temperature",
            "top_p",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "store",
            "text",
            "reasoning",
            "include",
            "previous_response_id",
            "conversation",
            "background",
            "top_logprobs",
        }
    ),
    ignored=frozenset(
        {
            "client_metadata",
            "metadata",
            "prompt_cache_key",
            "prompt_cache_retention",
            "service_tier",
            "safety_identifier",
            "user",
            "stream_options",
            "truncation",
        }
    ),
)
TEXT = Policy(honoured=frozenset({"format"}), ignored=frozenset({"verbosity"}))
REASONING = Policy(honoured=frozenset({"effort", "summary", "generate_summary"}))
ITEM = Policy(
    honoured=frozenset({"type", "role", "content", "call_id", "name", "arguments", "output"}),
    ignored=frozenset({"id", "status"}),
)
FUNCTION = Policy(
    honoured=frozenset({"type", "name", "description", "parameters", "strict", "defer_loading"}),
    ignored=frozenset({"cache_control"}),
)
SUMMARIES = ("auto", "concise", "detailed", "none")
# include values about reasoning we do not encrypt, or tools we never run: they change nothing.
IGNORED_INCLUDES = (
    "reasoning.encrypted_content",
    "web_search_call.action.sources",
    "web_search_call.results",
    "file_search_call.results",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "message.input_image.image_url",
)


def _input(body: dict, fields: Fields) -> list[dict]:
    out: list[dict] = []
    if body.get("instructions"):
        out.append({"role": "system", "content": text_of(body["instructions"], "instructions", fields)})
    items = body.get("input")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError(400, "input must be a string or a non-empty list of items", param="input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            fields.refuse(f"{where} must be an object", "input")
            continue
        kind = item.get("type", "message")
        if kind == "reasoning":
            fields.ignore(f"{where} (type 'reasoning')", "earlier reasoning is left out, as templates do")
            continue
        fields.top(item, ITEM, where)
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role")
            if role not in ("system", "user", "assistant"):
                fields.refuse(f"{where}: role must be system, developer, user or assistant", "input")
                continue
            out.append(
                {"role": role, "content": fields.attempt(text_of, item.get("content"), where, fields, default="")}
            )
        elif kind == "function_call":
            try:
                args = json.loads(item.get("arguments") or "{}")
            except json.JSONDecodeError:
                fields.refuse(f"{where}: arguments are not JSON", "input")
                continue
            call = {"id": item.get("call_id") or "", "name": item.get("name") or "", "arguments": args}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": output if isinstance(output, str) else text_of(output, where, fields),
                }
            )
        else:
            fields.refuse(
                f"{where}: item type {kind!r} is not supported"
                + (" (nothing is stored here: send the items themselves)" if kind == "item_reference" else ""),
                "input",
            )
    return out


def _tools(tools, fields: Fields) -> tuple[list[dict], dict[str, str]]:
    out, dropped = [], {}
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict):
            fields.refuse(f"tools[{i}] must be an object", "tools")
            continue
        if t.get("type") != "function":
            dropped[str(t.get("name") or t.get("type"))] = str(t.get("type"))
            fields.ignore(f"tools[{i}] (type {t.get('type')!r})", "only function tools are run here")
            continue
        fields.top(t, FUNCTION, f"tools[{i}]")
        if not isinstance(t.get("name"), str):
            fields.refuse(f"tools[{i}]: a function tool needs a name", "tools")
            continue
        out.append(
            fields.defer(
                {
                    "name": t["name"],
                    "description": t.get("description") or "",
                    "parameters": t.get("parameters") or {"type": "object", "properties": {}},
                },
                t,
                f"tools[{i}]",
            )
        )
    return out, dropped


def _tool_choice(choice, dropped: dict[str, str]):
    """tool_choice in the Responses API's form (a function named at the top level)."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    elif isinstance(choice, dict) and choice.get("type") in dropped.values():
        raise APIError(
            400,
            f"tool_choice names a tool of type {choice['type']!r}: flashmoe serve runs function tools only",
            param="tool_choice",
        )
    choice = tool_choice(choice)
    forced_name_check(choice, dropped)
    return choice


def parse_responses(body: dict, fields: Fields, default_max: int) -> ChatCall:
    """The body as a ChatCall; each part is read even after another was refused (fields.attempt)."""
    fields.top(body, RESPONSES)
    if body.get("store"):
        fields.refuse("store: true: responses are not stored here; send store: false and the whole input", "store")
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            fields.refuse(f"{name}: nothing is stored here; send the whole conversation as input", name)
    if body.get("background"):
        fields.refuse("background: true is not supported (stream instead)", "background")
    for value in body.get("include") or []:
        if value in IGNORED_INCLUDES:
            fields.ignore(f"include {value}")
        else:
            fields.refuse(f"include {value!r} is not supported", "include")
    text = body.get("text") or {}
    fields.top(text, TEXT, "text")
    fmt = text.get("format")
    if fmt is not None and fmt.get("type") == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
    json_reply, schema = fields.attempt(response_format, fmt, default=(False, None))
    reasoning = body.get("reasoning") or {}
    fields.top(reasoning, REASONING, "reasoning")
    summary = reasoning.get("summary") or reasoning.get("generate_summary")
    if summary is not None and summary not in SUMMARIES:
        fields.refuse(f"reasoning.summary must be one of {', '.join(SUMMARIES)}", "reasoning")
    tools, dropped = _tools(body.get("tools"), fields)
    choice = fields.attempt(_tool_choice, body.get("tool_choice"), dropped, default="auto")
    return ChatCall(
        messages=fields.attempt(_input, body, fields, default=[]),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=body.get("parallel_tool_calls", True) is not False,
        response_schema=schema,
        json_reply=json_reply,
        max_tokens=fields.attempt(
            lambda: max_tokens(body, "max_output_tokens", default=default_max), default=default_max
        ),
        sampling=sampling(body, fields),
        summary=summary not in (None, "none"),
        thinking=thinking_from_effort(reasoning.get("effort"), "reasoning.effort", fields),
        thinking_field="reasoning.effort",
    )


def _usage(reply: Reply) -> dict:
    d = reply.done
    return {
        "input_tokens": d.prompt_tokens,
        "output_tokens": d.generation_tokens,
        "total_tokens": d.prompt_tokens + d.generation_tokens,
        "input_tokens_details": {"cached_tokens": d.reused_prompt_tokens},
        "output_tokens_details": {"reasoning_tokens": 0},
    }


def _message(mid: str, text: str, status: str = "completed") -> dict:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else [],
    }


def _reasoning(rid: str, text: str, summary: bool) -> dict:
    """A reasoning item: the model's reasoning as its summary when one was asked for, else as content."""
    item = {"id": rid, "type": "reasoning", "summary": []}
    if summary:
        item["summary"] = [{"type": "summary_text", "text": text}]
    else:
        item["content"] = [{"type": "reasoning_text", "text": text}]
    return item


def _call_item(c, item_id: str | None = None) -> dict:
    return {
        "id": item_id or f"fc_{secrets.token_hex(8)}",
        "type": "function_call",
        "call_id": c.id,
        "name": c.name,
        "arguments": json.dumps(c.arguments, ensure_ascii=False),
        "status": "completed",
    }


def _status(reply: Reply | None) -> str:
    if reply is None:
        return "in_progress"
    return "incomplete" if reply.done.reason in ("length", "context") and not reply.calls else "completed"


def _response(rid: str, model: str, output: list, reply: Reply | None, info, created: int) -> dict:
    status = _status(reply)
    out = {
        "id": rid,
        "object": "response",
        "created_at": created,
        "model": model,
        "output": output,
        "status": status,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
    }
    if reply is not None:
        out["usage"] = _usage(reply)
        out["flashmoe"] = conditions(reply, info)
    return out


def response(gen, model: str, rid: str, info) -> dict:
    reply, summary = gen.reply, gen.call.summary
    output = [_reasoning(f"rs_{secrets.token_hex(8)}", reply.reasoning, summary)] if reply.reasoning else []
    output += [_message(f"msg_{secrets.token_hex(8)}", reply.text)] if reply.text else []
    output += [_call_item(c) for c in reply.calls]
    return _response(rid.replace("chatcmpl-", "resp_"), model, output, reply, info, int(time.time()))


async def events(gen, model: str, rid: str, info):
    """The streamed events, each with its sequence_number, as the SDK's event types read them:
    one output item at a time (reasoning, the message, each call), closed before the next opens;
    `response.incomplete` last when the reply ran out of tokens, else `response.completed`."""
    rid = rid.replace("chatcmpl-", "resp_")
    summary = gen.call.summary
    created, seq = int(time.time()), 0
    output: list[dict] = []
    current: dict | None = None  # the item open now: {"kind", "id", "text", "index"}

    def ev(kind: str, **fields) -> dict:
        nonlocal seq
        seq += 1
        return {"type": kind, "sequence_number": seq - 1, **fields}

    def close():
        """The events that close the open item (its final form goes into `output`)."""
        nonlocal current
        c, current = current, None
        if c is None:
            return
        i, text = c["index"], c["text"]
        if c["kind"] == "reasoning":
            item = _reasoning(c["id"], text, summary)
            if summary:
                yield ev(
                    "response.reasoning_summary_text.done", item_id=c["id"], output_index=i, summary_index=0, text=text
                )
                yield ev(
                    "response.reasoning_summary_part.done",
                    item_id=c["id"],
                    output_index=i,
                    summary_index=0,
                    part={"type": "summary_text", "text": text},
                )
            else:
                yield ev("response.reasoning_text.done", item_id=c["id"], output_index=i, content_index=0, text=text)
        elif c["kind"] == "message":
            item = _message(c["id"], text)
            yield ev(
                "response.output_text.done", item_id=c["id"], output_index=i, content_index=0, text=text, logprobs=[]
            )
            yield ev(
                "response.content_part.done", item_id=c["id"], output_index=i, content_index=0, part=item["content"][0]
            )
        else:
            item = {
                "id": c["id"],
                "type": "function_call",
                "call_id": c["call_id"],
                "name": c["name"],
                "arguments": text,
                "status": "completed",
            }
            yield ev(
                "response.function_call_arguments.done", item_id=c["id"], output_index=i, arguments=text, name=c["name"]
            )
        output.append(item)
        yield ev("response.output_item.done", output_index=i, item=item)

    def open_item(kind: str, **extra):
        nonlocal current
        i = len(output)
        prefix = {"reasoning": "rs", "message": "msg", "call": "fc"}[kind]
        current = {"kind": kind, "id": f"{prefix}_{secrets.token_hex(8)}", "text": "", "index": i, **extra}
        if kind == "reasoning":
            yield ev(
                "response.output_item.added",
                output_index=i,
                item={"id": current["id"], "type": "reasoning", "summary": []},
            )
            if summary:
                yield ev(
                    "response.reasoning_summary_part.added",
                    item_id=current["id"],
                    output_index=i,
                    summary_index=0,
                    part={"type": "summary_text", "text": ""},
                )
        elif kind == "message":
            yield ev("response.output_item.added", output_index=i, item=_message(current["id"], "", "in_progress"))
            yield ev(
                "response.content_part.added",
                item_id=current["id"],
                output_index=i,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": []},
            )
        else:
            yield ev(
                "response.output_item.added",
                output_index=i,
                item={
                    "id": current["id"],
                    "type": "function_call",
                    "call_id": extra["call_id"],
                    "name": extra["name"],
                    "arguments": "",
                    "status": "in_progress",
                },
            )

    yield ev("response.created", response=_response(rid, model, [], None, info, created))
    yield ev("response.in_progress", response=_response(rid, model, [], None, info, created))
    async for d in gen.deltas():
        if d.kind == "call":
            for e in close():
                yield e
            for e in open_item("call", call_id=d.id, name=d.name):
                yield e
            continue
        if d.kind == "call_end":
            for e in close():
                yield e
            continue
        kind = {"text": "message", "reasoning": "reasoning", "args": "call"}[d.kind]
        if current is None or current["kind"] != kind:
            for e in close():
                yield e
            for e in open_item(kind):
                yield e
        current["text"] += d.text
        i, item_id = current["index"], current["id"]
        if kind == "message":
            yield ev(
                "response.output_text.delta",
                item_id=item_id,
                output_index=i,
                content_index=0,
                delta=d.text,
                logprobs=[],
            )
        elif kind == "reasoning" and summary:
            yield ev(
                "response.reasoning_summary_text.delta", item_id=item_id, output_index=i, summary_index=0, delta=d.text
            )
        elif kind == "reasoning":
            yield ev("response.reasoning_text.delta", item_id=item_id, output_index=i, content_index=0, delta=d.text)
        else:
            yield ev("response.function_call_arguments.delta", item_id=item_id, output_index=i, delta=d.text)
    reply = gen.reply
    if reply.invalid_text:  # the text of a call that failed: as the non-streamed reply has it
        if current is None or current["kind"] != "message":
            for e in close():
                yield e
            for e in open_item("message"):
                yield e
        current["text"] += reply.invalid_text
        yield ev(
            "response.output_text.delta",
            item_id=current["id"],
            output_index=current["index"],
            content_index=0,
            delta=reply.invalid_text,
            logprobs=[],
        )
    for e in close():
        yield e
    streamed = sum(1 for o in output if o["type"] == "function_call")
    for c in reply.calls[streamed:]:
        item = _call_item(c)
        i = len(output)
        yield ev("response.output_item.added", output_index=i, item={**item, "arguments": "", "status": "in_progress"})
        yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=i, delta=item["arguments"])
        yield ev(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=i,
            arguments=item["arguments"],
            name=item["name"],
        )
        output.append(item)
        yield ev("response.output_item.done", output_index=i, item=item)
    final = _response(rid, model, output, reply, info, created)
    yield ev("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)
