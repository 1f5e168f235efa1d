"""What one request may cost before it is refused, decided here and nowhere else.

One request used to freeze every client (issue 41): checking it ran on the event loop, and the
C code it reached (Python's `re`, the tokenizer, the JSON decoder) holds the GIL, so moving the
work to a thread is not enough. Each step a client's bytes reach is bounded instead:

- the body: a JSON content type (a web page's `text/plain` or form POST is refused before it is
  read), at most `max_body` bytes, counted as it streams (a Content-Length or chunked), and
  all of it within `read_timeout` seconds (a client that trickles it is cut off);
- the JSON: at most `max_values` values, nested at most `max_depth` deep, its text real text (a
  lone surrogate such as `\\ud800` is refused; it broke every later step). Decoding holds the GIL
  in one C call (a 200,000-value list: 40 ms alone, hundreds on a busy machine), so a body that
  may hold more than `max_values` values (its commas and brackets say) is decoded first in a
  process of its own (`_checker`); only a body within the limit is decoded here, off the loop;
- the schemas (tools' parameters, a reply's JSON schema): at most `schema_nodes` values in all and
  `schema_depth` deep, each one passing safe_schema.check_schema (the metaschema, patterns that
  compile, local references that do not loop);
- the prompt: its characters counted against the context before anything is tokenized (a text
  of more than `context x longest token` characters cannot fit); a rendered prompt of more than
  LONG_PROMPT_BYTES counted in tokens before its ids are made (a list of millions of ids is made
  with the GIL held).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from .errors import APIError

MAX_BODY = 4 << 20  # a 256k-token conversation and its tools are about 1 MB of JSON
READ_TIMEOUT_S = 30.0
LONG_PROMPT_BYTES = 1 << 20  # below this, a prompt's ids (at most one a byte) are made in a few ms
DRAIN_BYTES = 64 << 20  # a body past the cap is read and dropped up to this, so the client hears the 413


@dataclass(frozen=True)
class Limits:
    max_body: int = MAX_BODY
    read_timeout: float = READ_TIMEOUT_S
    max_depth: int = 64  # the agents' recorded bodies nest at most 16 deep (tests/fixtures/agents)
    max_values: int = 50_000  # decoded in about 10 ms; Claude Code's 17 tools are 665 values
    schema_nodes: int = 10_000  # Claude Code's 17 tools: 665 values in all
    schema_depth: int = 32  # Codex's deepest: 10


# -- the body -------------------------------------------------------------------------------------


def is_json(content_type: str | None) -> bool:
    """application/json, with parameters or not (what every SDK sends). Anything else, absence
    included, is what a web page can send another origin without asking first (text/plain, a
    form, a Blob without a type)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json"


async def read_json(request, limits: Limits):
    """The request's JSON body, within every limit above; APIError otherwise."""
    if not is_json(request.headers.get("content-type")):
        await _drain(request, limits)
        given = request.headers.get("content-type")
        raise APIError(
            415,
            f"the request body must be JSON sent as Content-Type: application/json"
            f"{f', not {given[:80]!r}' if given else ' (none was given)'}",
        )
    raw = await read_body(request, limits)
    if most_values(raw) > limits.max_values:
        await asyncio.to_thread(_check_elsewhere, raw, limits)
    return await asyncio.to_thread(parse_json, raw, limits.max_depth, limits.max_values)


def most_values(raw: bytes) -> int:
    """An upper bound of the JSON values in `raw`, in a few C passes: each value but a
    container's first follows a comma (commas inside strings only raise the bound)."""
    return raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1


_pool_lock = threading.Lock()
_pool = None  # the checking process: one, started on the first body that needs it


def _check_elsewhere(raw: bytes, limits: Limits) -> None:
    """parse_json run in the checking process (a thread waits for it here); its APIError
    raised here. A body it passes holds at most `max_values` values."""
    global _pool
    with _pool_lock:
        if _pool is None:  # spawn: a fork of a process holding the engine's threads is unsafe
            _pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        pool = _pool
    try:
        refused = pool.submit(_checker, raw, limits.max_depth, limits.max_values).result()
    except BrokenProcessPool:
        with _pool_lock:
            if _pool is pool:
                _pool = None
        raise APIError(500, "the request body could not be checked (the checking process ended)") from None
    if refused is not None:
        raise APIError(*refused)


