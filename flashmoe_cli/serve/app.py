"""The ASGI app: routes, the API key, the bounded queue, disconnects, keepalives, /health and /metrics.

One engine serves every client: requests wait their turn on its thread (engine.py), at most
`max_queue` at a time (in flight or waiting); past that a request is refused at once (HTTP 429
for OpenAI routes, 529 overloaded for Anthropic's), so a client never waits without knowing.
A client that goes away cancels its generation (the engine checks between tokens). A request is
read, checked and, when streamed, its prompt counted before anything is sent (`_prepare`, off
the event loop): one that cannot run is an HTTP error, never a 200 that ends in an error event.
What a request may cost (its body, its schemas, its prompt) is bounded in limits.py; its Host is
checked against the bound address (hosts.py); its key says its tenant, whose prompt caches are
the only ones it reuses (keys.py).
A stream that has nothing to say for `keepalive_s` (a long prefill, a call being written) sends
a keepalive: Anthropic's `ping` event, an SSE comment for OpenAI's routes. Every error, from a
route or from Starlette (404, 405, ...), is JSON in the calling API's shape.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import anthropic_api, openai_api, responses_api
from .errors import APIError
from .fields import Fields
from .hosts import HostCheck
from .keys import matching_key, tenant as tenant_of
from .limits import Limits, check_prompt_chars, check_prompt_tokens, check_schemas, read_json
from .generation import Generation, loaded_tools

KEEPALIVE_S = 5.0
IGNORED_NAMES = 256  # distinct ignored-field names /metrics counts (a tool's type is a client's text)
PING = 'event: ping\ndata: {"type": "ping"}\n\n'
COMMENT = ": keepalive\n\n"


@dataclass
class Metrics:
    requests: int = 0
    refused: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    decode_s: float = 0.0
    expert_bytes: float = 0.0
    hit_weighted: float = 0.0  # hit rate x decoded tokens, for a mean over tokens
    ignored: Counter = field(default_factory=Counter)  # requests that carried each ignored field
    started: float = field(default_factory=time.time)

    def count_ignored(self, names: list[str]) -> None:
        for name in names:
            known = name in self.ignored or len(self.ignored) < IGNORED_NAMES
            self.ignored[name if known else "(other names)"] += 1

    def add(self, done) -> None:
        self.prompt_tokens += done.prompt_tokens
        self.cached_tokens += done.reused_prompt_tokens
        self.generated_tokens += done.generation_tokens
        self.decode_s += done.decode_s
        fed = max(0, done.generation_tokens - 1)
        self.expert_bytes += done.bytes_per_token * fed
        self.hit_weighted += done.hit_rate * fed


def _is_anthropic(request: Request) -> bool:
    """Which API's shape an error takes: Anthropic's for its routes and for clients that say
    they speak it (the anthropic-version header every Anthropic SDK sends)."""
    return request.url.path.startswith("/v1/messages") or "anthropic-version" in request.headers


def _first_reply(messages: list[dict]) -> bool:
    """Whether the reply is the conversation's first (no assistant message, no tool result yet)."""
    return not any(m["role"] in ("assistant", "tool") for m in messages)


