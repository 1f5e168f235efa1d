"""OpenAI's request and response shapes: /v1/chat/completions and /v1/completions (the Responses
API is responses_api.py).

Each `parse_*` reads a body through a Fields record (fields.py: what is honoured, ignored,
translated or refused; docs/serve.md has the table) and gives a ChatCall; the `*_response` /
`*_chunks` functions give the replies back in OpenAI's form, streamed as the SDK's iterators read
them.
"""

from __future__ import annotations

import json
import time

from flashmoe.engine.runtime.sampling import SamplingParams

from .errors import APIError, expect
from .fields import Fields, Policy
from .generation import ChatCall, Reply

CHAT = Policy(
    honoured=frozenset(
        {
            "model",
            "messages",
            "stream",
            "stream_options",
            "max_tokens",
            "max_completion_tokens",
            "temperature",
            "top_p",
            "stop",
            "seed",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "response_format",
            "n",
            "top_k",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
            "logprobs",
            "top_logprobs",
            "reasoning_effort",
            "store",
            "modalities",
        }
    ),
    ignored=frozenset(
        {
            "metadata",
            "user",
            "service_tier",
            "prompt_cache_key",
            "safety_identifier",
            "verbosity",
            "prediction",
            "prompt_cache_retention",
        }
    ),
)
COMPLETION = Policy(
    honoured=frozenset(
        {
            "model",
            "prompt",
            "stream",
            "stream_options",
            "max_tokens",
            "temperature",
            "top_p",
            "stop",
            "seed",
            "n",
            "top_k",
            "min_p",
            "repetition_penalty",
            "echo",
            "logprobs",
            "frequency_penalty",
            "presence_penalty",
        }
    ),
    ignored=frozenset({"user", "metadata", "service_tier"}),
)
MESSAGE = Policy(
    honoured=frozenset({"role", "content", "name", "tool_calls", "tool_call_id"}),
    ignored=frozenset({"refusal", "annotations", "reasoning_content", "reasoning", "cache_control"}),
)
TOOL = Policy(honoured=frozenset({"type", "function", "defer_loading"}), ignored=frozenset({"cache_control"}))
FUNCTION = Policy(honoured=frozenset({"name", "description", "parameters", "strict"}))
# Reasoning effort onto the template's thinking switch: off below "low".
THINKING_OFF_EFFORTS = ("none", "minimal")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def sampling(body: dict, fields: Fields) -> SamplingParams:
    """temperature (default 1, as OpenAI's), top_p, seed, and the vLLM-style extras; what would
    change the result and is not implemented is refused."""
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            fields.refuse(f"{name} is not supported (use repetition_penalty)", name)
    if body.get("n") not in (None, 1):
        fields.refuse("n must be 1: flashmoe serve writes one choice", "n")
    if body.get("logprobs") not in (None, False, 0):
        fields.refuse("logprobs are not supported", "logprobs")
    if body.get("top_logprobs") not in (None, 0):
        fields.refuse("top_logprobs are not supported", "top_logprobs")
    try:
        get = lambda name, default: default if body.get(name) is None else body[name]  # noqa: E731  (null: the default)
        return SamplingParams(
            temperature=float(get("temperature", 1.0)),
            top_p=float(get("top_p", 1.0)),
            top_k=int(body.get("top_k") or 0),
            min_p=float(body.get("min_p") or 0.0),
            repetition_penalty=float(body.get("repetition_penalty") or 1.0),
            seed=body.get("seed"),
        )
    except (ValueError, TypeError) as e:
        fields.refuse(str(e))
        return SamplingParams()


def stops(value, name: str = "stop") -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise APIError(400, f"{name} must be a string or a list of strings", param=name)


def max_tokens(body: dict, *names: str, default: int) -> int:
    for name in names:
        if body.get(name) is not None:
            n = body[name]
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise APIError(400, f"{name} must be a positive integer", param=name)
            return n
    return default