def _checker(raw: bytes, max_depth: int, max_values: int):
    """(status, message) when parse_json refuses `raw`, else None. Runs in the checking process."""
    try:
        parse_json(raw, max_depth, max_values)
    except APIError as e:
        return e.status, e.message
    return None


async def read_body(request, limits: Limits) -> bytes:
    from starlette.requests import ClientDisconnect

    length = request.headers.get("content-length")
    if length is not None and (not length.strip().isdigit() or int(length) > limits.max_body):
        await _drain(request, limits)
        raise _too_large(limits)
    chunks: list[bytes] = []
    size = 0

    async def read() -> bool:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body:
                return False
            chunks.append(chunk)
        return True

    try:
        whole = await asyncio.wait_for(read(), limits.read_timeout)
    except asyncio.TimeoutError:
        raise APIError(
            408, f"the request body did not arrive within {limits.read_timeout:g} s (--read-timeout)"
        ) from None
    except ClientDisconnect:
        raise APIError(400, "the client went away while sending the request body") from None
    if not whole:
        await _drain(request, limits)
        raise _too_large(limits)
    return b"".join(chunks)


def _too_large(limits: Limits) -> APIError:
    return APIError(413, f"the request body is larger than {limits.max_body:,} bytes (--max-body)")


async def _drain(request, limits: Limits) -> None:
    """Read what is left of a refused body (up to DRAIN_BYTES, within the read timeout) and drop
    it: a client still sending when the connection closes gets a reset, not the answer."""
    from starlette.requests import ClientDisconnect

    async def drain():
        seen = 0
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > DRAIN_BYTES:
                return

    try:
        await asyncio.wait_for(drain(), limits.read_timeout)
    except (asyncio.TimeoutError, ClientDisconnect, RuntimeError):  # (RuntimeError: the stream was consumed)
        pass