class Server:
    def __init__(
        self,
        engine,
        info,
        model_id: str,
        *,
        api_keys: tuple[str, ...] = (),
        max_queue: int = 16,
        default_max_tokens: int = 1024,
        allow_origins: tuple[str, ...] = (),
        tenant_header: str | None = None,
        limits: Limits | None = None,
        host: str | None = None,
        allow_hosts: tuple[str, ...] = (),
        served_names: tuple[str, ...] = (),
        strict_fields: bool = False,
        keepalive_s: float = KEEPALIVE_S,
        force_first_call: bool = False,
        temperature: float = 1.0,
        repetition_penalty: float = 1.0,
    ):
        """served_names: the model names clients may ask for (--served-model-name); none: any
        name is this model. strict_fields: refuse what would be ignored or translated.
        force_first_call: a conversation's first reply, with tools offered under tool_choice
        auto, must be a call (--force-first-call: for models too small to start one).
        temperature, repetition_penalty: a request's that gives none (--temp, 1: the APIs' own
        default; --repetition-penalty, 1: off)."""
        self.engine, self.info = engine, info
        self.names = tuple(served_names) or (model_id,)
        self.model_id = self.names[0]
        self.restrict_names = bool(served_names)
        self.api_keys = tuple(api_keys)  # none: anyone who reaches the server (keys.py)
        self.tenant_header = tenant_header  # (--tenant-header) splits a key's requests into tenants
        self.limits = limits or Limits()
        # the Host names it answers to (the address it is bound to, --allow-host); None: any
        self.hosts = HostCheck(host, tuple(allow_hosts)) if host is not None else None
        tok = getattr(getattr(engine, "loaded", None), "tokenizer", None)
        self.token_chars = tok.longest_token_chars if tok is not None else None  # (limits.check_prompt_chars)
        self.max_queue = max_queue
        self.default_max_tokens = default_max_tokens
        self.allow_origins = tuple(allow_origins)  # CORS: none unless asked
        self.strict_fields = strict_fields
        self.keepalive_s = keepalive_s
        self.force_first_call = force_first_call
        self.sampling_defaults = {"temperature": temperature, "repetition_penalty": repetition_penalty}
        self.pending = 0
        self.metrics = Metrics()

    # -- plumbing ---------------------------------------------------------------------------
    def _check_key(self, request: Request, generating: bool = False) -> str:
        """The request's tenant (keys.tenant); a 401 without a key the server takes. A request
        that may reuse prompt caches (`generating`) must carry the --tenant-header."""
        key = None
        if self.api_keys:
            given = request.headers.get("x-api-key") or ""
            auth = request.headers.get("authorization") or ""
            if auth.lower().startswith("bearer "):
                given = given or auth[7:].strip()
            key = matching_key(self.api_keys, given)
            if key is None:
                raise APIError(401, "invalid API key (give it as 'Authorization: Bearer KEY' or 'x-api-key: KEY')")
        header = None
        if self.tenant_header is not None:
            header = request.headers.get(self.tenant_header)
            if header is None and generating:
                raise APIError(400, f"this server needs the {self.tenant_header} header (--tenant-header)")
        return tenant_of(key, header)

    async def _body(self, request: Request) -> dict:
        body = await read_json(request, self.limits)  # (limits.py: type, size, time, depth, text)
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = body.get("model")
        if self.restrict_names and model is not None and model not in self.names:
            raise APIError(
                404,
                f"model {model!r} is not served here; this server answers to "
                f"{', '.join(map(repr, self.names))} (GET /v1/models)",
                param="model",
            )
        return body

    def _answering(self, body: dict) -> str:
        """The model name a response gives: the one asked for when it is one of ours, else ours."""
        return body.get("model") if body.get("model") in self.names else self.model_id

    def _prepare(self, parse, body: dict, stream: bool) -> tuple[Generation, Fields]:
        """Everything a request needs before it is queued, all CPU work (run it off the event
        loop): the body read through its API's field policy (every problem in one 400), the
        engine request and its grammar built, and, for a stream, the prompt counted, so a
        prompt that cannot run is an HTTP error before the first byte."""
        fields = Fields(strict=self.strict_fields)
        try:
            call = parse(body, fields)
        except APIError as e:  # a problem that stopped the reading: named with the others
            fields.check(also=e)
        except (TypeError, AttributeError, KeyError, ValueError) as e:  # a body of the wrong shapes
            fields.check(also=APIError(400, f"malformed request: {type(e).__name__}: {e}"))
        unset = {k: v for k, v in self.sampling_defaults.items() if body.get(k) is None}
        if unset:  # the APIs' defaults, or the operator's (--temp, --repetition-penalty)
            call.sampling = dataclasses.replace(call.sampling, **unset)
        clean = not fields.problems  # else the engine request is built only for the problems it finds
        forced = self.force_first_call and call.tool_choice == "auto" and loaded_tools(call)
        if clean and forced and _first_reply(call.messages):
            call.tool_choice, call.parallel_tool_calls = "required", False
            fields.record("tool_choice: required (--force-first-call)")
        try:  # before anything is built from them: the schemas, the reply's length, the prompt's
            check_schemas(call, self.limits)
            self._cap_max_tokens(call, fields)
            truncate = getattr(self.engine, "truncate_prompt", "off")
            check_prompt_chars(call, self.info.context, self.token_chars, truncate)
        except APIError as e:
            fields.check(also=e)
        try:
            gen = Generation(self.engine, call, self.info.chat_template, fields)
            if clean:
                check_prompt_tokens(gen, truncate)
            if stream and clean:
                gen.count_prompt()
        except APIError as e:  # named with the problems the reading found
            fields.check(also=e)
        except (TypeError, AttributeError, KeyError, ValueError) as e:
            fields.check(also=APIError(400, f"malformed request: {type(e).__name__}: {e}"))
        fields.check()
        return gen, fields

    def _cap_max_tokens(self, call, fields: Fields) -> None:
        """No reply is longer than --max-tokens (a client's 10**9 held the engine until the context
        ran out): more is cut to it and recorded, or refused under --strict-fields."""
        cap = self.default_max_tokens
        if call.max_tokens > cap and fields.translate("max_tokens", f"more than --max-tokens {cap}"):
            fields.record(f"max_tokens: {call.max_tokens} -> {cap} (--max-tokens)")
            call.max_tokens = cap

    def _admit(self, anthropic: bool, hold: bool = True) -> None:
        """Refuse past the queue's bound; `hold`: count the request as pending from now (a stream
        counts from its first read, so one whose client left before it began is never counted)."""
        if self.pending >= self.max_queue:
            self.metrics.refused += 1
            raise APIError(
                529 if anthropic else 429,
                f"the server is busy: {self.pending} requests in flight or waiting "
                f"(--max-queue {self.max_queue}); retry shortly",
            )
        self.pending += hold
        self.metrics.requests += 1

    def _done(self, gen: Generation) -> None:
        self.pending -= 1
        if gen.reply is not None:
            self.metrics.add(gen.reply.done)

    def endpoint(self, parse, respond, stream, anthropic: bool = False):
        """A generating route: check, queue, run (streamed as SSE or whole), count."""

        async def handler(request: Request) -> Response:
            try:
                tenant = self._check_key(request, generating=True)
                body = await self._body(request)
                streamed = bool(body.get("stream"))
                gen, fields = await asyncio.to_thread(self._prepare, parse, body, streamed)
                gen.tenant = tenant
                self._admit(anthropic, hold=not streamed)
            except APIError as e:
                return self._error(e, anthropic)
            self.metrics.count_ignored(fields.ignored)
            model = self._answering(body)
            rid = ("msg_" if anthropic else "chatcmpl-") + secrets.token_hex(12)
            if streamed:
                return StreamingResponse(
                    self._sse(gen, stream(gen, model, rid, self.info), anthropic),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", **fields.header},
                )
            try:
                reply = await self._run_watched(gen, request)
            except APIError as e:
                return self._error(e, anthropic)
            finally:
                self._done(gen)
            if reply is None:
                return Response(status_code=499)
            return JSONResponse(respond(gen, model, rid, self.info), headers=fields.header)

        return handler

    async def _run_watched(self, gen: Generation, request: Request):
        """The whole reply; None when the client went away first (the generation is cancelled)."""
        task = asyncio.ensure_future(gen.run())
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                gen.cancel()
                await asyncio.wait({task}, timeout=30)
                return None
        return task.result()

    async def _sse(self, gen: Generation, events, anthropic: bool):
        """The stream: each event as the API writes it, a keepalive whenever `keepalive_s` pass
        without one, and an error event (in the API's shape) if the reply fails after it began."""
        self.pending += 1
        out: asyncio.Queue = asyncio.Queue(maxsize=16)

        async def produce():
            try:
                async for item in events:
                    await out.put(("item", item))
                await out.put(("end", None))
            except APIError as e:
                await out.put(("error", e))
            except Exception as e:  # noqa: BLE001  (the client hears of it; the server goes on)
                await out.put(("error", APIError(500, f"{type(e).__name__}: {e}")))

        task = asyncio.create_task(produce())
        try:
            while True:
                try:
                    kind, item = await asyncio.wait_for(out.get(), self.keepalive_s)
                except asyncio.TimeoutError:
                    yield PING if anthropic else COMMENT
                    continue
                if kind == "end":
                    if not anthropic:
                        yield "data: [DONE]\n\n"
                    return
                if kind == "error":  # after the headers went out: an error event, in the API's shape
                    payload = json.dumps(item.anthropic() if anthropic else item.openai())
                    yield f"event: error\ndata: {payload}\n\n" if anthropic else f"data: {payload}\n\n"
                    return
                if anthropic:
                    name, payload = item
                    yield f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"
                else:
                    yield f"data: {json.dumps(item, ensure_ascii=False)}\n\n"
        finally:
            task.cancel()
            gen.cancel()  # a no-op after a complete reply; a client that left stops the engine
            self._done(gen)

    def _error(self, e: APIError, anthropic: bool) -> JSONResponse:
        # A body that was cut off or refused unread leaves the connection in no state to reuse
        headers = {"Connection": "close"} if e.status in (408, 413) else None
        return JSONResponse(e.anthropic() if anthropic else e.openai(), status_code=e.status, headers=headers)

    async def http_error(self, request: Request, exc: HTTPException) -> Response:
        """Starlette's own errors (no such route, a method the route does not take, ...) in the
        calling API's shape."""
        what = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        e = APIError(exc.status_code, what.get(exc.status_code, str(exc.detail)))
        return JSONResponse(
            e.anthropic() if _is_anthropic(request) else e.openai(),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    async def server_error(self, request: Request, exc: Exception) -> Response:
        e = APIError(500, f"internal error: {type(exc).__name__}")
        return JSONResponse(e.anthropic() if _is_anthropic(request) else e.openai(), status_code=500)

    # -- plain routes -----------------------------------------------------------------------
    def _model(self, name: str, anthropic: bool) -> dict:
        """One served model as the calling API lists it (no paths: its name and figures)."""
        if anthropic:
            return {
                "type": "model",
                "id": name,
                "display_name": name,
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.metrics.started)),
            }
        return {
            "id": name,
            "object": "model",
            "created": int(self.metrics.started),
            "owned_by": "flashmoe",
            "flashmoe": {
                "model_type": self.info.model_type,
                "bits": self.info.bits,
                "experts": self.info.experts,
                "experts_per_token": self.info.top_k,
                "context": self.info.context,
            },
        }

    async def models(self, request: Request) -> Response:
        anthropic = _is_anthropic(request)
        try:
            self._check_key(request)
        except APIError as e:
            return self._error(e, anthropic)
        data = [self._model(n, anthropic) for n in self.names]
        if anthropic:
            return JSONResponse({"data": data, "has_more": False, "first_id": self.names[0], "last_id": self.names[-1]})
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id}: this model under any name unless --served-model-name lists them."""
        anthropic = _is_anthropic(request)
        name = request.path_params["name"]
        try:
            self._check_key(request)
            if self.restrict_names and name not in self.names:
                raise APIError(
                    404,
                    f"model {name!r} is not served here; this server answers to {', '.join(map(repr, self.names))}",
                    param="model",
                )
        except APIError as e:
            return self._error(e, anthropic)
        return JSONResponse(
            self._model(name if name in self.names or not self.restrict_names else self.model_id, anthropic)
        )

    async def count_tokens(self, request: Request) -> Response:
        """POST /v1/messages/count_tokens: the prompt's length as the chat template renders it."""
        try:
            self._check_key(request)
            body = await self._body(request)
            gen, fields = await asyncio.to_thread(
                self._prepare, lambda b, f: anthropic_api.parse_messages(b, f, counting=True), body, True
            )
        except APIError as e:
            return self._error(e, True)
        if gen.prompt_tokens is None:
            return self._error(APIError(501, "this engine cannot count tokens"), True)
        return JSONResponse(anthropic_api.count_tokens_response(gen), headers=fields.header)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.model_id, "queue": self.pending})

    async def metrics_route(self, request: Request) -> Response:
        try:
            self._check_key(request)
        except APIError as e:
            return self._error(e, False)
        m = self.metrics
        fed = max(1, m.generated_tokens)
        return JSONResponse(
            {
                "requests": m.requests,
                "refused": m.refused,
                "queue_depth": self.pending,
                "max_queue": self.max_queue,
                "prompt_tokens": m.prompt_tokens,
                "cached_prompt_tokens": m.cached_tokens,
                "generated_tokens": m.generated_tokens,
                "decode_tok_per_s": round(m.generated_tokens / m.decode_s, 2) if m.decode_s else 0.0,
                "expert_hit_rate": round(m.hit_weighted / fed, 4),
                "bytes_read_per_token": round(m.expert_bytes / fed),
                "ignored_fields": dict(sorted(m.ignored.items())),
                "uptime_s": round(time.time() - m.started, 1),
            }
        )

    def app(self) -> Starlette:
        d = self.default_max_tokens
        routes = [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{name:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_route, methods=["GET"]),
            Route(
                "/v1/chat/completions",
                self.endpoint(
                    lambda b, f: openai_api.parse_chat(b, f, d), openai_api.chat_response, openai_api.chat_chunks
                ),
                methods=["POST"],
            ),
            Route(
                "/v1/completions",
                self.endpoint(
                    lambda b, f: openai_api.parse_completion(b, f, d),
                    openai_api.completion_response,
                    openai_api.completion_chunks,
                ),
                methods=["POST"],
            ),
            Route(
                "/v1/responses",
                self.endpoint(
                    lambda b, f: responses_api.parse_responses(b, f, d), responses_api.response, responses_api.events
                ),
                methods=["POST"],
            ),
            Route(
                "/v1/messages",
                self.endpoint(
                    anthropic_api.parse_messages,
                    anthropic_api.message_response,
                    anthropic_api.message_events,
                    anthropic=True,
                ),
                methods=["POST"],
            ),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
        ]
        from starlette.middleware import Middleware

        middleware = [Middleware(_HostGuard, check=self.hosts)] if self.hosts else []  # before CORS answers
        if self.allow_origins:
            from starlette.middleware.cors import CORSMiddleware

            middleware.append(
                Middleware(
                    CORSMiddleware,
                    allow_origins=list(self.allow_origins),
                    allow_methods=["GET", "POST"],
                    allow_headers=["*"],
                )
            )
        return Starlette(
            routes=routes,
            middleware=middleware,
            exception_handlers={HTTPException: self.http_error, Exception: self.server_error},
        )


class _HostGuard:
    """Refuse a request whose Host is not the server's (hosts.py), before any route or CORS sees it."""

    def __init__(self, app, check: HostCheck):
        self.app, self.check = app, check

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            problem = self.check.problem(host)
            if problem is not None:
                request = Request(scope)
                e = APIError(421, problem)
                await JSONResponse(e.anthropic() if _is_anthropic(request) else e.openai(), status_code=421)(
                    scope, receive, send
                )
                return
        await self.app(scope, receive, send)
