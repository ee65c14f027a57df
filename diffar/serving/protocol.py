"""The OpenAI-compatible request bodies (plus diffar's own fields) and the error shape.

Only what diffar can honour is accepted: n must be 1, best_of above 1 only for DD2 (and not streamed, as
in OpenAI's API), and every knob is validated even where the served method ignores it (AR: steps,
guidance_scale, preset, tau, tau_min; DD2: temperature, top_k, top_p), so a client learns about a typo at
once. Numbers and flags are strict: `true` is not a temperature, nor "0.5".
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

METHODS = ("ar", "dd2", "refusion")
MAX_STOP, MAX_STOP_CHARS = 4, 64  # OpenAI's: a string, or a list of up to 4


def _check_utf8(value):
    """Lone surrogates survive JSON parsing but not UTF-8 tokenisation: reject them here (a 400)."""
    if isinstance(value, str):
        value.encode("utf-8")
    elif isinstance(value, dict):
        for v in value.values():
            _check_utf8(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_utf8(v)
    elif isinstance(value, BaseModel):
        _check_utf8(dict(value))


class GenerationFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields we don't use (user, logprobs...)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, strict=True)
    max_completion_tokens: int | None = Field(default=None, ge=1, strict=True)  # OpenAI's newer name for max_tokens
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, strict=True)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, strict=True)
    stop: str | list[str] | None = None
    stream: bool = Field(default=False, strict=True)
    n: int = Field(default=1, ge=1, le=1, strict=True)
    best_of: int = Field(default=1, ge=1, le=16, strict=True)  # DD2: samples per request, of which one is kept
    seed: int | None = Field(default=None, ge=0, lt=2**63, strict=True)
    # diffar's own
    method: str | None = None  # None: the method the server serves
    top_k: int = Field(default=0, ge=0, strict=True)
    steps: int | None = Field(default=None, ge=1, le=1000, strict=True)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=100.0, strict=True)
    preset: Literal["speed", "quality"] | None = None
    # DD2's read-out temperature tau(t) = max(tau_min, tau * (1 - t)), as `diffar generate --tau/--tau-min`
    tau: float | None = Field(default=None, ge=0.0, le=100.0, strict=True)
    tau_min: float | None = Field(default=None, ge=0.0, le=100.0, strict=True)
    # ReFusion with a domain adapter: the domain its diffusion stream drafts for (`diffar generate --domain`)
    domain: str | None = Field(default=None, max_length=200)
    # Human-in-the-loop: output position -> a token id to keep, or text to put there (it may span tokens)
    fixed_tokens: dict[int, int | str] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        """One check for both shapes, so an error names `stop` whichever shape was sent."""
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop is a string or a list of at most {MAX_STOP}, each at most {MAX_STOP_CHARS} "
                             "characters")
        return value

    @model_validator(mode="after")
    def _utf8(self):
        try:
            _check_utf8(dict(self))
        except UnicodeEncodeError:
            raise ValueError("text must be valid UTF-8 (it holds a lone surrogate)") from None
        return self

    @property
    def token_budget(self) -> int | None:
        return self.max_tokens or self.max_completion_tokens

    def stop_list(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(s for s in stops if s)


class CompletionRequest(GenerationFields):
    prompt: str


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)

    def prompt_text(self, task: str) -> str:
        """The text a model without a chat template reads (diffar's own are not chat-tuned): a seq2seq model
        translates the last user message, a continuation model continues the conversation's text. A chat
        model renders the messages through its template instead (serving/requests.py)."""
        if task == "seq2seq":
            users = [m.text for m in self.messages if m.role == "user"]
            return users[-1] if users else ""
        return "\n".join(m.text for m in self.messages)


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error the server answers, in OpenAI's shape (`error_body`)."""

    error: ErrorDetail


def _errors(*statuses: int) -> dict:
    return {s: {"model": ErrorResponse, "description": ERROR_MEANINGS[s]} for s in statuses}


ERROR_MEANINGS = {
    400: "an invalid body, field or Host header",
    401: "a missing or wrong API key (a server started with --api-key)",
    404: "a `model` this server does not serve",
    411: "a body without Content-Length",
    413: "a body over the server's --max-body-bytes",
    429: "busy: the waiting line is full, or a new request would wait longer than --max-wait-s; see Retry-After",
    503: "the generation worker is down, or generation failed",
}
SSE_EVENT = {"type": "object", "description": "one server-sent event", "required": ["data"],
             "properties": {"data": {"type": "string", "description": "a chunk as JSON, or [DONE] at the end"}}}
RETRY_AFTER = {"Retry-After": {"description": "seconds after which a retry likely succeeds",
                               "schema": {"type": "integer"}}}
# What the OpenAPI document says each route may answer (FastAPI's default 422 is never sent: invalid bodies get 400).
GENERATION_RESPONSES = {
    200: {"description": "the completion as JSON, or with `stream: true` server-sent events (`data: {chunk}` lines, "
                         "then `data: [DONE]`)",
          "content": {"application/json": {}, "text/event-stream": {"schema": SSE_EVENT}}},
    **_errors(400, 401, 404, 411, 413, 503),
    429: {**_errors(429)[429], "headers": RETRY_AFTER},
}
READ_RESPONSES = _errors(400, 401)
HEALTH_RESPONSES = {503: {"description": "the generation worker is down"}, **_errors(400)}
