"""The OpenAI-compatible HTTP application (Starlette): routes, authentication, errors, streaming.

Imported only when serving starts, so the rest of cudaformers works without the web stack.
Handlers check a request (openai_protocol), submit it to the AsyncEngine, and either await every
token (a JSON response) or forward tokens as server-sent events. Each handler also watches for the
client going away: its request is then cancelled and its KV blocks freed at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ..errors import CudaformersError
from .openai_protocol import APIError, GenerationRequest, ModelInfo, parse_chat, parse_completion
from .server_engine import AsyncEngine, RequestStream
from .server_metrics import ServerMetrics
from .server_output import Choice, ResponseBuilder, new_id

logger = logging.getLogger("cudaformers")

MAX_BODY_BYTES = 32 * 2**20


class ServerState:
    """What the handlers share: the engine, the model's description and the admission rules."""

    def __init__(self, engine, info: ModelInfo, *, api_key: str | None, max_in_flight: int):
        self.metrics = ServerMetrics(info.name)
        self.engine = AsyncEngine(engine, self.metrics)
        self.info, self.api_key, self.max_in_flight = info, api_key, max_in_flight
        self.draining = False  # shutting down: running requests finish, new ones get 503
        self.created = int(time.time())


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _read_json(request: Request):
    declared = request.headers.get("content-length") or "0"
    if not declared.isdigit():
        raise APIError(400, f"the Content-Length header {declared!r} is not a number")
    size = int(declared)
    if size > MAX_BODY_BYTES:
        raise APIError(413, f"the request body has {size} bytes; the limit is {MAX_BODY_BYTES}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(body)
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON ({e}); send a JSON object with "
                            "'Content-Type: application/json'") from None


class EventStream:
    """Server-sent events from an async iterator of dicts; cancels it when the client goes away.
    A bare ASGI response: Starlette's would declare a Content-Length."""

    headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]

    def __init__(self, events, on_close):
        self.events, self.on_close = events, on_close

    async def __call__(self, scope, receive, send) -> None:
        async def pump():
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            async for event in self.events:
                data = f"data: {json.dumps(event, separators=(',', ':'))}\n\n".encode()
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

        await _first_of(pump(), _until_disconnect(receive), self.on_close)


async def _first_of(work, watch, on_close):
    """Run ``work`` until done or until ``watch`` ends (client gone); ``on_close`` either way."""
    work_task, watch_task = asyncio.ensure_future(work), asyncio.ensure_future(watch)
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        for t in (work_task, watch_task):
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await watch_task
        if work_task.done() and not work_task.cancelled():
            return work_task.result()
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await work_task
        return None
    finally:
        on_close()


def build_app(state: ServerState) -> Starlette:
    info, engine = state.info, state.engine

    def check_auth(request: Request) -> None:
        if state.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           type="invalid_request_error", code="invalid_api_key")

    def admit(n: int) -> None:
        if state.draining:
            raise APIError(503, "the server is shutting down; retry on another instance",
                           type="server_error", code="shutting_down")
        if not engine.alive:
            raise APIError(503, f"the engine is not running ({engine.error!r}); restart the server",
                           type="server_error", code="engine_failed")
        if engine.num_in_flight + n > state.max_in_flight:
            raise APIError(429, f"the server is at capacity ({engine.num_in_flight} requests in flight, limit "
                                f"{state.max_in_flight}: --max-num-seqs + --max-queue); retry later",
                           type="requests", code="rate_limit_exceeded")

    async def generate(request: Request, chat: bool):
        try:
            check_auth(request)
            body = await _read_json(request)
            req = (parse_chat if chat else parse_completion)(body, info)
            admit(len(req.prompts))
            try:
                stream = engine.submit(req.prompts, req.params, new_id("req"))
            except CudaformersError as e:  # the engine's own checks (context, KV cache size)
                raise APIError(400, str(e), param="messages" if chat else "prompt") from None
        except APIError as e:
            return _error(e)
        choices = [Choice(i, p, info.tokenizer, req) for i, p in enumerate(req.prompts)]
        builder = ResponseBuilder(req, info.name, choices, with_ids=info.tokenizer is None)
        if req.stream:
            return EventStream(_events(req, stream, choices, builder), lambda: engine.release(stream))
        result = await _first_of(_collect(stream, choices, builder), _until_disconnect(request.receive),
                                 lambda: engine.release(stream))
        if result is None:  # the client left; nobody reads this
            return Response(status_code=499)
        return result

    async def completions(request: Request):
        return await generate(request, chat=False)

    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    async def models(request: Request):
        try:
            check_auth(request)
        except APIError as e:
            return _error(e)
        return JSONResponse({"object": "list", "data": [
            {"id": info.name, "object": "model", "created": state.created, "owned_by": "cudaformers",
             "max_model_len": info.max_model_len}]})

    async def health(request: Request):
        if state.draining or not engine.alive:
            return JSONResponse({"status": "draining" if state.draining else "engine failed"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request):
        return PlainTextResponse(state.metrics.render(engine.counts()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def http_error(request: Request, exc: HTTPException):
        kind = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
        return _error(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=kind))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        logger.info("serving %s (context %d tokens)", info.name, info.max_model_len)
        try:
            yield
        finally:
            engine.stop()

    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan)
    app.state.server = state
    return app


def _raise_error(u) -> None:
    if u.error is not None:
        raise APIError(500, u.error, type="server_error", code="engine_failed")


async def _collect(stream: RequestStream, choices: list[Choice], builder: ResponseBuilder) -> JSONResponse:
    try:
        async for updates in stream.updates():
            for u in updates:
                _raise_error(u)
                choices[u.index].add(u)
    except APIError as e:
        return _error(e)
    return JSONResponse(builder.response())


async def _events(req: GenerationRequest, stream: RequestStream, choices: list[Choice], builder: ResponseBuilder):
    if req.chat:
        for c in choices:
            yield builder.role_chunk(c)
    try:
        async for updates in stream.updates():
            for u in updates:
                _raise_error(u)
                c = choices[u.index]
                for chunk in builder.chunks(c, u, c.add(u)):
                    yield chunk
    except APIError as e:  # the stream has started: the error travels as an event
        yield e.body()
        return
    if req.include_usage:
        yield builder.usage_chunk()