def text_of(content, where: str, fields: Fields | None = None) -> str:
    """Message content: a string, or a list of text parts (an image or other part is refused:
    the models served here read text only)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "input_text", "output_text"):
                problem = (
                    f"{where}: content part of type {kind!r} is not supported: this model reads text only"
                    if kind
                    else f"{where}: content parts must be objects with a type"
                )
                if fields is None:
                    raise APIError(400, problem, param="messages")
                fields.refuse(problem, "messages")
                continue
            if fields is not None:
                for key in part:
                    if key not in ("type", "text"):
                        fields.ignore(f"{where}.content[{i}].{key}")
            out.append(part.get("text") or "")
        return "".join(out)
    raise APIError(400, f"{where}: content must be a string or a list of parts", param="messages")


def thinking_from_effort(effort, name: str, fields: Fields) -> bool | None:
    """reasoning effort onto the thinking switch: None (the template's default), False, True."""
    if effort is None:
        return None
    if effort not in EFFORTS:
        fields.refuse(f"{name} must be one of {', '.join(EFFORTS)}, got {effort!r}", name)
        return None
    if not fields.translate(name, "reasoning effort"):
        return None
    return effort not in THINKING_OFF_EFFORTS


def tool_defs(tools, fields: Fields) -> tuple[list[dict], dict[str, str]]:
    """The function tools as {"name", "description", "parameters"}, and the other tools (type
    "custom", ...), which are left out of the prompt and recorded: {name: type}."""
    if tools is None:
        return [], {}
    expect(tools, list, "tools")
    out, dropped = [], {}
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            fields.refuse(f"tools[{i}] must be an object", "tools")
            continue
        if t.get("type") != "function":
            kind = t.get("type")
            name = (t.get(kind) or {}).get("name") if isinstance(t.get(kind), dict) else t.get("name")
            dropped[str(name or kind)] = str(kind)
            fields.ignore(f"tools[{i}] (type {kind!r})", "only function tools are run here")
            continue
        fn = t.get("function")
        if not isinstance(fn, dict):
            fields.refuse(f"tools[{i}]: a function tool needs a 'function' object", "tools")
            continue
        fields.top(t, TOOL, f"tools[{i}]")
        fields.top(fn, FUNCTION, f"tools[{i}].function")
        if not isinstance(fn.get("name"), str):
            fields.refuse(f"tools[{i}]: a function needs a name", "tools")
            continue
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        out.append(
            fields.defer(
                {"name": fn["name"], "description": fn.get("description") or "", "parameters": params}, t, f"tools[{i}]"
            )
        )
    return out, dropped


def tool_choice(value, dropped: dict[str, str] | None = None):
    """ "auto" | "none" | "required" | {"name": NAME}; naming a tool this server does not run
    (a dropped one) is a 400."""
    if value is None or value in ("auto", "none", "required"):
        return value or "auto"
    if isinstance(value, dict) and value.get("type") in ("function", None):
        name = (value.get("function") or {}).get("name") or value.get("name")
        if isinstance(name, str):
            return {"name": name}
    if isinstance(value, dict) and value.get("type") == "allowed_tools":
        raise APIError(400, "tool_choice of type 'allowed_tools' is not supported", param="tool_choice")
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        kind = value["type"]
        name = (value.get(kind) or {}).get("name") if isinstance(value.get(kind), dict) else value.get("name")
        raise APIError(
            400,
            f"tool_choice names a tool of type {kind!r}{f' ({name!r})' if name else ''}: "
            "flashmoe serve runs function tools only",
            param="tool_choice",
        )
    raise APIError(
        400,
        "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
        param="tool_choice",
    )


def forced_name_check(choice, dropped: dict[str, str]) -> None:
    if isinstance(choice, dict) and choice["name"] in dropped:
        raise APIError(
            400,
            f"tool_choice names {choice['name']!r}, a tool of type {dropped[choice['name']]!r}: "
            "flashmoe serve runs function tools only",
            param="tool_choice",
        )


def response_format(value) -> tuple[bool, dict | None]:
    if value is None or value.get("type") == "text":
        return False, None
    if value.get("type") == "json_object":
        return True, None
    if value.get("type") == "json_schema":
        spec = value.get("json_schema") or {}
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise APIError(
                400, "response_format.json_schema.schema must be a JSON Schema object", param="response_format"
            )
        return True, schema
    raise APIError(400, f"response_format type {value.get('type')!r} is not supported", param="response_format")


def chat_messages(messages, fields: Fields) -> list[dict]:
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
            fields.refuse(f"{where}: role must be system, developer, user, assistant or tool", "messages")
            continue
        fields.top(m, MESSAGE, where)
        msg = {"role": role, "content": fields.attempt(text_of, m.get("content"), where, fields, default="")}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = []
            for c in m["tool_calls"]:
                fn = c.get("function") or {}
                args = fn.get("arguments")
                try:
                    args = json.loads(args) if isinstance(args, str) else (args or {})
                except json.JSONDecodeError:
                    fields.refuse(f"{where}: tool call arguments are not JSON", "messages")
                    args = {}
                msg["tool_calls"].append({"id": c.get("id") or "", "name": fn.get("name") or "", "arguments": args})
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id")
            if m.get("name"):
                msg["name"] = m["name"]
        out.append(msg)
    return out


def parse_chat(body: dict, fields: Fields, default_max: int) -> ChatCall:
    """The body as a ChatCall; each part is read even after another was refused (fields.attempt)."""
    fields.top(body, CHAT)
    if body.get("store"):
        fields.refuse("store: true: completions are not stored here", "store")
    if body.get("modalities") not in (None, ["text"]):
        fields.refuse("modalities: this model writes text only", "modalities")
    json_reply, schema = fields.attempt(response_format, body.get("response_format"), default=(False, None))
    tools, dropped = fields.attempt(tool_defs, body.get("tools"), fields, default=([], {}))
    choice = fields.attempt(tool_choice, body.get("tool_choice"), default="auto")
    fields.attempt(forced_name_check, choice, dropped)
    return ChatCall(
        messages=fields.attempt(chat_messages, body.get("messages"), fields, default=[]),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=body.get("parallel_tool_calls", True) is not False,
        response_schema=schema,
        json_reply=json_reply,
        max_tokens=fields.attempt(
            lambda: max_tokens(body, "max_completion_tokens", "max_tokens", default=default_max), default=default_max
        ),
        sampling=sampling(body, fields),
        stop=fields.attempt(stops, body.get("stop"), default=()),
        thinking=thinking_from_effort(body.get("reasoning_effort"), "reasoning_effort", fields),
        thinking_field="reasoning_effort",
    )


def parse_completion(body: dict, fields: Fields, default_max: int) -> ChatCall:
    fields.top(body, COMPLETION)
    if body.get("echo"):
        fields.refuse("echo is not supported", "echo")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise APIError(400, "prompt must be a string (one prompt per request)", param="prompt")
    return ChatCall(
        messages=[],
        prompt=prompt,
        max_tokens=max_tokens(body, "max_tokens", default=16),
        sampling=sampling(body, fields),
        stop=stops(body.get("stop")),
    )


# -- responses ------------------------------------------------------------------------------


def usage(reply: Reply) -> dict:
    d = reply.done
    return {
        "prompt_tokens": d.prompt_tokens,
        "completion_tokens": d.generation_tokens,
        "total_tokens": d.prompt_tokens + d.generation_tokens,
        "prompt_tokens_details": {"cached_tokens": d.reused_prompt_tokens},
    }


def conditions(reply: Reply, info) -> dict:
    """The flashmoe extension field: the conditions the figures were measured under."""
    d = reply.done
    return {
        "bits": d.bits,
        "experts_per_token": d.top_k,
        "trained_experts_per_token": info.trained_top_k or d.top_k,
        "experts": info.experts,
        "cache_state": d.cache_state,
        "hit_rate": round(d.hit_rate, 4),
        "bytes_read_per_token": round(d.bytes_per_token),
        "prefill_s": round(d.prefill_s, 4),
        "prompt_tok_per_s": round(d.prompt_tps, 2),
        "decode_tok_per_s": round(d.generation_tps, 2),
        "invalid_tool_calls": reply.invalid,
    }


def openai_tool_calls(reply: Reply, streaming: bool = False, start: int = 0) -> list[dict]:
    out = []
    for i, c in enumerate(reply.calls[start:], start):
        item = {
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        out.append({"index": i, **item} if streaming else item)
    return out


def chat_response(gen, model: str, rid: str, info) -> dict:
    reply = gen.reply
    message = {"role": "assistant", "content": reply.text if reply.text or not reply.calls else None}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if reply.calls:
        message["tool_calls"] = openai_tool_calls(reply)
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason, "logprobs": None}],
        "usage": usage(reply),
        "flashmoe": conditions(reply, info),
    }


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
    }


