"""The ASGI app: routes, the API key, the bounded queue, disconnects, /health and /metrics.

One engine serves every client: requests wait their turn on its thread (engine.py), at most
`max_queue` at a time (in flight or waiting); past that a request is refused at once (HTTP 429
for OpenAI routes, 529 overloaded for Anthropic's), so a client never waits without knowing.
A client that goes away cancels its generation (the engine checks between tokens).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import time
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import anthropic_api, openai_api, responses_api
from .errors import APIError
from .generation import Generation


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
    started: float = field(default_factory=time.time)

    def add(self, done) -> None:
        self.prompt_tokens += done.prompt_tokens
        self.cached_tokens += done.reused_prompt_tokens
        self.generated_tokens += done.generation_tokens
        self.decode_s += done.decode_s
        fed = max(0, done.generation_tokens - 1)
        self.expert_bytes += done.bytes_per_token * fed
        self.hit_weighted += done.hit_rate * fed


class Server:
    def __init__(self, engine, info, model_id: str, *, api_key: str | None = None, max_queue: int = 16,
                 default_max_tokens: int = 1024, allow_origins: tuple[str, ...] = ()):
        self.engine, self.info, self.model_id = engine, info, model_id
        self.api_key = api_key
        self.max_queue = max_queue
        self.default_max_tokens = default_max_tokens
        self.allow_origins = tuple(allow_origins)  # CORS: none unless asked
        self.pending = 0
        self.metrics = Metrics()

    # -- plumbing ---------------------------------------------------------------------------
    def _check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("x-api-key") or ""
        auth = request.headers.get("authorization") or ""
        if auth.lower().startswith("bearer "):
            given = given or auth[7:].strip()
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise APIError(401, "invalid API key (give it as 'Authorization: Bearer KEY' or 'x-api-key: KEY')")

    async def _body(self, request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_id:
            raise APIError(404, f"model {model!r} is not served here; this server runs {self.model_id!r} "
                                "(GET /v1/models)", param="model")
        return body

    def _admit(self, anthropic: bool, hold: bool = True) -> None:
        """Refuse past the queue's bound; `hold`: count the request as pending from now (a stream
        counts from its first read, so one whose client left before it began is never counted)."""
        if self.pending >= self.max_queue:
            self.metrics.refused += 1
            raise APIError(529 if anthropic else 429,
                           f"the server is busy: {self.pending} requests in flight or waiting "
                           f"(--max-queue {self.max_queue}); retry shortly")
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
                self._check_key(request)
                body = await self._body(request)
                call = parse(body)
                gen = Generation(self.engine, call, self.info.chat_template)
                self._admit(anthropic, hold=not body.get("stream"))
            except APIError as e:
                return self._error(e, anthropic)
            except (TypeError, AttributeError, KeyError, ValueError) as e:  # a body of the wrong shapes
                return self._error(APIError(400, f"malformed request: {type(e).__name__}: {e}"), anthropic)
            rid = ("msg_" if anthropic else "chatcmpl-") + secrets.token_hex(12)
            if body.get("stream"):
                return StreamingResponse(self._sse(gen, stream(gen, self.model_id, rid, self.info), anthropic),
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            try:
                reply = await self._run_watched(gen, request)
            except APIError as e:
                return self._error(e, anthropic)
            finally:
                self._done(gen)
            if reply is None:
                return Response(status_code=499)
            return JSONResponse(respond(reply, self.model_id, rid, self.info))

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
        self.pending += 1
        try:
            async for item in events:
                if anthropic:
                    name, payload = item
                    yield f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"
                else:
                    yield f"data: {json.dumps(item, ensure_ascii=False)}\n\n"
            if not anthropic:
                yield "data: [DONE]\n\n"
        except APIError as e:  # after the headers went out: an error event, in the API's shape
            payload = e.anthropic() if anthropic else e.openai()
            yield (f"event: error\ndata: {json.dumps(payload)}\n\n" if anthropic else f"data: {json.dumps(payload)}\n\n")
        finally:
            gen.cancel()  # a no-op after a complete reply; a client that left stops the engine
            self._done(gen)

    def _error(self, e: APIError, anthropic: bool) -> JSONResponse:
        return JSONResponse(e.anthropic() if anthropic else e.openai(), status_code=e.status)

    # -- plain routes -----------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        try:
            self._check_key(request)
        except APIError as e:
            return self._error(e, False)
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": int(self.metrics.started), "owned_by": "flashmoe",
             "flashmoe": {"path": self.info.model, "model_type": self.info.model_type, "bits": self.info.bits,
                          "experts": self.info.experts, "experts_per_token": self.info.top_k,
                          "context": self.info.context}}]})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.model_id, "queue": self.pending})

    async def metrics_route(self, request: Request) -> Response:
        try:
            self._check_key(request)
        except APIError as e:
            return self._error(e, False)
        m = self.metrics
        fed = max(1, m.generated_tokens)
        return JSONResponse({
            "requests": m.requests, "refused": m.refused, "queue_depth": self.pending, "max_queue": self.max_queue,
            "prompt_tokens": m.prompt_tokens, "cached_prompt_tokens": m.cached_tokens,
            "generated_tokens": m.generated_tokens,
            "decode_tok_per_s": round(m.generated_tokens / m.decode_s, 2) if m.decode_s else 0.0,
            "expert_hit_rate": round(m.hit_weighted / fed, 4), "bytes_read_per_token": round(m.expert_bytes / fed),
            "uptime_s": round(time.time() - m.started, 1)})

    def app(self) -> Starlette:
        d = self.default_max_tokens
        routes = [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_route, methods=["GET"]),
            Route("/v1/chat/completions", self.endpoint(lambda b: openai_api.parse_chat(b, d),
                                                        openai_api.chat_response, openai_api.chat_chunks),
                  methods=["POST"]),
            Route("/v1/completions", self.endpoint(lambda b: openai_api.parse_completion(b, d),
                                                   openai_api.completion_response, openai_api.completion_chunks),
                  methods=["POST"]),
            Route("/v1/responses", self.endpoint(lambda b: responses_api.parse_responses(b, d),
                                                 responses_api.response, responses_api.events), methods=["POST"]),
            Route("/v1/messages", self.endpoint(anthropic_api.parse_messages, anthropic_api.message_response,
                                                anthropic_api.message_events, anthropic=True), methods=["POST"]),
        ]
        middleware = []
        if self.allow_origins:
            from starlette.middleware import Middleware
            from starlette.middleware.cors import CORSMiddleware

            middleware.append(Middleware(CORSMiddleware, allow_origins=list(self.allow_origins),
                                         allow_methods=["GET", "POST"], allow_headers=["*"]))
        return Starlette(routes=routes, middleware=middleware)