def parse_json(raw: bytes, max_depth: int, max_values: int = Limits.max_values):
    """The body decoded and walked once (no recursion: the nesting is the client's). CPU work:
    call it off the event loop."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise APIError(400, "the request body is not JSON this server reads: it nests too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not JSON: {e}") from None
    # The path of a value is built only for a message: a 200,000-value list walked with a path
    # string for each took the GIL for long enough to hold /health up (hundreds of ms on a busy
    # machine). `_yield` lets the event loop in between.
    stack = [(value, 1, None, "")]
    n = 0
    while stack:
        item, depth, parent, key = stack.pop()
        n += 1
        if not n % YIELD_EVERY:
            _yield()
        if n > max_values:
            raise APIError(
                400,
                f"the request body holds more than {max_values:,} JSON values; "
                "send fewer or smaller tools and messages",
            )
        if depth > max_depth:
            raise APIError(
                400, f"the request body nests more than {max_depth} deep (at {_path(parent, key)[:200] or 'the top'})"
            )
        if isinstance(item, dict):
            for k, sub in item.items():
                if isinstance(k, str) and not k.isascii():
                    _text(k, _path(parent, key) + "." + k[:40])
                stack.append((sub, depth + 1, (parent, key), k))
        elif isinstance(item, list):
            here = (parent, key)
            stack.extend((sub, depth + 1, here, i) for i, sub in enumerate(item))
        elif isinstance(item, str) and not item.isascii():
            _text(item, _path(parent, key))
    return value


YIELD_EVERY = 1024  # values walked between two GIL releases (about a millisecond of work)


def _yield() -> None:
    time.sleep(0)  # lets go of the GIL: the event loop's thread answers in between


def _path(parent, key) -> str:
    """`a.b[3].c` from the (parent, key) chain parse_json keeps (the top: parent None)."""
    parts = []
    while parent is not None:
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
        parent, key = parent
    return "".join(reversed(parts)).lstrip(".")


def _text(s: str, where: str) -> None:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(
                400, f"{where[:200] or 'the body'}: a lone surrogate ({s[e.start]!r}) is not text; send UTF-8"
            ) from None


# -- the schemas ---------------------------------------------------------------------------------


def check_schemas(call, limits: Limits) -> None:
    """The tools' parameter schemas and the reply's JSON schema, before anything is built from
    them: their size, their depth, and safe_schema.check_schema."""
    from flashmoe.tools.safe_schema import SchemaProblem, check_schema

    named = [
        (f"tools[{i}] ({str(t.get('name'))[:64]!r})", "tools", t.get("parameters")) for i, t in enumerate(call.tools)
    ]
    if call.response_schema is not None:
        named.append(("the JSON schema of response_format", "response_format", call.response_schema))
    total = 0
    for what, param, schema in named:
        nodes, depth = _size(schema)
        total += nodes
        if depth > limits.schema_depth:
            raise APIError(
                400, f"{what}: the schema nests {depth} deep; at most {limits.schema_depth} is taken", param=param
            )
        if total > limits.schema_nodes:
            raise APIError(
                400,
                f"the schemas of this request hold more than {limits.schema_nodes:,} values "
                f"(at {what}); send fewer or smaller tools",
                param=param,
            )
    for what, param, schema in named:
        if not isinstance(schema, dict):
            continue  # (the tools' own checks name it)
        try:
            check_schema(schema)
        except SchemaProblem as e:
            raise APIError(
                400, f"{what}: invalid schema{' at ' + e.path if e.path else ''}: {e.message}", param=param
            ) from None


def _size(value) -> tuple[int, int]:
    """(values, depth) of a JSON value, counted without recursion."""
    nodes, deepest, stack = 0, 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        nodes += 1
        if not nodes % YIELD_EVERY:
            _yield()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
            nodes += len(item)  # the keys
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return nodes, deepest


# -- the prompt ----------------------------------------------------------------------------------


def prompt_chars(call) -> int:
    """The characters of the prompt's text before the chat template adds its own: at most what
    the template renders (a lower bound, so the check below never refuses a prompt that fits)."""
    if call.prompt is not None:
        return len(call.prompt)
    n = 0
    for m in call.messages:
        content = m.get("content")
        if isinstance(content, str):
            n += len(content)
        for c in m.get("tool_calls") or ():
            n += len(json.dumps(c.get("arguments"), ensure_ascii=False))
    return n


def check_prompt_chars(call, context: int | None, token_chars: int | None, truncate: str) -> None:
    """Refuse a prompt whose characters alone are more than the context can hold (at most
    `token_chars` characters a token), before a tokenizer holds the GIL on megabytes of it. With
    --truncate-prompt left a long prompt is cut, not refused: then the body limit bounds the work."""
    if not context or not token_chars or truncate == "left":
        return
    chars = prompt_chars(call)
    if chars > context * token_chars:
        raise APIError(
            400,
            f"the prompt is {chars:,} characters, more than the model's context of {context:,} "
            f"tokens can hold (a token is at most {token_chars} characters); shorten it",
        )


def check_prompt_tokens(gen, truncate: str) -> None:
    """Refuse a long prompt that is more tokens than the context by counting them first, before
    the engine (or count_prompt) makes their ids. A prompt has at most one token a byte, so one
    of at most max(context, LONG_PROMPT_BYTES) bytes needs no count; a longer one that fits is
    encoded twice (a prompt of more than a megabyte: a context of some 250,000 tokens)."""
    loaded = getattr(gen.engine, "loaded", None)
    tok = getattr(loaded, "tokenizer", None)
    if tok is None or truncate == "left":
        return
    from flashmoe.engine.errors import FlashMoEError
    from flashmoe.engine.runtime import generate

    context, what = generate.context_of(loaded)
    request = gen.request
    try:
        text = (
            request.prompt
            if request.prompt is not None
            else tok.apply_chat_template(
                request.messages, tools=request.tools, add_generation_prompt=True, **request.template_kwargs
            )
        )
    except (FlashMoEError, ValueError) as e:
        raise APIError(400, (str(e).strip().splitlines() or ["the prompt cannot be rendered"])[0]) from None
    if not context or len(text.encode("utf-8", "surrogatepass")) <= max(context, LONG_PROMPT_BYTES):
        return
    n = tok.count(text)
    if n > context:
        what = what or f"the model's context of {context} tokens"
        raise APIError(
            400,
            f"the prompt is {n:,} tokens, longer than {what}; shorten it, or start the server with "
            "--truncate-prompt left to drop the oldest tokens",
        )