async def chat_chunks(gen, model: str, rid: str, info):
    """The SSE payloads of a streamed chat completion: the role, text deltas as they come, each
    call as it is written where the format allows (its id and name, then its arguments as they
    grow), the other calls once the reply is complete, the finish reason, and last a chunk with
    the usage and no choices."""
    yield chat_chunk(rid, model, {"role": "assistant", "content": ""})
    streamed = 0
    async for d in gen.deltas():
        if d.kind == "call":
            streamed += 1
            yield chat_chunk(
                rid,
                model,
                {
                    "tool_calls": [
                        {
                            "index": d.index,
                            "id": d.id,
                            "type": "function",
                            "function": {"name": d.name, "arguments": ""},
                        }
                    ]
                },
            )
        elif d.kind == "args":
            yield chat_chunk(rid, model, {"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]})
        elif d.kind in ("text", "reasoning"):
            key = "content" if d.kind == "text" else "reasoning_content"
            yield chat_chunk(rid, model, {key: d.text})
    reply = gen.reply
    if reply.invalid_text:  # the text of a call that failed: as the non-streamed reply has it
        yield chat_chunk(rid, model, {"content": reply.invalid_text})
    if len(reply.calls) > streamed:
        yield chat_chunk(rid, model, {"tool_calls": openai_tool_calls(reply, streaming=True, start=streamed)})
    yield chat_chunk(rid, model, {}, reply.finish_reason)
    yield {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage(reply),
        "flashmoe": conditions(reply, info),
    }


def completion_response(gen, model: str, rid: str, info) -> dict:
    reply = gen.reply
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": reply.text, "finish_reason": reply.finish_reason, "logprobs": None}],
        "usage": usage(reply),
        "flashmoe": conditions(reply, info),
    }


async def completion_chunks(gen, model: str, rid: str, info):
    async for d in gen.deltas():
        yield {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "text": d.text, "finish_reason": None, "logprobs": None}],
        }
    reply = gen.reply
    yield {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": "", "finish_reason": reply.finish_reason, "logprobs": None}],
        "usage": usage(reply),
        "flashmoe": conditions(reply, info),
    }
