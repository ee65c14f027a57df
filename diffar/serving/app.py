"""The FastAPI app: OpenAI-compatible completions and chat completions over the batching engine,
server-sent-event streaming, Prometheus metrics, and errors in OpenAI's shape (4xx, never a 500).
One server serves one model with one generation method (diffar/generation): AR, ReFusion or DD2. The
routes live here; a body becomes a request in serving/requests.py, requests are batched in engine.py."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from diffar.generation import GenerationMethod
from diffar.serving.engine import Busy, Engine, EngineDown, Event, Request
from diffar.serving.metrics import Metrics
from diffar.serving.protocol import (GENERATION_RESPONSES, HEALTH_RESPONSES, READ_RESPONSES, ChatCompletionRequest,
                                     CompletionRequest, error_body)
from diffar.serving.requests import APIError, build_request, choice, is_chat_model, summary

STATIC = Path(__file__).resolve().parent / "static"
MAX_BODY_BYTES = 1 << 20  # default request body limit: 1 MiB holds any prompt a diffar model reads, many times over
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
OPEN_PATHS = ("/health", "/")  # answered without the API key: liveness, and the page (which then asks for the key)
MAX_WAIT_S = 3.0  # default bound on a request's estimated wait: beyond it, a 429 with Retry-After


class CancellingStream(StreamingResponse):
    """A streaming response that cancels its generation however the stream ends (a client that hangs up
    mid-send included), so the row is freed at once rather than when the generator is collected."""

    def __init__(self, request: Request, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generation = request

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.cancelled.set()


def create_app(method: GenerationMethod, model_id: str, *, max_batch_size: int = 16, window_ms: float = 10.0,
               max_queue: int = 4096, max_wait_s: float | None = MAX_WAIT_S, max_body_bytes: int = MAX_BODY_BYTES,
               allowed_hosts: list[str] | None = None, api_key: str | None = None, docs: bool = False) -> FastAPI:
    """The server's routes over one engine running `method`. They are closures over the engine and the
    metrics, hence one function (~150 lines) of short routes; what a body means is serving/requests.py's.
    A body larger than `max_body_bytes` (by its Content-Length, before a byte of it is read) gets a 413; a
    `Host` header outside `allowed_hosts` (None: any) a 400, so a web page elsewhere cannot drive a local server
    through DNS rebinding; with `api_key`, every route but /health and the page itself needs the header
    `Authorization: Bearer <api_key>` (a 401 without it); the interactive /docs exist only with `docs`.
    Admission: a request whose estimated wait exceeds `max_wait_s` (None: no bound) gets a 429 with Retry-After."""
    metrics = Metrics()
    engine = Engine(method, method.tokenizer, max_batch_size=max_batch_size, window_ms=window_ms,
                    max_queue=max_queue, max_wait_s=max_wait_s, on_batch=metrics.observe_batch)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="diffar", version="0.1.0", lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url=None)
    if allowed_hosts is not None:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts)

    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body("malformed JSON body", "invalid_request_error", "invalid_json"), 400)
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return JSONResponse(error_body(message, "invalid_request_error", "invalid_request", where or None), 400)

    @app.exception_handler(Exception)
    async def unexpected(_, exc: Exception):  # a bug, but still an answer in the OpenAI shape
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), 500)

    @app.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException):
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error", str(exc.status_code)),
                            exc.status_code, headers=exc.headers)  # a 405's Allow among them

    @app.middleware("http")
    async def count(request: HTTPRequest, call_next):
        t0 = time.perf_counter()
        response = unauthorised(request) or too_large(request) or busy(request) or await call_next(request)
        path = request.url.path if request.url.path in KNOWN_PATHS else "other"
        metrics.requests.labels(path, str(response.status_code)).inc()
        if response.status_code >= 400:
            metrics.errors.labels(path, str(response.status_code)).inc()
        metrics.latency.labels(path).observe(time.perf_counter() - t0)
        return response

    def unauthorised(request: HTTPRequest) -> JSONResponse | None:
        """A 401 for a request without the server's API key (when it has one); None: go on."""
        if api_key is None or request.url.path in OPEN_PATHS:
            return None
        given = request.headers.get("authorization", "")
        if secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            return None
        return JSONResponse(error_body("missing or wrong API key (send 'Authorization: Bearer <key>')",
                                       "invalid_request_error", "invalid_api_key"), 401,
                            headers={"WWW-Authenticate": "Bearer"})

    def too_large(request: HTTPRequest) -> JSONResponse | None:
        """A 413 for a body over the limit, or a 411 for a body of unstated length; None: go on."""
        if request.method != "POST":
            return None
        length = request.headers.get("content-length")
        if length is None or not length.isdigit():
            return JSONResponse(error_body("a request body needs a Content-Length header", "invalid_request_error",
                                           "length_required"), 411)
        if int(length) > max_body_bytes:
            return JSONResponse(error_body(f"request body of {length} bytes exceeds this server's limit of "
                                           f"{max_body_bytes} (diffar serve --max-body-bytes)",
                                           "invalid_request_error", "request_too_large"), 413)
        return None

    def busy(request: HTTPRequest) -> JSONResponse | None:
        """A 429 before the body is read or tokenised, when the server would refuse any request now (shedding
        must cost less than serving); None: go on (`submit` decides again)."""
        if request.method != "POST" or request.url.path not in GENERATION_PATHS:
            return None
        try:
            engine.admit()
        except Busy as e:
            refused = busy_error(e)
            return JSONResponse(refused.body, refused.status, headers=refused.headers)
        return None

    def busy_error(e: Busy) -> APIError:
        return APIError(429, f"{e}; retry later", "rate_limit_error", code=e.reason,
                        headers={"Retry-After": str(e.retry_after)})

    async def watch(req: Request, http: HTTPRequest) -> None:
        """Cancel `req` as soon as its client disconnects: once the body is read, the server's next message
        for this connection is the disconnect. The engine drops a cancelled row at its next batch step."""
        while (await http.receive())["type"] != "http.disconnect":
            pass
        req.cancelled.set()

    async def events(req: Request, http: HTTPRequest | None = None) -> AsyncIterator[Event]:
        """The request's events until its final one. A consumer that stops early, or (when `http` is
        given) a client that disconnects, cancels the request and frees its batch row."""
        watcher = asyncio.create_task(watch(req, http)) if http is not None else None
        try:
            while True:
                event = await req.events.get()
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if watcher is not None:
                watcher.cancel()
            req.cancelled.set()
            metrics.generation.observe(time.perf_counter() - req.submitted)

    def submit(req: Request) -> None:
        try:
            engine.submit(req)
        except Busy as e:
            raise busy_error(e) from None
        except EngineDown:
            raise APIError(503, "the generation worker is down; restart the server", "server_error",
                           code="engine_down") from None
        metrics.queued.set(engine.queued())

    async def respond(body, chat: bool, http: HTTPRequest):
        # tokenising (a chat template, a long prompt) is CPU work: off the event loop, which serves everyone
        req = await asyncio.to_thread(build_request, body, method, model_id)
        submit(req)
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        if body.stream:
            async def sse():
                first = True
                async for ev in events(req):
                    if ev.error:
                        yield f"data: {json.dumps(error_body(ev.error, 'server_error'))}\n\n"
                        return
                    chunk = {"id": rid, "object": obj + (".chunk" if chat else ""), "created": created,
                             "model": model_id, "choices": [choice(ev.text, ev.finish_reason, chat, True, first)]}
                    if ev.finish_reason:
                        chunk["diffar"] = summary(req, method, time.perf_counter() - req.submitted)
                    elif ev.snapshot:  # no text delta: clients that only append text see nothing
                        chunk["diffar"] = {"method": method.name, "snapshot": ev.snapshot}
                    elif ev.origins:  # who wrote the tokens this delta completes (a page's live tau)
                        chunk["diffar"] = {"origins": ev.origins}
                    first = False
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"

            return CancellingStream(req, sse(), media_type="text/event-stream")

        finish = None
        async for ev in events(req, http):
            if ev.error:
                raise APIError(503, f"generation failed: {ev.error}", "server_error")
            finish = ev.finish_reason
        n = len(req.tokens)
        return {"id": rid, "object": obj, "created": created, "model": model_id,
                "choices": [choice(req.text, finish, chat, False)],
                "usage": {"prompt_tokens": len(req.prompt_ids), "completion_tokens": n,
                          "total_tokens": len(req.prompt_ids) + n},
                "diffar": summary(req, method, time.perf_counter() - req.submitted)}

    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, http: HTTPRequest):
        return await respond(body, chat=False, http=http)

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
        return await respond(body, chat=True, http=http)

    @app.get("/v1/models", responses=READ_RESPONSES)
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "diffar",
                                            "task": method.task, "methods": [method.name],
                                            "chat": is_chat_model(method), "domains": list(method.domains)}]}

    @app.get("/health", responses=HEALTH_RESPONSES)
    async def health():
        body = {"status": "ok" if engine.alive else "down", "model": model_id, "queued": engine.queued()}
        return JSONResponse(body, status_code=200 if engine.alive else 503)

    @app.get("/metrics", responses=READ_RESPONSES, response_class=Response)
    async def prometheus():
        metrics.queued.set(engine.queued())
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html")

    def openapi() -> dict:
        """FastAPI's document without the 422 it lists for every body: invalid bodies get a 400 here."""
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            for operation in (op for path in schema["paths"].values() for op in path.values()):
                operation["responses"].pop("422", None)
        return app.openapi_schema

    app.openapi = openapi
    KNOWN_PATHS = {r.path for r in app.routes}
    return app
