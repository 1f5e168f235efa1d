"""OpenAI's request and response shapes: /v1/chat/completions, /v1/completions, /v1/responses.

Each `parse_*` checks a body and gives a ChatCall (an unknown or unsupported field is an
APIError naming it); the `*_response` / `*_chunks` functions give the replies back in OpenAI's
form, streamed as the SDK's iterators read them.
"""
from __future__ import annotations

import json
import time

from flashmoe.engine.runtime.sampling import SamplingParams

from .errors import APIError, expect, unknown_fields
from .generation import ChatCall, Reply

CHAT_FIELDS = {"model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens",
               "temperature", "top_p", "stop", "seed", "tools", "tool_choice", "parallel_tool_calls",
               "response_format", "n", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
               "presence_penalty", "logprobs"}
COMPLETION_FIELDS = {"model", "prompt", "stream", "stream_options", "max_tokens", "temperature", "top_p", "stop",
                     "seed", "n", "top_k", "min_p", "repetition_penalty", "echo", "logprobs"}
RESPONSES_FIELDS = {"model", "input", "instructions", "stream", "max_output_tokens", "temperature", "top_p",
                    "tools", "tool_choice", "parallel_tool_calls", "store", "text"}


def sampling(body: dict) -> SamplingParams:
    """temperature (default 1, as OpenAI's), top_p, seed, and the vLLM-style extras."""
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise APIError(400, f"{name} is not supported (use repetition_penalty)", param=name)
    if body.get("n") not in (None, 1):
        raise APIError(400, "n must be 1: flashmoe serve writes one choice", param="n")
    if body.get("logprobs") not in (None, False):
        raise APIError(400, "logprobs are not supported", param="logprobs")
    try:
        get = lambda name, default: default if body.get(name) is None else body[name]  # noqa: E731  (null: the default)
        return SamplingParams(temperature=float(get("temperature", 1.0)), top_p=float(get("top_p", 1.0)),
                              top_k=int(body.get("top_k") or 0), min_p=float(body.get("min_p") or 0.0),
                              repetition_penalty=float(body.get("repetition_penalty") or 1.0),
                              seed=body.get("seed"))
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e)) from None


def stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise APIError(400, "stop must be a string or a list of strings", param="stop")


def max_tokens(body: dict, *names: str, default: int) -> int:
    for name in names:
        if body.get(name) is not None:
            n = body[name]
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise APIError(400, f"{name} must be a positive integer", param=name)
            return n
    return default


