"""The FastAPI app: OpenAI-compatible completions and chat completions over the batching engine,
server-sent-event streaming, Prometheus metrics, and errors in OpenAI's shape (4xx, never a 500).
One server serves one model with its decoding method (serving/methods.py): AR, ReFusion or DD2."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException

from diffar.decoding.sampling import SamplingConfig
from diffar.serving.engine import BatchStats, Engine, EngineDown, Event, QueueFull, Request
from diffar.serving.methods import dd2_sampling
from diffar.serving.protocol import METHODS, ChatCompletionRequest, CompletionRequest, error_body

STATIC = Path(__file__).resolve().parent / "static"
DISCONNECT_POLL_S = 5.0  # how often a waiting non-streaming request checks that its client is still there


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        self.status, self.body = status, error_body(message, type_, code, param)


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


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("diffar_requests", "HTTP requests", ["path", "status"], registry=self.registry)
        self.errors = Counter("diffar_errors", "HTTP responses with status >= 400", ["path", "status"],
                              registry=self.registry)
        self.latency = Histogram("diffar_request_latency_seconds", "time to response (headers, for streams)",
                                 ["path"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
                                 registry=self.registry)
        self.batch_size = Histogram("diffar_batch_size", "requests decoded together",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=self.registry)
        self.tokens = Counter("diffar_generated_tokens", "tokens generated", registry=self.registry)
        self.tokens_per_s = Gauge("diffar_tokens_per_second", "tokens/s of the last batch", registry=self.registry)
        self.queued = Gauge("diffar_queue_depth", "requests waiting for a batch", registry=self.registry)
        self.cancelled = Counter("diffar_cancelled", "generations cut short by a client that went away",
                                 registry=self.registry)
        self.generation = Histogram("diffar_generation_seconds", "submit to last token (streams included)",
                                    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
                                    registry=self.registry)

    def observe_batch(self, stats: BatchStats) -> None:
        self.batch_size.observe(stats.size)
        self.cancelled.inc(stats.cancelled)
        self.tokens.inc(stats.new_tokens)
        self.tokens_per_s.set(stats.new_tokens / stats.seconds if stats.seconds > 0 else 0.0)


def create_app(method, tokenizer, meta: dict, model_id: str, *, max_batch_size: int = 16, window_ms: float = 10.0,
               max_queue: int = 4096) -> FastAPI:
    """`method`: an ARMethod, RefusionMethod or DD2Method over the loaded model."""
    metrics = Metrics()
    engine = Engine(method, tokenizer, max_batch_size=max_batch_size, window_ms=window_ms, max_queue=max_queue,
                    on_batch=metrics.observe_batch)
    task, served_methods = meta["task"], (method.name,)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="diffar", version="0.1.0", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return JSONResponse(exc.body, status_code=exc.status)

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
                            exc.status_code)

    @app.middleware("http")
    async def count(request: HTTPRequest, call_next):
        t0 = time.perf_counter()
        response = await call_next(request)
        path = request.url.path if request.url.path in KNOWN_PATHS else "other"
        metrics.requests.labels(path, str(response.status_code)).inc()
        if response.status_code >= 400:
            metrics.errors.labels(path, str(response.status_code)).inc()
        metrics.latency.labels(path).observe(time.perf_counter() - t0)
        return response

    def make_request(body, text: str) -> Request:
        if body.model not in (None, model_id):
            raise APIError(404, f"model {body.model!r} does not exist; this server has {model_id!r}",
                           code="model_not_found", param="model")
        if body.method is not None and body.method not in METHODS:
            raise APIError(400, f"unknown method {body.method!r}; choose one of {', '.join(METHODS)}", param="method")
        if body.method not in (None, method.name):
            raise APIError(400, f"method {body.method!r} is not served here (serving: {', '.join(served_methods)})",
                           param="method")
        prompt_field = "prompt" if isinstance(body, CompletionRequest) else "messages"
        if not text.strip():
            raise APIError(400, "empty prompt", param=prompt_field)
        ids = method.prompt(text)
        room = method.room(ids)
        if room <= 0:
            raise APIError(400, f"the prompt ({len(ids)} tokens) is too long for this model",
                           code="context_length_exceeded", param=prompt_field)
        max_tokens = body.token_budget or min(256, room)
        if max_tokens > room:
            raise APIError(400, f"max_tokens ({max_tokens}) exceeds the {room} new tokens this prompt leaves room for",
                           code="context_length_exceeded", param="max_tokens")
        if body.best_of > 1 and method.name != "dd2":
            raise APIError(400, f"best_of > 1 applies to method dd2; this server decodes with {method.name}",
                           param="best_of")
        if body.best_of > 1 and body.stream:
            raise APIError(400, "best_of > 1 cannot be streamed: one sample is kept once every sample is done",
                           param="best_of")
        if body.best_of > 1 and method.judge is not None and max_tokens > method.judge_room(ids):
            raise APIError(400, f"max_tokens ({max_tokens}) exceeds the {method.judge_room(ids)} tokens the judge can "
                           "score after this prompt", code="context_length_exceeded", param="max_tokens")
        if method.name == "dd2":
            sampling = dd2_sampling(body.steps, body.guidance_scale, body.preset, body.best_of, body.tau, body.tau_min)
            if body.tau is not None and body.tau_min is None and sampling.one_step:
                raise APIError(400, "a one-step sample is read out at tau_min (tau(t) = max(tau_min, tau * (1 - t)) "
                                    "at t = 1): tau needs more steps; send tau_min to sample it", param="tau")
        else:
            sampling = SamplingConfig(body.temperature, body.top_k, body.top_p)
        return Request(ids, max_tokens, sampling, stop=body.stop_list(), seed=body.seed,
                       fixed=pins(body.fixed_tokens or {}, max_tokens), stream=body.stream)

    def pins(fixed: dict[int, int | str], max_tokens: int) -> dict[int, int]:
        out: dict[int, int] = {}
        for pos, value in sorted(fixed.items()):
            ids = tokenizer.encode(value) if isinstance(value, str) else [value]
            if not ids or any(not 0 <= t < tokenizer.vocab_size for t in ids):
                raise APIError(400, f"fixed_tokens[{pos}] is not a token id or non-empty text", param="fixed_tokens")
            if pos < 0 or pos + len(ids) > max_tokens:
                raise APIError(400, f"fixed_tokens[{pos}] lies outside the {max_tokens} tokens generated",
                               param="fixed_tokens")
            if any(pos + j in out for j in range(len(ids))):
                raise APIError(400, f"fixed_tokens[{pos}] overlaps an earlier pin", param="fixed_tokens")
            out.update({pos + j: t for j, t in enumerate(ids)})
        return out

    async def events(req: Request, http: HTTPRequest | None = None) -> AsyncIterator[Event]:
        """The request's events until its final one. A consumer that stops early, or (when `http` is
        given) a client that disconnects, cancels the request and frees its batch row."""
        try:
            while True:
                try:
                    event = await asyncio.wait_for(req.events.get(), timeout=DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if http is not None and await http.is_disconnected():
                        return
                    continue
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            req.cancelled.set()
            metrics.generation.observe(time.perf_counter() - req.submitted)

    def submit(req: Request) -> None:
        try:
            engine.submit(req)
        except QueueFull:
            raise APIError(429, "server busy: the request queue is full, retry later", "rate_limit_error",
                           code="queue_full") from None
        except EngineDown:
            raise APIError(503, "the generation worker is down; restart the server", "server_error",
                           code="engine_down") from None
        metrics.queued.set(engine.queued())

    async def respond(body, text: str, chat: bool, http: HTTPRequest):
        req = make_request(body, text)
        submit(req)
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def choice(text: str, finish: str | None, first: bool = False) -> dict:
            if chat and body.stream:
                delta = {"content": text} | ({"role": "assistant"} if first else {})
                return {"index": 0, "delta": delta, "finish_reason": finish}
            if chat:
                return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

        if body.stream:
            async def sse():
                first = True
                async for ev in events(req):
                    if ev.error:
                        yield f"data: {json.dumps(error_body(ev.error, 'server_error'))}\n\n"
                        return
                    chunk = {"id": rid, "object": obj + (".chunk" if chat else ""), "created": created,
                             "model": model_id, "choices": [choice(ev.text, ev.finish_reason, first)]}
                    if ev.finish_reason:
                        chunk["diffar"] = summary(req)
                    elif ev.snapshot:  # no text delta: clients that only append text see nothing
                        chunk["diffar"] = {"method": method.name, "snapshot": ev.snapshot}
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
                "choices": [choice(req.text, finish)],
                "usage": {"prompt_tokens": len(req.prompt_ids), "completion_tokens": n,
                          "total_tokens": len(req.prompt_ids) + n},
                "diffar": summary(req)}

    def summary(req: Request) -> dict:
        """diffar's extension of a response: speed, the forward passes its batch took, and the tokens one by
        one (for pinning)."""
        latency = time.perf_counter() - req.submitted
        return {"method": method.name, "latency_ms": round(1000 * latency, 1),
                "tokens_per_s": round(len(req.tokens) / latency, 1) if latency > 0 else None,
                "passes": req.passes,
                "token_ids": req.tokens, "tokens": [tokenizer.decode([t]) for t in req.tokens],
                "fixed_positions": sorted(req.fixed)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        return await respond(body, body.prompt, chat=False, http=http)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
        return await respond(body, body.prompt_text(task), chat=True, http=http)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "diffar",
                                            "task": task, "methods": list(served_methods)}]}

    @app.get("/health")
    async def health():
        body = {"status": "ok" if engine.alive else "down", "model": model_id, "queued": engine.queued()}
        return JSONResponse(body, status_code=200 if engine.alive else 503)

    @app.get("/metrics")
    async def prometheus():
        metrics.queued.set(engine.queued())
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html")

    KNOWN_PATHS = {r.path for r in app.routes}
    return app