def text_of(content, where: str) -> str:
    """Message content: a string, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "input_text", "output_text"):
                raise APIError(400, f"{where}: content part of type {kind!r} is not supported (text only)",
                               param="messages")
            out.append(part.get("text") or "")
        return "".join(out)
    raise APIError(400, f"{where}: content must be a string or a list of parts", param="messages")


def tool_defs(tools) -> list[dict]:
    if tools is None:
        return []
    expect(tools, list, "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function", t), dict):
            raise APIError(400, f"tools[{i}]: only type 'function' tools are supported", param="tools")
        fn = t.get("function", t)
        unknown_fields(fn, {"name", "description", "parameters", "strict", "type"}, f"tools[{i}]")
        if not isinstance(fn.get("name"), str):
            raise APIError(400, f"tools[{i}]: a function needs a name", param="tools")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        out.append({"name": fn["name"], "description": fn.get("description") or "", "parameters": params})
    return out


def tool_choice(value):
    if value is None or value in ("auto", "none", "required"):
        return value or "auto"
    if isinstance(value, dict) and value.get("type") in ("function", None):
        name = (value.get("function") or {}).get("name") or value.get("name")
        if isinstance(name, str):
            return {"name": name}
    raise APIError(400, "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', "
                        "'function': {'name': ...}}", param="tool_choice")


def response_format(value) -> tuple[bool, dict | None]:
    if value is None or value.get("type") == "text":
        return False, None
    if value.get("type") == "json_object":
        return True, None
    if value.get("type") == "json_schema":
        spec = value.get("json_schema") or {}
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise APIError(400, "response_format.json_schema.schema must be a JSON Schema object",
                           param="response_format")
        return True, schema
    raise APIError(400, f"response_format type {value.get('type')!r} is not supported", param="response_format")


def chat_messages(messages) -> list[dict]:
    expect(messages, list, "messages")
    if not messages:
        raise APIError(400, "messages must not be empty", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise APIError(400, f"{where}: role must be system, developer, user, assistant or tool", param="messages")
        unknown_fields(m, {"role", "content", "name", "tool_calls", "tool_call_id", "refusal"}, where)
        msg = {"role": role, "content": text_of(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = []
            for c in m["tool_calls"]:
                fn = c.get("function") or {}
                args = fn.get("arguments")
                try:
                    args = json.loads(args) if isinstance(args, str) else (args or {})
                except json.JSONDecodeError:
                    raise APIError(400, f"{where}: tool call arguments are not JSON", param="messages") from None
                msg["tool_calls"].append({"id": c.get("id") or "", "name": fn.get("name") or "", "arguments": args})
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id")
            if m.get("name"):
                msg["name"] = m["name"]
        out.append(msg)
    return out


def parse_chat(body: dict, default_max: int) -> ChatCall:
    unknown_fields(body, CHAT_FIELDS)
    json_reply, schema = response_format(body.get("response_format"))
    return ChatCall(messages=chat_messages(body.get("messages")), tools=tool_defs(body.get("tools")),
                    tool_choice=tool_choice(body.get("tool_choice")),
                    parallel_tool_calls=body.get("parallel_tool_calls", True) is not False,
                    response_schema=schema, json_reply=json_reply,
                    max_tokens=max_tokens(body, "max_completion_tokens", "max_tokens", default=default_max),
                    sampling=sampling(body), stop=stops(body))


def parse_completion(body: dict, default_max: int) -> ChatCall:
    unknown_fields(body, COMPLETION_FIELDS)
    if body.get("echo"):
        raise APIError(400, "echo is not supported", param="echo")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise APIError(400, "prompt must be a string (one prompt per request)", param="prompt")
    return ChatCall(messages=[], prompt=prompt, max_tokens=max_tokens(body, "max_tokens", default=16),
                    sampling=sampling(body), stop=stops(body))


# -- responses ------------------------------------------------------------------------------

def usage(reply: Reply) -> dict:
    d = reply.done
    return {"prompt_tokens": d.prompt_tokens, "completion_tokens": d.generation_tokens,
            "total_tokens": d.prompt_tokens + d.generation_tokens,
            "prompt_tokens_details": {"cached_tokens": d.reused_prompt_tokens}}


def conditions(reply: Reply, info) -> dict:
    """The flashmoe extension field: the conditions the figures were measured under."""
    d = reply.done
    return {"bits": d.bits, "experts_per_token": d.top_k, "trained_experts_per_token": info.trained_top_k or d.top_k, "experts": info.experts, "cache_state": d.cache_state,
            "hit_rate": round(d.hit_rate, 4), "bytes_read_per_token": round(d.bytes_per_token),
            "prefill_s": round(d.prefill_s, 4), "prompt_tok_per_s": round(d.prompt_tps, 2),
            "decode_tok_per_s": round(d.generation_tps, 2), "invalid_tool_calls": reply.invalid}


def openai_tool_calls(reply: Reply, streaming: bool = False) -> list[dict]:
    out = []
    for i, c in enumerate(reply.calls):
        item = {"id": c.id, "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
        out.append({"index": i, **item} if streaming else item)
    return out


def chat_response(reply: Reply, model: str, rid: str, info) -> dict:
    message = {"role": "assistant", "content": reply.text if reply.text or not reply.calls else None}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if reply.calls:
        message["tool_calls"] = openai_tool_calls(reply)
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason, "logprobs": None}],
            "usage": usage(reply), "flashmoe": conditions(reply, info)}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}


async def chat_chunks(gen, model: str, rid: str, info):
    """The SSE payloads of a streamed chat completion: the role, text deltas as they come, the
    calls once the reply is complete (they are parsed and validated whole), the finish reason,
    and last a chunk with the usage and no choices."""
    yield chat_chunk(rid, model, {"role": "assistant", "content": ""})
    async for d in gen.deltas():
        key = "content" if d.kind == "text" else "reasoning_content"
        yield chat_chunk(rid, model, {key: d.text})
    reply = gen.reply
    if reply.invalid:  # the text of a call that failed: as the non-streamed reply has it
        yield chat_chunk(rid, model, {"content": "".join(x["raw"] for x in reply.invalid)})
    if reply.calls:
        yield chat_chunk(rid, model, {"tool_calls": openai_tool_calls(reply, streaming=True)})
    yield chat_chunk(rid, model, {}, reply.finish_reason)
    yield {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
           "choices": [], "usage": usage(reply), "flashmoe": conditions(reply, info)}


def completion_response(reply: Reply, model: str, rid: str, info) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": reply.text, "finish_reason": reply.finish_reason, "logprobs": None}],
            "usage": usage(reply), "flashmoe": conditions(reply, info)}


async def completion_chunks(gen, model: str, rid: str, info):
    async for d in gen.deltas():
        yield {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
               "choices": [{"index": 0, "text": d.text, "finish_reason": None, "logprobs": None}]}
    reply = gen.reply
    yield {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
           "choices": [{"index": 0, "text": "", "finish_reason": reply.finish_reason, "logprobs": None}],
           "usage": usage(reply), "flashmoe": conditions(reply, info)}
